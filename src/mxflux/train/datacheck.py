"""A recipe's data against its model, before any work: `mxflux check-config` and `mxflux train`.

Data whose dims the model does not read (`mxflux.data.fit`) is an error naming both sides; on the
built-in demo dataset, sample prompts with words that no demo caption uses are a warning (they
encode, but the model never saw them: `mxflux.data.demo.unknown_prompt_words_warning`).
"""

from __future__ import annotations

import sys

__all__ = ["check_recipe_data", "warn_unknown_prompt_words"]


def check_recipe_data(cfg, parser) -> None:
    """`parser.error` (one line, exit 2) when `cfg`'s data does not fit its model; warn about the
    recipe's sample prompts when they are drawn with the demo encoder."""
    from ..data import DataError
    from ..data.fit import data_model_mismatch

    try:
        why = data_model_mismatch(cfg.data.root, cfg.model.flux_config(), model_name=cfg.model.name, recipe=cfg.name)
    except DataError as e:
        parser.error(str(e))
    if why:
        parser.error(why)
    if cfg.data.root is None:
        warn_unknown_prompt_words(cfg.train.sample_prompts)


def warn_unknown_prompt_words(prompts) -> None:
    """One line on stderr for prompt words the demo text encoder's captions never had."""
    from ..data.demo import unknown_prompt_words_warning

    warning = unknown_prompt_words_warning(list(prompts))
    if warning:
        print(warning, file=sys.stderr)
