"""The first 20 training losses of the CPU recipes, pinned bit for bit.

The values in `data/first20_losses.json` (float.hex) were recorded from the code before the
layering/precision/trainer redesign, and re-recorded on 2026-12-02 when the CPU path changed its
summation orders (MKL's bf16 GEMM for the MX products, the eager CPU attention, the fused AdamW);
any refactor that claims "behaviour unchanged" must keep them. A change that is meant to alter numerics must re-record them and say why in its commit:
`PYTHONPATH=src python tests/test_regression_losses.py --record` runs `first_20_losses` (the
function the test runs) for every recipe in the file and rewrites it.
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest

from mxflux.train.config import load_recipe
from mxflux.train.trainer import Trainer

PINNED_FILE = Path(__file__).parent / "data" / "first20_losses.json"
PINNED = json.loads(PINNED_FILE.read_text())


def first_20_losses(recipe: str, out_dir, overrides=(), steps: int = 20) -> list[float]:
    cfg = load_recipe(recipe, [f"train.out_dir={out_dir}", *overrides])
    tr = Trainer(cfg, device="cpu")
    batches = tr.batches()
    return [tr.train_step([next(batches) for _ in range(tr.accum)]).read()["loss"] for _ in range(steps)]


@pytest.mark.parametrize("recipe", sorted(PINNED))
def test_first_20_losses_bit_exact(recipe, tmp_path):
    got = first_20_losses(recipe, tmp_path)
    want = [float.fromhex(h) for h in PINNED[recipe]]
    assert got == want, f"{recipe}: first differing step {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


@pytest.mark.parametrize("option", ["precision.saved_operands=e2m3", "precision.repack_weights=true"])
def test_how_operands_wait_for_backward_leaves_the_pinned_mxfp6_losses(option, tmp_path):
    """Keeping the col operands as 6-bit codes (expanded back to the same FP8 bytes in backward;
    docs/design.md, "Saved operands in six bits") or keeping no Wᵀ (packed again from the
    parameter in backward) changes only what waits for backward: the losses are the pinned ones
    bit for bit."""
    got = first_20_losses("tiny-mxfp6", tmp_path, [option], steps=4)
    assert got == [float.fromhex(h) for h in PINNED["tiny-mxfp6"][:4]]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    recorded = {}
    for name in PINNED:
        with tempfile.TemporaryDirectory() as tmp:
            recorded[name] = [v.hex() for v in first_20_losses(name, tmp)]
    PINNED_FILE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"recorded {PINNED_FILE}: {sorted(recorded)}")
