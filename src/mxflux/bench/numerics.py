"""`mxflux numerics`: how much signal MX quantization keeps, and whether the FP8 fold is exact.

For each element format and each rotation setting (Hadamard on/off) it quantizes an activation
matrix X [M, K] and reports (docs/design.md, "Element formats and E8M0 scales" and "The exact FP8
fold and its window"):

- ``snr_db``: SNR of dequantize(quantize(X)) against X;
- ``saturated_frac``: fraction of elements at the format's largest magnitude;
- ``zero_block_frac``: fraction of blocks whose MX_BLOCK (32) codes are all (signed) zero;
- ``outside_window_frac``: blocks_outside_window / blocks: the fraction of X's blocks the
  row-wise FP8 fold cannot encode exactly;
- a GEMM study against weights W [N, K]: ``gemm_snr_db`` is the SNR of the exact MX GEMM
  against the unquantized float64 product, and ``fold_error_ratio`` is
  ‖Y_fold − Y_true‖ / ‖Y_mx − Y_true‖, where Y_fold emulates the row-wise-scaled FP8 GEMM
  (``torch._scaled_mm``) on the folded operands. It is 1.0 when the fold is exact.

Fold columns are None ("n/a") for formats whose elements have no exact E4M3 image.

With ``--linear`` it also runs X through the linear layers that training uses (MXFP6Linear with
the rotation on and off), forward and backward with a random dY, and adds one row per
GEMM: ``format`` names the layer and GEMM (e.g. "MXFP6Linear.wgrad") and ``gemm_snr_db`` is that
GEMM's SNR against float64; the quantizer columns are None.

`run_numerics` is the pure computation (tensors in, rows out); `render` prints the rows;
`command` is the CLI glue. Non-finite metrics (an exact reconstruction has infinite SNR) are
reported as None in JSON, which has no infinity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from mxflux.mx import MX_BLOCK, FoldGranularity, MXTensor, fold_to_e4m3, mx_matmul, quantize, snr_db

__all__ = [
    "DEFAULT_SHAPE",
    "DISTRIBUTIONS",
    "InputError",
    "command",
    "load_input",
    "make_input",
    "make_weight",
    "render",
    "run_linear_numerics",
    "run_numerics",
]

DEFAULT_SHAPE = (4096, 3072)
DISTRIBUTIONS = ("normal", "laplace", "student-t", "outliers")
# "outliers": a few channels (columns) carry far larger values, as seen in transformer activations.
OUTLIER_EVERY = 256  # one outlier channel per this many columns (at least one)
OUTLIER_SCALE = 50.0
WEIGHT_STD = 0.02

# Row keys, in output order. Later issues may add rows (e.g. per linear layer), not keys.
KEYS = (
    "format",
    "hadamard",
    "snr_db",
    "saturated_frac",
    "zero_block_frac",
    "outside_window_frac",
    "gemm_snr_db",
    "fold_error_ratio",
)


class InputError(ValueError):
    """Bad user input; the message names the command-line argument at fault."""


# ---------------------------------------------------------------------------------------------
# Inputs


def make_input(dist: str, shape: tuple[int, int], *, seed: int = 0, df: float = 3.0) -> torch.Tensor:
    """A float32 CPU matrix of `shape` drawn from `dist` (numpy's generator: same on any device)."""
    rng = np.random.default_rng([seed, 0])  # stream 0: X; stream 1: W (see make_weight)
    if dist == "normal":
        x = rng.standard_normal(shape, dtype=np.float32)
    elif dist == "laplace":
        x = rng.laplace(size=shape).astype(np.float32)
    elif dist == "student-t":
        x = rng.standard_t(df, size=shape).astype(np.float32)
    elif dist == "outliers":
        x = rng.standard_normal(shape, dtype=np.float32)
        k = shape[1]
        cols = rng.choice(k, size=max(1, k // OUTLIER_EVERY), replace=False)
        x[:, cols] *= OUTLIER_SCALE
    else:
        raise InputError(f"--dist: unknown distribution {dist!r}; expected one of {list(DISTRIBUTIONS)}")
    return torch.from_numpy(x)


def make_weight(rows: int, k: int, *, seed: int = 0) -> torch.Tensor:
    """GEMM weights W ~ 0.02·normal, [rows, k] float32 on CPU."""
    rng = np.random.default_rng([seed, 1])
    return torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32) * np.float32(WEIGHT_STD))


def load_input(path: str | Path, key: str | None = None) -> torch.Tensor:
    """Read one tensor from a .pt or .safetensors file as a float32 2-D [rows, last dim] matrix.

    A .pt file may hold a tensor or a dict of tensors; `key` picks one from a dict (it may be
    left out when the dict holds a single tensor).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--file: no such file: {str(path)!r}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        elif suffix in (".pt", ".pth"):
            obj = torch.load(path, map_location="cpu", weights_only=True)  # never runs pickled code
        else:
            raise InputError(f"--file: expected a .pt or .safetensors file, got {str(path)!r}")
    except InputError:
        raise
    except Exception as e:  # a corrupt or foreign file: report it against the argument
        raise InputError(f"--file: cannot read {str(path)!r}: {e}") from None

    if isinstance(obj, torch.Tensor):
        if key is not None:
            raise InputError(f"--key: {str(path)!r} holds a single tensor, not a dict; drop --key")
        t, name = obj, str(path)
    elif isinstance(obj, dict):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if key is None:
            if len(tensors) != 1:
                raise InputError(
                    f"--key: {str(path)!r} holds {len(tensors)} tensors; pick one with --key "
                    f"(available: {sorted(tensors)})"
                )
            key = next(iter(tensors))
        if key not in tensors:
            raise InputError(f"--key: no tensor {key!r} in {str(path)!r}; available: {sorted(tensors)}")
        t, name = tensors[key], f"{path}[{key}]"
    else:
        raise InputError(f"--file: {str(path)!r} holds a {type(obj).__name__}, expected a tensor or a dict of tensors")

    if not t.is_floating_point():
        raise InputError(f"--file: tensor {name} has dtype {t.dtype}, expected a floating-point tensor")
    if t.dim() == 0 or t.numel() == 0:
        raise InputError(f"--file: tensor {name} has shape {tuple(t.shape)}, expected a non-empty matrix")
    if t.shape[-1] % MX_BLOCK:
        raise InputError(
            f"--file: tensor {name} has last dimension {t.shape[-1]}, expected a multiple of {MX_BLOCK} "
            "(MX blocks run along the last dimension)"
        )
    return t.reshape(-1, t.shape[-1]).float()


# ---------------------------------------------------------------------------------------------
# Metrics


def _blocks(t: torch.Tensor, mx: MXTensor) -> torch.Tensor:
    """View a tensor shaped like `mx.codes` as [..., n_blocks, block] along the quantization axis."""
    t = t.movedim(mx.axis, -1)
    return t.reshape(*t.shape[:-1], t.shape[-1] // mx.block, mx.block)


def _zero_block_frac(mx: MXTensor) -> float:
    magnitude = _blocks(mx.codes, mx) & (mx.format.sign_mask - 1)  # drop the sign bit: -0 is zero
    return float((magnitude.amax(dim=-1) == 0).double().mean())


def _saturated_frac(mx: MXTensor) -> float:
    return float((mx.element_values().abs() == mx.format.max).double().mean())


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def run_numerics(
    x: torch.Tensor,
    w: torch.Tensor,
    formats: Sequence[str] = ("e2m3",),
    *,
    hadamard: Iterable[bool] = (True, False),
    on_step: Callable[[str], None] | None = None,
) -> list[dict]:
    """Quantization and GEMM metrics of X [M, K] against weights W [N, K], one row per setting.

    `x` and `w` must be on the same device; K must be a multiple of MX_BLOCK (32). `on_step(description)`
    is called before each unit of work (for progress bars): once for the reference GEMM, then
    once per (format, rotation).
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x, w: expected [M, K] and [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    step = on_step or (lambda _desc: None)
    x, w = x.float(), w.float()

    step("reference GEMM (float64)")
    y_true = x.double() @ w.double().t()

    rows = []
    for fmt in formats:
        for rot in hadamard:
            step(f"{fmt}, rotation {'on' if rot else 'off'}")
            qx = quantize(x, fmt, hadamard=rot)
            qw = quantize(w, fmt, hadamard=rot)
            y_mx = mx_matmul(qx, qw, out_dtype=torch.float32)
            row = {
                "format": fmt,
                "hadamard": rot,
                "snr_db": _finite(snr_db(x, qx.dequantize(torch.float32))),
                "saturated_frac": _saturated_frac(qx),
                "zero_block_frac": _zero_block_frac(qx),
                "outside_window_frac": None,
                "gemm_snr_db": _finite(snr_db(y_true, y_mx)),
                "fold_error_ratio": None,
            }
            # Formats whose elements have no exact E4M3 image (e5m2) have no fold: columns stay None.
            if qx.format.fold_window is not None:
                dx, sx, blocks_outside_window = fold_to_e4m3(qx, FoldGranularity.ROWWISE)
                dw, sw, _ = fold_to_e4m3(qw, FoldGranularity.ROWWISE)
                row["outside_window_frac"] = int(blocks_outside_window) / (qx.codes.numel() // qx.block)
                # torch._scaled_mm row-wise: E4M3 products summed in fp32, then the two scales
                # applied in the epilogue (sx is [M, 1], sw is [N, 1]).
                y_fold = (dx.float() @ dw.float().t()) * sx * sw.t()
                mx_err = float((y_mx.double() - y_true).norm())
                fold_err = float((y_fold.double() - y_true).norm())
                row["fold_error_ratio"] = _finite(fold_err / mx_err) if mx_err else None
            rows.append(row)
    return rows


def run_linear_numerics(x: torch.Tensor, w: torch.Tensor, *, seed: int = 0) -> list[dict]:
    """SNR of each GEMM of the training layers on X [M, K] (bf16) and W [N, K] against float64.

    Rows use the same keys as `run_numerics`; `format` is "<layer>.<gemm>", and only
    `gemm_snr_db` is filled. dY ~ normal [M, N]; the bias is zero (it is exact in every layer).
    """
    from torch import nn

    from mxflux.nn import MXFP6Linear

    g = torch.Generator(device="cpu").manual_seed(seed)
    dy = torch.randn(x.shape[0], w.shape[0], generator=g).to(x.device, torch.bfloat16)
    xb, wb = x.bfloat16(), w.bfloat16()

    x64 = xb.double().requires_grad_()
    w64 = wb.double().requires_grad_()
    (x64 @ w64.t()).backward(dy.double())
    y64 = (xb.double() @ wb.double().t())

    layers = [("MXFP6Linear", True, dict()), ("MXFP6Linear", False, dict(hadamard=False))]
    rows = []
    for name, rot, kwargs in layers:
        base = nn.Linear(w.shape[1], w.shape[0], bias=False, device=x.device, dtype=torch.bfloat16)
        with torch.no_grad():
            base.weight.copy_(wb)
        layer = MXFP6Linear.from_linear(base, **kwargs)
        xin = xb.clone().requires_grad_()
        y = layer(xin)
        y.backward(dy)
        for gemm, ref, got in (("fprop", y64, y), ("dgrad", x64.grad, xin.grad), ("wgrad", w64.grad, base.weight.grad)):
            row = dict.fromkeys(KEYS)
            row.update(format=f"{name}.{gemm}", hadamard=rot, gemm_snr_db=_finite(snr_db(ref, got)))
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Output


def _num(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, spec)


# (header, cell) per table column; headers are short so the table fits 80 columns.
_COLUMNS = (
    ("format", lambda r: r["format"]),
    ("rot", lambda r: "n/a" if r["hadamard"] is None else "on" if r["hadamard"] else "off"),
    ("SNR dB", lambda r: _num(r["snr_db"], ".2f")),
    ("sat %", lambda r: _num(r["saturated_frac"], ".3f", 100)),
    ("zero %", lambda r: _num(r["zero_block_frac"], ".3f", 100)),
    ("outside %", lambda r: _num(r["outside_window_frac"], ".3f", 100)),
    ("GEMM dB", lambda r: _num(r["gemm_snr_db"], ".2f")),
    ("fold/MX", lambda r: _num(r["fold_error_ratio"], ".5f")),
)


def interpret(rows: list[dict]) -> str:
    """One line a reader can act on: what rotation buys, and whether the FP8 fold is exact."""
    parts = []
    for fmt in dict.fromkeys(r["format"] for r in rows if r["snr_db"] is not None):
        by_rot = {r["hadamard"]: r for r in rows if r["format"] == fmt}
        bits = []
        if True in by_rot and False in by_rot and None not in (by_rot[True]["snr_db"], by_rot[False]["snr_db"]):
            delta = round(by_rot[True]["snr_db"] - by_rot[False]["snr_db"], 2) + 0.0  # no "-0.00"
            bits.append(f"rotation changes SNR by {delta:+.2f} dB")
        outside = [r["outside_window_frac"] for r in by_rot.values()]
        if any(o is None for o in outside):
            bits.append("no exact FP8 fold for this format")
        elif all(o == 0 for o in outside):
            bits.append("the row-wise FP8 fold is exact")
        else:
            worst = max(r["fold_error_ratio"] or 1.0 for r in by_rot.values())
            bits.append(
                f"{max(outside):.3%} of blocks fall outside the FP8 fold window "
                f"(fold error up to {worst:.4f}x the MX error)"
            )
        parts.append(f"{fmt}: " + ", ".join(bits))
    return "; ".join(parts) + "."


def render(rows: list[dict], console, workload: str | None = None) -> None:
    """Print `rows` as a rich table (after a `workload` line, if given) and the one-line interpretation."""
    from rich.table import Table

    if workload:
        console.print(workload)
    quant = [r for r in rows if r["snr_db"] is not None or r["outside_window_frac"] is not None]
    layers = [r for r in rows if r not in quant]
    table = Table(caption=(
        "rot: Hadamard rotation; sat: elements at the format's max; zero: all-zero blocks; "
        "outside: blocks outside the FP8 fold window; GEMM: exact MX GEMM vs float64; "
        "fold/MX: FP8-fold GEMM error / MX GEMM error"))
    for header, _ in _COLUMNS:
        table.add_column(header, justify="left" if header in ("format", "rot") else "right")
    for r in quant:
        table.add_row(*(cell(r) for _, cell in _COLUMNS))
    console.print(table)
    if layers:
        # Linear-layer rows (--linear): one per GEMM, only the SNR is meaningful.
        lt = Table(caption="SNR of each GEMM of the layer (bf16 in, bf16 out) against float64")
        for header in ("layer", "rot", "GEMM", "SNR dB"):
            lt.add_column(header, justify="right" if header == "SNR dB" else "left")
        for r in layers:
            layer, gemm = r["format"].split(".")
            lt.add_row(layer, _COLUMNS[1][1](r), gemm, _num(r["gemm_snr_db"], ".2f"))
        console.print(lt)
    console.print(interpret(rows))


# ---------------------------------------------------------------------------------------------
# CLI glue


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device: cuda was requested but no CUDA device is available; use --device cpu")
    return torch.device(name)


def command(args) -> int:
    """Run `mxflux numerics` from parsed arguments (see mxflux.cli). Raises InputError on bad input."""
    from rich.console import Console
    from rich.progress import Progress

    if args.file is not None:
        if args.shape is not None:
            raise InputError("--shape: cannot be combined with --file (the file's tensor sets the shape)")
        if args.df is not None:
            raise InputError("--df: only applies to --dist student-t, not to --file")
    elif args.key is not None:
        raise InputError("--key: only applies together with --file")
    elif args.df is not None and args.dist != "student-t":
        raise InputError(f"--df: only applies to --dist student-t, not to --dist {args.dist}")
    device = _resolve_device(args.device)

    if args.file is not None:
        x = load_input(args.file, args.key)
        source = args.file + (f"[{args.key}]" if args.key else "")
    else:
        shape = args.shape or DEFAULT_SHAPE
        df = 3.0 if args.df is None else args.df
        x = make_input(args.dist, shape, seed=args.seed, df=df)
        source = args.dist + (f"(df={df:g})" if args.dist == "student-t" else "") + f" seed {args.seed}"
    w = make_weight(args.weight_rows, x.shape[1], seed=args.seed)
    x, w = x.to(device), w.to(device)

    if args.json:
        rows = run_numerics(x, w, args.formats)
        if args.linear:
            rows += run_linear_numerics(x, w, seed=args.seed)
        print(json.dumps(rows, indent=2))
        return 0

    console = Console()
    n_steps = 1 + 2 * len(args.formats) + int(args.linear)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("numerics", total=n_steps)

        steps_started = 0

        def on_step(desc: str) -> None:
            # Called as a step starts, so every step before it is done.
            nonlocal steps_started
            progress.update(task, description=desc, completed=steps_started)
            steps_started += 1

        rows = run_numerics(x, w, args.formats, on_step=on_step)
        if args.linear:
            on_step("linear layers: forward and backward")
            rows += run_linear_numerics(x, w, seed=args.seed)
    workload = (f"X {x.shape[0]}x{x.shape[1]} {source} | W {w.shape[0]}x{w.shape[1]} "
                f"{WEIGHT_STD}·normal | {device.type}")
    render(rows, console, workload)
    return 0
