"""What holds memory during one training step: `mxflux bench step --memory PATH`.

Two views of one step, both in the JSON and a printed table:

- the CUDA caching allocator's trace (`torch.cuda.memory._record_memory_history` around the
  step, then `_snapshot()`): replaying its alloc / free events gives the bytes alive at the
  step's peak, grouped by the Python frame that allocated them (the innermost frame outside torch,
  e.g. a line of inductor's generated code or of mxflux, with the nearest mxflux frame next to
  it). Blocks alive before the step have no allocation frames; they are named by matching their
  address to the parameters, gradients and optimizer state. Allocations made by the autograd
  engine's own thread (eager backward) have no Python frame and form one group.
- what autograd saved for backward (`torch.autograd.graph.saved_tensors_hooks` around the
  forward passes): bytes per dtype and per module, each storage once, the parameters (saved by
  reference, costing nothing extra) apart. The module is the innermost `nn.Module` whose
  `forward` is on the Python stack when the tensor is saved; inside a compiled block that is the
  block, since its submodules no longer run as Python.

The memory numbers next to it in every result (`bench.step`): `max_memory_allocated` (what
tensors held), `max_memory_reserved` (what the caching allocator held: also fragmentation and
CUDA-graph pools) and the device's used memory from `torch.cuda.mem_get_info` (everything on the
device, this process's CUDA context and other processes included).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["SavedTensors", "record_saved_tensors", "alive_at_peak", "group_blocks", "memory_breakdown",
           "print_memory_report", "NO_FRAME"]

NO_FRAME = "<no Python frame: autograd engine thread or C++>"


class SavedTensors:
    """Bytes autograd saved for backward, per dtype and per module (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self._names = {id(m): (name or "<root>", type(m).__name__) for name, m in model.named_modules()}
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}
        self._seen: set[int] = set()
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.by_module: dict[str, int] = defaultdict(int)
        self.by_module_type: dict[str, int] = defaultdict(int)
        self.parameter_bytes = 0
        self.tensors = 0

    def _module_on_stack(self) -> tuple[str, str]:
        f = sys._getframe(2)
        while f is not None:
            owner = f.f_locals.get("self")
            if owner is not None and id(owner) in self._names and isinstance(owner, nn.Module):
                return self._names[id(owner)]
            f = f.f_back
        return "<outside the model>", "-"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add(ptr)
        if ptr in self._params:
            self.parameter_bytes += storage.nbytes()
            return t
        name, kind = self._module_on_stack()
        self.by_dtype[str(t.dtype).removeprefix("torch.")] += storage.nbytes()
        self.by_module[name] += storage.nbytes()
        self.by_module_type[kind] += storage.nbytes()
        return t

    def report(self, top: int = 20) -> dict:
        def ranked(d):
            return [{"name": k, "bytes": v} for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

        return {"bytes": sum(self.by_dtype.values()), "tensors_saved": self.tensors,
                "parameter_bytes_saved_by_reference": self.parameter_bytes,
                "by_dtype": dict(sorted(self.by_dtype.items(), key=lambda kv: -kv[1])),
                "by_module": ranked(self.by_module), "by_module_type": ranked(self.by_module_type)}


@contextmanager
def record_saved_tensors(model: nn.Module):
    """Yields a `SavedTensors` that counts what autograd saves inside the block."""
    saved = SavedTensors(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        yield saved


# --- the allocator trace --------------------------------------------------------------------------

def _blocks(snapshot: dict, device: int) -> dict[int, int]:
    """{address: size} of the allocated blocks of a `_snapshot()` on `device`."""
    out = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[addr] = b["size"]
            addr += b["size"]
    return out


def alive_at_peak(before: dict, after: dict, device: int = 0) -> dict:
    """Replay the allocator trace of `after` (a `_snapshot()` taken with history recorded since
    just before `before` was taken) from the blocks allocated in `before`.

    Returns {"peak_bytes", "start_bytes", "end_bytes", "blocks": [{addr, size, frames,
    alive_at_end, preexisting}]} for the blocks alive at the first moment of the peak. A block
    is freed at `free_completed` (its memory reusable), or at `free_requested` when the trace has
    no completions.
    """
    def trace_of(snap):
        traces = snap.get("device_traces", [])
        return traces[device] if device < len(traces) else []

    trace = trace_of(after)[len(trace_of(before)):]  # the entries recorded after `before`
    free_action = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    # address -> (size, frames, key): key -1 for blocks alive before, else the alloc's trace index
    start = {a: (s, [], -1) for a, s in _blocks(before, device).items()}

    def replay(stop: int | None):
        alive = dict(start)
        total = sum(s for s, _, _ in alive.values())
        peak, peak_at = total, -1
        for i, e in enumerate(trace):
            if stop is not None and i > stop:
                break
            if e["action"] == "alloc":
                alive[e["addr"]] = (e["size"], e.get("frames", []), i)
                total += e["size"]
            elif e["action"] == free_action and e["addr"] in alive:
                total -= alive.pop(e["addr"])[0]
            if total > peak:
                peak, peak_at = total, i
        return alive, total, peak, peak_at

    end_alive, end_total, peak, peak_at = replay(None)
    at_peak = replay(peak_at)[0] if peak_at >= 0 else dict(start)
    end_keys = {(a, k) for a, (_, _, k) in end_alive.items()}
    blocks = [{"addr": a, "size": s, "frames": fr, "preexisting": k < 0, "alive_at_end": (a, k) in end_keys}
              for a, (s, fr, k) in at_peak.items()]
    return {"peak_bytes": peak, "start_bytes": sum(s for s, _, _ in start.values()), "end_bytes": end_total,
            "blocks": blocks}


def _is_torch_internal(filename: str) -> bool:
    return ("/torch/" in filename or "/site-packages/" in filename or filename.startswith("<")) \
        and "torchinductor" not in filename


def _frame_label(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (generated inductor code counts as outside),
    with the nearest mxflux frame when that is a different one."""
    if not frames:
        return NO_FRAME
    own = next((f for f in frames if not _is_torch_internal(f["filename"])), frames[0])
    label = f"{own['name']} ({_short(own['filename'])}:{own['line']})"
    if own.get("fx_node_name"):  # inductor code: the FX node it computes (snapshot augmented with FX traces)
        label += f" [{own['fx_node_name']}]"
    ours = next((f for f in frames if "mxflux" in f["filename"]), None)
    if ours is not None and ours is not own:
        label += f" <- {ours['name']} ({_short(ours['filename'])}:{ours['line']})"
    return label


def _short(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    if "mxflux" in parts:
        return "/".join(parts[parts.index("mxflux"):])
    return "/".join(parts[-2:])


def group_blocks(blocks: list[dict], known: dict[int, str], top: int = 20) -> list[dict]:
    """Blocks alive at the peak grouped by what holds them: a known tensor kind (by address, for
    blocks alive before the step or still alive at its end), else the allocating frame."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for b in blocks:
        if b["addr"] in known and (b["preexisting"] or b["alive_at_end"]):
            label = known[b["addr"]]
        elif b["preexisting"]:
            label = "alive before the step (not a parameter, gradient or optimizer state)"
        else:
            label = _frame_label(b["frames"])
        groups[label][0] += b["size"]
        groups[label][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"holder": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]]


def _known_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    known: dict[int, str] = {}
    for p in model.parameters():
        known[local(p).untyped_storage().data_ptr()] = "parameters"
        if p.grad is not None:
            known[local(p.grad).untyped_storage().data_ptr()] = "gradients"
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    known[local(v).untyped_storage().data_ptr()] = "optimizer state"
        weight_state = getattr(optimizer, "weight_state", None)
        for kept in getattr(weight_state, "kept", {}).values():  # alive before the step unless released then
            rows, _, cols, _ = kept.operands
            for t, half in ((rows, "row"), (cols, "col")):
                if t is not None and t.untyped_storage().nbytes():
                    known[t.untyped_storage().data_ptr()] = f"weights' {half} operands (kept by the optimizer step)"
    return known


def _snapshot(device) -> dict:
    try:  # FX node names on the frames of inductor's code, where this torch can add them
        return torch.cuda.memory._snapshot(device, augment_with_fx_traces=True)
    except TypeError:
        return torch.cuda.memory._snapshot(device)


def memory_breakdown(step, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     device: torch.device, top: int = 20) -> dict:
    """Run `step()` (one training step, already warmed up) once, recording what autograd saves and,
    on CUDA, the allocator's trace; the breakdown described in the module docstring."""
    cuda = device.type == "cuda"
    out: dict = {"device": str(device)}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python",
                                                 device=device)
        before = _snapshot(device)
    try:
        with record_saved_tensors(model) as saved:
            step()
        if cuda:
            torch.cuda.synchronize(device)
            after = _snapshot(device)
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)
    out["saved_for_backward"] = saved.report(top)
    if not cuda:
        out["allocator"] = None
        out["allocator_note"] = "the allocator trace needs CUDA"
        return out
    idx = device.index if device.index is not None else torch.cuda.current_device()
    replay = alive_at_peak(before, after, idx)
    known = _known_tensors(model, optimizer)
    out["allocator"] = {
        "peak_bytes_replayed": replay["peak_bytes"],
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "device_used_bytes": (lambda free_total: free_total[1] - free_total[0])(torch.cuda.mem_get_info(device)),
        "start_bytes": replay["start_bytes"],
        "end_bytes": replay["end_bytes"],
        "alive_at_peak": group_blocks(replay["blocks"], known, top),
    }
    return out


def print_memory_report(report: dict, *, title: str = "", console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    gib = 2.0**30
    a = report.get("allocator")
    if a:
        console.print(f"{title}peak {a['peak_bytes_replayed'] / gib:.2f} GiB replayed from the allocator trace "
                      f"(max allocated {a['max_memory_allocated'] / gib:.2f}, reserved "
                      f"{a['max_memory_reserved'] / gib:.2f}, device used {a['device_used_bytes'] / gib:.2f}; "
                      f"{a['start_bytes'] / gib:.2f} alive before the step)", style="bold")
        t = Table("GiB at peak", "blocks", "held by")
        for g in a["alive_at_peak"]:
            t.add_row(f"{g['bytes'] / gib:.3f}", str(g["blocks"]), g["holder"][:140])
        console.print(t)
    s = report["saved_for_backward"]
    console.print(f"{title}saved for backward: {s['bytes'] / gib:.3f} GiB in {s['tensors_saved']} saved tensors "
                  f"(+ {s['parameter_bytes_saved_by_reference'] / gib:.3f} GiB of parameters, by reference)",
                  style="bold")
    t = Table("GiB", "dtype / module")
    for dtype, b in s["by_dtype"].items():
        t.add_row(f"{b / gib:.3f}", dtype)
    t.add_section()
    for m in s["by_module_type"]:
        t.add_row(f"{m['bytes'] / gib:.3f}", m["name"])
    t.add_section()
    for m in s["by_module"][:10]:
        t.add_row(f"{m['bytes'] / gib:.3f}", m["name"])
    console.print(t)
