"""Training metrics: one CSV row per log step, TensorBoard scalars, and a loss-curve PNG."""

from __future__ import annotations

import csv
from pathlib import Path

from .callbacks import Callback
from .rundir import RunDirError

__all__ = ["MetricsLogger", "MetricsCallback", "plot_loss_curve"]


class MetricsLogger:
    """Appends metric rows to `metrics.csv` (and TensorBoard, if installed) under `out_dir`.

    A run that resumes at step S (`resume_step=S`) keeps the rows up to step S and drops later
    ones (logged after its last checkpoint, they are about to be trained again), and TensorBoard
    purges its events after S's samples (`resume_samples`): a resumed run's curves continue
    without duplicates. A new run (`resume_step=None`) starts a new file.
    """

    FIELDS = ("step", "samples", "split", "loss", "lr", "grad_norm", "images_per_s", "blocks_outside_window")
    KEY_FIELDS = FIELDS[:4]  # what every version of the file has begun with

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, resume_step: int | None = None,
                 resume_samples: int = 0):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.out_dir / "metrics.csv"
        if resume_step is None:
            self.csv_path.unlink(missing_ok=True)
        elif self.csv_path.exists():
            self._truncate_after(resume_step)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional at run time
                SummaryWriter = None
            if SummaryWriter is not None:
                purge = {"purge_step": resume_samples + 1} if resume_step is not None else {}
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), **purge)

    def _truncate_after(self, step: int) -> None:
        """Keep the rows up to the resumed step (a run resumed from its last checkpoint repeats the steps
        after it). Only a file that is this kind of metrics file is rewritten: anything else in its place
        is not ours to cut."""
        try:
            with open(self.csv_path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                ours = list(reader.fieldnames or [])[:len(self.KEY_FIELDS)] == list(self.KEY_FIELDS)
                rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) <= step] if ours else []
        except (UnicodeDecodeError, csv.Error):
            ours = False
        if not ours:
            raise RunDirError(f"{self.csv_path}: not an mxflux metrics file (expected a CSV whose header begins "
                              f"{','.join(self.KEY_FIELDS)}); the run leaves it as it is: move it away, or start "
                              f"over with --overwrite")
        tmp = self.csv_path.with_name(f".{self.csv_path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        tmp.replace(self.csv_path)

    def log(self, **row) -> None:
        row = {k: row.get(k, "") for k in self.FIELDS}
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "samples", "split") and v != "":
                    self._tb.add_scalar(f"{row['split']}/{k}", float(v), int(row["samples"]))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class MetricsCallback(Callback):
    """The trainer's metrics: a CSV row (and TensorBoard scalars) per log step and per eval, and
    the loss curve PNG at the end of `fit`. A run that resumed continues its files."""

    def __init__(self, out_dir: str | Path, *, title: str = ""):
        self.out_dir, self.title = Path(out_dir), title
        self.logger: MetricsLogger | None = None

    def on_fit_start(self, trainer, end_step: int) -> None:
        resumed = trainer.step > 0
        self.logger = MetricsLogger(self.out_dir, resume_step=trainer.step if resumed else None,
                                    resume_samples=trainer.samples)

    def on_log(self, trainer, row: dict) -> None:
        self.logger.log(split="train", **row)

    def on_eval_end(self, trainer, loss: float) -> bool:
        self.logger.log(step=trainer.step, samples=trainer.samples, split="eval", loss=loss)
        return False

    def on_fit_end(self, trainer) -> None:
        if self.logger is None:
            return
        self.logger.close()
        if self.logger.csv_path.exists():
            plot_loss_curve(self.logger.csv_path, self.out_dir / "loss_curve.png", title=self.title)


def plot_loss_curve(csv_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Train and eval loss against samples seen, from a metrics CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            if row["loss"]:
                xs, ys = series.setdefault(row["split"], ([], []))
                xs.append(int(row["samples"]))
                ys.append(float(row["loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    for split, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if split == "eval" else None, label=split)
    ax.set_xlabel("training samples")
    ax.set_ylabel("rectified-flow MSE")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)
