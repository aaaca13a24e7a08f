"""The first 20 training losses of the CPU recipes, pinned bit for bit.

The values in `data/first20_losses.json` were recorded (float.hex) from the code before the
layering/precision/trainer redesign; any refactor that claims "behaviour unchanged" must keep
them. A change that is meant to alter numerics must re-record them and say why in its commit.
"""

import json
from pathlib import Path

import pytest

from mxflux.train.config import load_recipe
from mxflux.train.trainer import Trainer

PINNED = json.loads((Path(__file__).parent / "data" / "first20_losses.json").read_text())


@pytest.mark.parametrize("recipe", sorted(PINNED))
def test_first_20_losses_bit_exact(recipe, tmp_path):
    cfg = load_recipe(recipe, [f"train.out_dir={tmp_path}"])
    tr = Trainer(cfg, device="cpu")
    batches = tr.batches()
    got = [tr.train_step([next(batches) for _ in range(tr.accum)]).read()["loss"] for _ in range(20)]
    want = [float.fromhex(h) for h in PINNED[recipe]]
    assert got == want, f"{recipe}: first differing step {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
