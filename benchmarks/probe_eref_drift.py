"""How far the column e_refs of the weight-gradient operands move from one training step to the next.

    PYTHONPATH=src python benchmarks/probe_eref_drift.py [--recipe tiny-mxfp6] [--steps 300]
        [--set model.overrides={hidden_size: 384, num_heads: 6}] [--margins 0,1,2] [--json FILE]

The question it answers: could a one-pass packer encode the col orientation (Xᵀ and dYᵀ, the wgrad GEMM's
operands: one fold group per feature over all tokens) against the previous step's e_ref of that feature plus a
margin, instead of a first pass over the whole tensor? The row orientation's e_ref (per token) is new each step
and stays a reduction; a feature's largest block from one step to the next is what this measures.

It trains the recipe with the trainer (the MX reference path on a CPU, the CUDA kernels on a GPU) and, at every
training step, takes every `MXFP6Linear`'s input X and output gradient dY as 2-D [tokens, features]. For each
and for each margin m it counts, against the prediction P = (last step's e_ref of the feature) + m:

- columns to fix up: a live block whose elements, encoded as q·2^(e_block − P + s), would pass E4M3's 448 (or a
  feature without a previous e_ref); a fix-up re-encodes such a column against its own e_ref;
- blocks outside the window: live blocks with e_block − P below −window (for columns not fixed up), against
  those of the exact fold (e_block − e_ref < −window), which the packers count today.

Within the window a power-of-two change of a group's scale moves no value (docs/design.md, "The exact FP8
fold and its window"), so where no column needs a fix-up and no block leaves the window such an encoding
gives the fold's operands up to a power of two per column. Writes one JSON with provenance: per tensor kind and
margin the sums over linears and steps (all, and from --late-from on), and per step the sums over linears.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0


def column_blocks(t: torch.Tensor, fmt: str = "e2m3", hadamard: bool = True):
    """The col orientation of a 2-D [tokens, features] tensor as the packers quantize it (tokens padded with
    zeros to a multiple of 32, blocks of 32 tokens per feature): per block its exponent (int32 [C, blocks]),
    whether it is live (the fold's rule: a non-zero code, not NaN) and its largest |q| (the E2M3 value, fp32)."""
    from mxflux.mx.fold import _live_blocks
    from mxflux.mx.formats import code_table
    from mxflux.mx.operands import padded_rows
    from mxflux.mx.quantize import quantize

    vt = F.pad(t.float(), (0, 0, 0, padded_rows(t.shape[0]) - t.shape[0])).t().contiguous()
    mx = quantize(vt, fmt, axis=1, hadamard=hadamard)
    f = mx.format
    codes = mx.codes.reshape(vt.shape[0], -1, mx.block)
    e_block, live, _ = _live_blocks(codes, mx.scales.to(torch.int32), f)
    qmax = code_table(f, codes.device)[codes.long()].abs().amax(dim=-1)
    return e_block, live, qmax, f


def column_erefs(e_block: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Each column's e_ref (its largest live block exponent, as the fold finds it); -2^20 where it has no live
    block."""
    from mxflux.mx.fold import _group_maxima

    return _group_maxima(e_block, live, e_block.shape[-1])[..., 0]


def drift_counts(e_block, live, qmax, e_prev, margin: int, shift: int, window: int) -> dict:
    """Against the prediction P = e_prev + margin per column (e_prev -2^20: no previous e_ref): the columns a
    fix-up must re-encode and the live blocks outside the window, beside the exact fold's count."""
    from mxflux.mx.fold import _NO_BLOCK

    e_now = column_erefs(e_block, live)
    has_live = e_now > _NO_BLOCK
    known = e_prev > _NO_BLOCK
    pred = torch.where(known, e_prev + margin, e_now)
    d = e_block - pred.unsqueeze(-1)
    over = live & (qmax * torch.exp2((d + shift).clamp(max=40).float()) > E4M3_MAX)
    fixup = has_live & (over.any(dim=-1) | ~known)
    d_used = torch.where(fixup.unsqueeze(-1), e_block - e_now.unsqueeze(-1), d)
    return {
        "columns": int(has_live.sum()),
        "columns_to_fix_up": int(fixup.sum()),
        "columns_above_prediction": int((has_live & known & (e_now > pred)).sum()),
        "blocks": int(live.sum()),
        "blocks_outside_window_exact": int((live & (e_block - e_now.unsqueeze(-1) < -window)).sum()),
        "blocks_outside_window_predicted": int((live & (d_used < -window)).sum()),
    }


class Recorder:
    """Hooks on every MXFP6Linear: X at forward and dY at backward of training steps (not evaluation), each
    counted against the previous step's e_refs of the same linear and tensor."""

    def __init__(self, model: torch.nn.Module, margins: list[int], step=lambda: 0):
        from mxflux.nn.linear import MXFP6Linear

        self.margins, self.step = margins, step  # step(): the training step being run
        self.prev: dict[tuple[str, str], torch.Tensor] = {}
        # counts summed over the linears, by (step, tensor, margin)
        self.counts: dict[tuple[int, str, int], dict] = defaultdict(lambda: defaultdict(int))
        self.linears = [(name, m) for name, m in model.named_modules() if isinstance(m, MXFP6Linear)]
        for name, m in self.linears:
            m.register_forward_hook(self._forward_hook(name))

    def _forward_hook(self, name: str):
        def hook(module, args, out):
            if not (module.training and torch.is_grad_enabled()):
                return
            self._record(name, "X", args[0].detach().reshape(-1, args[0].shape[-1]))
            if out.requires_grad:
                out.register_hook(lambda g: self._record(name, "dY", g.detach().reshape(-1, g.shape[-1])))
        return hook

    def _record(self, name: str, kind: str, t: torch.Tensor) -> None:
        e_block, live, qmax, f = column_blocks(t)
        key = (name, kind)
        if key in self.prev and self.prev[key].shape[0] == e_block.shape[0]:
            for m in self.margins:
                c = drift_counts(e_block, live, qmax, self.prev[key], m, f.fold_shift, f.fold_window)
                for k, v in c.items():
                    self.counts[(self.step(), kind, m)][k] += v
        self.prev[key] = column_erefs(e_block, live)

    def per_step(self) -> list[dict]:
        return [{"step": step, "tensor": kind, "margin": m, **c} for (step, kind, m), c in sorted(self.counts.items())]

    def summary(self, from_step: int = 0) -> list[dict]:
        """Per tensor and margin, the counts summed over the linears and the steps >= from_step, with fractions."""
        totals: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(int))
        for (step, kind, m), c in self.counts.items():
            if step >= from_step:
                for k, v in c.items():
                    totals[(kind, m)][k] += v
        rows = []
        for (kind, m), c in sorted(totals.items()):
            rows.append({"tensor": kind, "margin": m, **c,
                         "fraction_of_columns_to_fix_up": c["columns_to_fix_up"] / max(c["columns"], 1),
                         "outside_window_exact_fraction": c["blocks_outside_window_exact"] / max(c["blocks"], 1),
                         "outside_window_predicted_fraction":
                             c["blocks_outside_window_predicted"] / max(c["blocks"], 1)})
        return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny-mxfp6")
    ap.add_argument("--steps", type=int, default=300, help="training steps (the first only sets the e_refs)")
    ap.add_argument("--margins", default="0,1,2", help="binades added to the previous step's e_ref")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    ap.add_argument("--late-from", type=int, default=200, help="the summary of steps from this one on, too")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        margins = [int(m) for m in args.margins.split(",")]
    except ValueError:
        print(f"--margins: expected comma-separated integers, got {args.margins!r}", file=sys.stderr)
        return 2

    import tempfile

    from mxflux.bench.provenance import provenance
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out_dir:
        # eager and uncaptured: the hooks are Python, which a compiled or replayed step would not run
        overrides = [f"train.out_dir={out_dir}", "train.checkpoint_every=null", "train.sample_prompts=[]",
                     f"train.eval_every_samples={10**12}", "model.compile=false", "train.cuda_graph=false", *args.set]
        cfg = load_recipe(args.recipe, overrides)
        trainer = Trainer(cfg, device=args.device)
        recorder = Recorder(trainer.model, margins, step=lambda: trainer.step)
        if not recorder.linears:
            print(f"{args.recipe}: no MXFP6Linear in the model (an MXFP6 recipe is needed)", file=sys.stderr)
            return 2
        trainer.fit(progress=False, max_steps=args.steps)

    rows, late = recorder.summary(), recorder.summary(args.late_from)
    for title, table in (("all steps", rows), (f"steps >= {args.late_from}", late)):
        print(title)
        for r in table:
            print(f"  {r['tensor']:3s} margin {r['margin']}: columns to fix up "
                  f"{r['fraction_of_columns_to_fix_up']:.4f} ({r['columns_to_fix_up']} of {r['columns']}); "
                  f"blocks outside the window "
                  f"{r['outside_window_predicted_fraction']:.2e} predicted, "
                  f"{r['outside_window_exact_fraction']:.2e} exact")
    if args.json:
        args.json.write_text(json.dumps({
            "provenance": provenance(), "date": datetime.date.today().isoformat(), "recipe": args.recipe,
            "overrides": args.set, "steps": args.steps, "linears": [n for n, _ in recorder.linears],
            "summary": rows, "late_from": args.late_from, "summary_late": late,
            "per_step": recorder.per_step()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
