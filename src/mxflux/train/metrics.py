"""Training metrics: one CSV row per log step, TensorBoard scalars, and a loss-curve PNG."""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["MetricsLogger", "plot_loss_curve"]


class MetricsLogger:
    """Appends metric rows to `metrics.csv` (and TensorBoard, if installed) under `out_dir`."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, append: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.out_dir / "metrics.csv"
        self._fields: list[str] | None = None
        if append and self.csv_path.exists():
            with open(self.csv_path) as f:
                self._fields = next(csv.reader(f), None)
        elif self.csv_path.exists():
            self.csv_path.unlink()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None

    FIELDS = ("step", "samples", "split", "loss", "lr", "grad_norm", "images_per_s", "fold_outside_window")

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
