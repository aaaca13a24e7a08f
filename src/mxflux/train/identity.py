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
import hashlib
import json
import os
import uuid
from pathlib import Path

from ..nn.precision import converter_class, registered_precisions
from .config import RecipeError, RunConfig

__all__ = ["RESUME_MAY_CHANGE", "RUN_ID_FILE", "IdentityMismatchError", "check_run_id", "new_run_id", "record_run_id",
           "with_absolute_data_root", "run_identity", "data_identity", "check_same_run", "check_same_data"]


class IdentityMismatchError(RecipeError):
    """A resume whose recipe describes another run than the checkpoint's."""


def data_identity(root, dataset) -> dict:
    """The data facts a run depends on: where it is, the shapes of its samples, how many there are, and
    a fingerprint of its meta.json (which names its shards and their sizes: a dataset rewritten in place
    has another one), read in a few microseconds."""
    ident = {"root": root, "latent": list(dataset.latent_shape), "t5": list(dataset.t5_shape),
             "clip": dataset.clip_dim, "train_samples": len(dataset)}
    meta = Path(dataset.root) / "meta.json" if getattr(dataset, "root", None) else None
    if meta is not None and meta.is_file():
        ident["meta_sha256"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    return ident


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


# What a resume may change (`--set` or a RECIPE) without becoming another run: how long it trains, how
# often it logs, evaluates, checkpoints and what it samples, and how the same step is executed (compile,
# CUDA graphs, optimizer kernels, the data loader's workers, the parallel layout and with it the
# micro-batch, the global batch staying). Every other field is the run's; a change of precision can be asked for
# (--allow-precision-change). A change made is logged as `field: old -> new`.
RESUME_MAY_CHANGE = (
    "name", "description", "train.train_samples", "train.eval_every_samples", "train.eval_samples",
    "train.eval_batch_size", "train.log_every", "train.checkpoint_every", "train.out_dir", "train.sample_prompts",
    "train.sample_steps", "train.sample_guidance", "train.sample_shift", "train.cuda_graph", "model.compile",
    "model.compile_mode", "optim.implementation", "data.num_workers", "data.prefetch_factor",
    "batch.micro_batch_size", "distributed.*", "mlperf.submission_org", "mlperf.submission_platform",
)


def _absolute(root: str | None) -> str | None:
    """A data root as an absolute path (new runs store it so; an older checkpoint's relative one is taken
    from the directory the command runs in, as it was then)."""
    return None if root is None else str(Path(root).resolve())


def with_absolute_data_root(cfg: RunConfig) -> RunConfig:
    """`cfg` with data.root (and a LoRA run's model.init_from) absolute, as a run stores them: resuming
    from another directory then reads the same data and base, not whatever the relative path names there."""
    if cfg.data.root is not None and not Path(cfg.data.root).is_absolute():
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": _absolute(cfg.data.root)})})
    if cfg.lora is not None and cfg.model.init_from and not Path(cfg.model.init_from).is_absolute():
        # a LoRA run's base is read again on every resume: the same file, wherever the resume starts
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": _absolute(cfg.model.init_from)})})
    return cfg


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUME_MAY_CHANGE)


def check_same_run(saved_config: dict, saved_identity: dict | None, cfg: RunConfig, *, run_dir,
                   allow_precision_change: bool) -> list[str]:
    """Refuse (IdentityMismatchError) a resume of the checkpoint in `run_dir` under `cfg` when they
    describe different runs: another model, data or precision (`run_identity`), or any recipe field
    outside RESUME_MAY_CHANGE. Returns the changes made, as "field: old -> new" (an allowed change of
    precision included)."""
    from .config import config_from_dict

    saved = saved_identity or run_identity(config_from_dict(saved_config, f"of checkpoint in {run_dir}"))
    now = run_identity(cfg)
    saved = {**saved, "data": {**saved.get("data", {}), "root": _absolute(saved.get("data", {}).get("root"))}}
    now["data"] = {**saved["data"], "root": _absolute(cfg.data.root)}  # shapes: checked against the data later
    diff = _differences(saved, now)
    fields = {f"model.{k[6:]}" if k.startswith("model.") else k: v for k, v in diff.items()}
    recipe = {k: v for k, v in _differences(saved_config, cfg.model_dump(mode="json")).items()
              if not k.startswith(("precision.", "model.overrides", "model.name", "data.root")) and k not in fields}
    changes = [f"{k}: {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in recipe.items() if _may_change(k)]
    fields.update({k: v for k, v in recipe.items() if not _may_change(k)})
    precision = [k for k in fields if k.startswith("precision.")]
    if allow_precision_change and len(precision) == len(fields):
        return changes + [f"{k}: {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in fields.items()]
    if not fields:
        return changes
    listed = "; ".join(f"{k}: checkpoint {json.dumps(a)}, now {json.dumps(b)}" for k, (a, b) in fields.items())
    advice = ("; pass --allow-precision-change to continue it in the new precision on purpose"
              if len(precision) == len(fields) else "")
    raise IdentityMismatchError(f"--resume {run_dir}: the recipe describes another run than the checkpoint's "
                                f"({listed}); a resume may change only how long and how the run goes on "
                                f"({', '.join(RESUME_MAY_CHANGE[2:])}); resume without those changes, or start a "
                                f"new run with another --out{advice}")


def check_same_data(saved_identity: dict | None, dataset, *, run_dir) -> None:
    """Refuse resuming onto data whose sample shapes differ from the checkpoint's."""
    saved = (saved_identity or {}).get("data", {})
    now = data_identity(saved.get("root"), dataset)
    # (a checkpoint written before a fact was recorded is held to the facts it has)
    diff = {f"data.{k}": v for k, v in _differences(saved, now).items()
            if k in ("latent", "t5", "clip", "train_samples", "meta_sha256")}
    if diff:
        listed = "; ".join(f"{k}: checkpoint {a}, now {b}" for k, (a, b) in diff.items())
        raise IdentityMismatchError(f"--resume {run_dir}: the data ({dataset.root}) is not the run's data "
                                    f"({listed}); it was replaced or changed since: resume on the dataset the "
                                    f"run trained on, or start a new run with another --out")


# The run's id: drawn when a run starts, kept in every checkpoint it writes and in its directory's
# RUN_ID_FILE. A checkpoint copied into another run's directory has another id than the directory: resuming
# it there would splice two runs' metrics, so it is refused naming both.
RUN_ID_FILE = "run_id"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def record_run_id(out_dir, run_id: str) -> None:
    """Write the run's id into its directory where none is recorded yet (atomically)."""
    path = Path(out_dir) / RUN_ID_FILE
    if path.exists():
        return
    tmp = path.with_name(f".{RUN_ID_FILE}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)


def check_run_id(state: dict, run_dir, checkpoint) -> None:
    """Refuse a checkpoint whose run id is not the one its run directory records (both present)."""
    saved = state.get("run_id")
    path = Path(run_dir) / RUN_ID_FILE
    try:
        recorded = path.read_text().strip() if path.is_file() else None
    except OSError:
        recorded = None
    if saved and recorded and saved != recorded:
        raise IdentityMismatchError(f"checkpoint {checkpoint} belongs to run {saved}, but {run_dir} holds run "
                                    f"{recorded} ({path}): it was copied in from another run; resume it in its own "
                                    f"directory, or start this one over with --overwrite")
