"""A recipe's data against its model, before any work: `mxflux check-config` and `mxflux train`.

Data whose dims the model does not read (`mxflux.data.fit`), or with fewer training samples than one
global batch, is an error naming both sides; on the
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
    n_train = _training_samples(cfg.data.root)
    if n_train is not None and cfg.batch.global_batch_size > n_train:
        where = cfg.data.root or "the built-in demo dataset"
        parser.error(f"batch.global_batch_size: {cfg.batch.global_batch_size} images a step, but {where} holds "
                     f"{n_train} training samples; lower the batch or train on more data")
    if cfg.data.root is None:
        warn_unknown_prompt_words(cfg.train.sample_prompts)


def _training_samples(root) -> int | None:
    """The training split's sample count (the demo dataset's when `root` is None); None where unknown."""
    from ..data import DataError

    if root is None:
        from ..data.demo import DEMO_TRAIN_SAMPLES

        return DEMO_TRAIN_SAMPLES
    try:
        from ..data.shards import read_meta

        return read_meta(root).splits["train"].num_samples
    except (DataError, KeyError, OSError):
        return None  # data_model_mismatch has named what is wrong with it


def warn_unknown_prompt_words(prompts) -> None:
    """One line on stderr for prompt words the demo text encoder's captions never had."""
    from ..data.demo import unknown_prompt_words_warning

    warning = unknown_prompt_words_warning(list(prompts))
    if warning:
        print(warning, file=sys.stderr)
