"""The `mxflux` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`handler`, listed in `SUBCOMMANDS`. Argument parsing uses only the standard library; handlers
import their (torch-heavy) modules when they run, so `mxflux --help` and `--version` start fast.
Handlers return an exit code. A user's mistake found deeper down (a recipe, checkpoint, dataset
or run directory that cannot be used as asked: `USER_ERRORS`) is one line on stderr and exit
status 2 (so are a permission problem and a full disk, naming the path), a run stopped by a
non-finite value exit status 1, and a stop signal 128 + its number, without a traceback;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_early(signum, frame):
    """A stop signal before the command has its own handling: one line and 128 + its number. Nothing of
    the command's is open yet, and raising here could unwind through a C++ extension that torch or numba
    is loading (pybind11 then aborts the process), so the process ends at once; a Ctrl-C once `main` runs
    is Python's own KeyboardInterrupt, which `main` reports (held back a moment where it is unsafe to
    raise: `mxflux.train.stop.unsafe_to_raise`)."""
    if signum == signal.SIGINT and _MAIN_RUNNING:
        from mxflux.train.stop import deliver_again_soon, unsafe_to_raise  # torch-free

        if unsafe_to_raise(frame):
            deliver_again_soon(signum)
            return
        raise KeyboardInterrupt
    os.write(2, f"mxflux: interrupted ({signal.Signals(signum).name}) while starting; nothing was written\n".encode())
    os._exit(128 + signum)


# Run as the command (the console script, or `python -m mxflux.cli` while its package is imported), a stop
# signal from this first moment on is one line: no traceback for a Ctrl-C in the first tenth of a second,
# no silent death by SIGTERM or SIGHUP. Imported as a library (tests, a user's code), nothing is installed.
_MAIN_RUNNING = False
if os.path.basename(sys.argv[0]) in ("mxflux", "-m"):
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _stopped_early)

import argparse  # noqa: E402
import difflib  # noqa: E402
import errno  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from mxflux import __version__  # noqa: E402

from .threads import configure_threads  # noqa: E402
from mxflux.argtypes import positive_float, positive_int

# ---------------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse reports against the argument.


def _shape(text: str) -> tuple[int, int]:
    """'MxK' → (M, K), both positive multiples of 32 (MX blocks are 32 elements)."""
    parts = text.lower().split("x")
    try:
        m, k = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxK such as 4096x3072, got {text!r}") from None
    if m <= 0 or k <= 0 or m % 32 or k % 32:
        raise argparse.ArgumentTypeError(f"expected M and K to be positive multiples of 32, got {text!r}")
    return m, k


def _formats(text: str) -> list[str]:
    """'e2m3,e3m2' → ['e2m3', 'e3m2'], each a known MX element format."""
    from mxflux.mx import FORMATS  # imports torch: only when this argument is given

    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown format(s) {unknown or text!r}; expected a comma-separated list of {sorted(FORMATS)}"
        )
    return list(dict.fromkeys(names))  # drop repeats, keep order


def _add_numerics(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "numerics",
        help="MX quantization SNR, saturation and FP8-fold exactness on synthetic or saved tensors",
        description=(
            "Quantize an activation matrix X [M,K] to MX (per format, Hadamard rotation on and off) "
            "and report the SNR, saturation, zero blocks, the fraction of blocks outside the exact "
            "row-wise FP8 fold window, and a GEMM study X·Wᵀ against weights W ~ 0.02·normal [N,K]."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dist", choices=["normal", "laplace", "student-t", "outliers"], default="normal",
                     help="synthetic X: outliers = normal with 1 in 256 columns scaled 50x (default: normal)")
    src.add_argument("--file", metavar="PATH",
                     help="read X from a .pt (tensor or dict of tensors) or .safetensors file, "
                          "viewed as [rows, last dim]")
    p.add_argument("--key", metavar="NAME", help="tensor to read from a --file holding several")
    p.add_argument("--df", type=positive_float, help="degrees of freedom of --dist student-t (default: 3)")
    p.add_argument("--shape", type=_shape, metavar="MxK",
                   help="shape of synthetic X, multiples of 32 (default: 4096x3072)")
    p.add_argument("--formats", type=_formats, default=["e2m3"], metavar="LIST",
                   help="comma-separated element formats: e2m3,e3m2,e2m1,e4m3,e5m2 (default: e2m3)")
    p.add_argument("--weight-rows", type=positive_int, default=1024, metavar="N",
                   help="rows N of the GEMM's weight operand W [N,K] (default: 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic X and of W (default: 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--linear", action="store_true",
                   help="also run X through MXFP6Linear (rotation on and off), forward and "
                        "backward, and report the SNR of each GEMM (fprop, dgrad, wgrad) against float64")
    p.add_argument("--json", action="store_true", help="print only JSON: a list of row objects")
    p.set_defaults(handler=_numerics, parser=p)


def _numerics(args: argparse.Namespace) -> int:
    from mxflux.bench import numerics

    try:
        return numerics.command(args)
    except numerics.InputError as e:
        args.parser.error(str(e))  # exits 2


def _lazy(module: str, fn: str):
    """A registration function that lives in another module (imported only to register)."""
    def add(sub: argparse._SubParsersAction) -> None:
        import importlib

        getattr(importlib.import_module(module), fn)(sub)
    return add


# One registration function per subcommand, in `mxflux --help` order.
SUBCOMMANDS = (
    _lazy("mxflux.cli.train", "add_train_parser"),
    _lazy("mxflux.cli.evaluate", "add_eval_parser"),
    _lazy("mxflux.cli.sample", "add_sample_parser"),
    _lazy("mxflux.cli.export", "add_export_parser"),
    _lazy("mxflux.cli.recipes", "add_check_config_parser"),
    _lazy("mxflux.cli.recipes", "add_recipes_parser"),
    _lazy("mxflux.cli.data", "add_data_parser"),
    _lazy("mxflux.cli.bench", "add_bench_parser"),
    _add_numerics,
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a mistyped command names the closest one ("did you mean")."""

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1, cutoff=0.6)
            if close:
                self.error(f"argument {argparse._get_action_name(action)}: invalid choice: {value!r}; did you mean "
                           f"{close[0]!r}? (choose from {', '.join(map(repr, action.choices))})")
        super()._check_value(action, value)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mxflux",
        description="mxflux: Flux diffusion transformers with MXFP6 linear layers.",
    )
    parser.add_argument("--version", action="version", version=f"mxflux {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (may also follow the command)")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something that cannot be done as given; each
    one's message names the file or field and what was expected. Imported only once one was
    raised (their modules import torch)."""
    from mxflux.data.shards import DataError
    from mxflux.model.lora_file import LoRAFileError
    from mxflux.model.weights import FluxWeightsError
    from mxflux.train.checkpoint import CheckpointCorruptError, CheckpointNotFoundError
    from mxflux.train.config import RecipeError
    from mxflux.train.rundir import RunDirError

    return (DataError, CheckpointCorruptError, CheckpointNotFoundError, FluxWeightsError, LoRAFileError, RecipeError,
            RunDirError)


def _interrupted() -> type[BaseException]:
    from mxflux.train.stop import Interrupted  # torch-free

    return Interrupted


# errors of the file system a user's path runs into: one line naming the path, not a traceback
_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOTDIR, errno.EEXIST,
                errno.EISDIR, errno.ENAMETOOLONG, errno.ENOENT)


def _os_error_line(e: OSError) -> str:
    """A permission problem, a full disk, a read-only file system, a missing path or one that cannot be
    made (a file where a directory is needed on the way, a special file system), naming the path."""
    path = f" {str(e.filename)!r}" if e.filename else ""
    if e.errno == errno.ENOTDIR:
        return f"not a directory:{path}: a file stands where a directory is needed on the way to it"
    if e.errno == errno.EEXIST:
        return f"file exists:{path}: it stands where this command writes (a directory on the way, or its output)"
    if e.errno == errno.EISDIR:
        return f"is a directory:{path}, where a file is needed"
    if e.errno == errno.ENAMETOOLONG:
        return f"file name too long:{path}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied:{path} cannot be read or written by this user "
                f"(check its permissions and those of its directories)")
    if e.errno == errno.EROFS:
        return f"read-only file system:{path} cannot be written"
    if e.errno == errno.ENOENT:
        return (f"no such file or directory:{path} (missing, gone while the command ran, or on a file system "
                f"that cannot hold it, such as /proc)")
    return f"no space left on device{(' writing' + path) if path else ''}: free some space and run again"


def _out_of_memory(e: BaseException) -> bool:
    """A device or host allocation that failed: torch's OutOfMemoryError, the CPU allocator's
    RuntimeError, Python's MemoryError."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mxflux` console script; returns the exit status."""
    global _MAIN_RUNNING
    _MAIN_RUNNING = True
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a Ctrl-C before the command's own handling began (parsing, say)
        print("mxflux: interrupted (SIGINT) while starting", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_threads()  # before any command imports torch or numba, which read it as they start
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere, not only before the command
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = ["mxflux", *argv]  # as a reader would rerun it (results record it: mxflux.bench.provenance)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    command = getattr(args, "parser", parser).prog
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled, not at interpreter exit
        return code
    except BrokenPipeError:  # `mxflux ... | head`: the reader is gone, nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what the shell reports for a command killed by it
    except (KeyboardInterrupt, _interrupted()) as e:  # a stop signal outside a run's own handling
        if debug:
            raise
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except Exception as e:
        if debug:
            raise
        if isinstance(e, OSError) and e.errno in _PATH_ERRNOS:
            print(f"{command}: error: {_os_error_line(e)}", file=sys.stderr)
            return 2
        from mxflux.switches import SwitchError  # torch-free: the modules that raise it may not import again

        if isinstance(e, SwitchError):
            print(f"{command}: error: {e}", file=sys.stderr)
            return 2
        from mxflux.train.stop import NonFiniteError

        if isinstance(e, NonFiniteError):
            print(f"{command}: stopped: {e}", file=sys.stderr)
            return 1
        if isinstance(e, _user_errors()):
            print(f"{command}: error: {e}", file=sys.stderr)
            return 2
        if _out_of_memory(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"{command}: error: out of memory ({first[:200]}): the model, batch or evaluation does not fit; a "
                  f"smaller batch.micro_batch_size (accumulation keeps the global batch), "
                  f"model.activation_checkpointing, FSDP over more GPUs (torchrun) or a LoRA recipe need less",
                  file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
