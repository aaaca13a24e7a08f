"""What a run is: its precision, its model and its data. A resumed run must be the same run.

A checkpoint records the run's identity (`run_identity`) beside its config. `--resume` with a
recipe or overrides compares the identity they describe with the checkpoint's and refuses a
different run with one line naming every differing field: a run that went on in another
precision, on another model shape (whose weights would not even load) or on other data would be
a different experiment under the old run's name. A change of precision alone can be asked for
explicitly (`mxflux train --resume DIR RECIPE --allow-precision-change`): continuing a bf16 run
in MXFP6 is a legitimate study.
"""

from __future__ import annotations

import dataclasses
import json

from ..nn.precision import converter_class, registered_precisions
from .config import RecipeError, RunConfig

__all__ = ["IdentityMismatchError", "run_identity", "data_identity", "check_same_run", "check_same_data"]


class IdentityMismatchError(RecipeError):
    """A resume whose recipe describes another run than the checkpoint's."""


def data_identity(root, dataset) -> dict:
    """The data facts a run depends on: where it is and the shapes of its samples."""
    return {"root": root, "latent": list(dataset.latent_shape), "t5": list(dataset.t5_shape),
            "clip": dataset.clip_dim, "train_samples": len(dataset)}


def run_identity(cfg: RunConfig, dataset=None) -> dict:
    """{"precision": the precision block but its options that leave the values as they are,
    "model": the FluxConfig, "data": data.root and, with
    `dataset` (the training split), its sample shapes}, as JSON values."""
    data = data_identity(cfg.data.root, dataset) if dataset is not None else {"root": cfg.data.root}
    same_values = {o for name in registered_precisions() for o in converter_class(name).same_values}
    ident = {"precision": cfg.precision.model_dump(mode="json", exclude=same_values),
             "model": dataclasses.asdict(cfg.model.flux_config()), "data": data}
    return json.loads(json.dumps(ident))  # tuples as lists: comparable with a loaded one


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(saved: dict, now: dict) -> dict[str, tuple]:
    a, b = _flat(saved), _flat(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) & set(b)) if a.get(k) != b.get(k)}


def check_same_run(saved_config: dict, saved_identity: dict | None, cfg: RunConfig, *, run_dir,
                   allow_precision_change: bool) -> list[str]:
    """Refuse (IdentityMismatchError) a resume of the checkpoint in `run_dir` under `cfg` when
    they describe different runs; return the fields of an allowed change of precision."""
    from .config import config_from_dict

    saved = saved_identity or run_identity(config_from_dict(saved_config, f"of checkpoint in {run_dir}"))
    now = run_identity(cfg)
    now["data"] = {**saved.get("data", {}), "root": cfg.data.root}  # shapes: checked against the data later
    diff = _differences(saved, now)
    fields = {f"model.{k[6:]}" if k.startswith("model.") else k: v for k, v in diff.items()}
    precision = [k for k in fields if k.startswith("precision.")]
    if allow_precision_change and len(precision) == len(fields):
        return precision
    if not fields:
        return []
    listed = "; ".join(f"{k}: checkpoint {json.dumps(a)}, now {json.dumps(b)}" for k, (a, b) in fields.items())
    advice = ("; pass --allow-precision-change to continue it in the new precision on purpose"
              if len(precision) == len(fields) else "")
    raise IdentityMismatchError(f"--resume {run_dir}: the recipe describes another run than the checkpoint's "
                                f"({listed}); resume without RECIPE (the checkpoint's own recipe), or start a new "
                                f"run with another --out{advice}")


def check_same_data(saved_identity: dict | None, dataset, *, run_dir) -> None:
    """Refuse resuming onto data whose sample shapes differ from the checkpoint's."""
    saved = (saved_identity or {}).get("data", {})
    now = data_identity(saved.get("root"), dataset)
    diff = {f"data.{k}": v for k, v in _differences(saved, now).items() if k in ("latent", "t5", "clip")}
    if diff:
        listed = "; ".join(f"{k}: checkpoint {a}, now {b}" for k, (a, b) in diff.items())
        raise IdentityMismatchError(f"--resume {run_dir}: the data ({dataset.root}) is not the run's data "
                                    f"({listed}); resume on the dataset the run trained on")
