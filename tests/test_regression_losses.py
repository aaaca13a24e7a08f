"""The first 20 training losses of the CPU recipes, pinned bit for bit per machine.

The values in `data/first20_losses.json` (float.hex) were recorded from the code before the
layering/precision/trainer redesign, and re-recorded on 2026-12-02 when the CPU path changed its
summation orders (MKL's bf16 GEMM for the MX products, the eager CPU attention, the fused AdamW);
any refactor that claims "behaviour unchanged" must keep them. A change that is meant to alter
numerics must re-record them and say why in its commit:
`PYTHONPATH=src python tests/test_regression_losses.py --record` runs `first_20_losses` (the
function the test runs) for every recipe and writes this machine's entry; `make test` runs each
worker on one thread (tests/conftest.py), so record with OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
NUMBA_NUM_THREADS=1 too (numba's OpenMP layer otherwise sets torch's thread count back to the cores'
count during the MX steps), and without them for a serial run. Thread counts can change the bits: on
the AVX2 EPYC of 2026-12-05 both gave the same, on the AMX Xeon of that day bf16's differ.

The bits depend on the machine as well as on the code: MKL and oneDNN pick their GEMM kernels,
and with them the order of the sums, by CPU vendor, instruction set and thread count (the same
code and torch gave losses 1e-7 apart at step 4 on an AMD EPYC with AVX-512 BF16 and on the VM
the previous pins came from, growing to 1e-2 by step 20 as training amplifies them). So each set of pins
carries the fingerprint of the machine that recorded it (`machine_fingerprint`): on that kind of
machine the test is bit for bit; on another one the first 10 losses must agree with every
recorded set within 1e-4 (1e-7-5e-6 measured between the two machines above; a change of
numerics moves them by far more). That tolerance cannot tell the precisions apart (tiny-mxfp6's and
tiny-bf16's first 10 losses differ by at most 1.9e-5): whether MXFP6 really runs is checked, on any
machine, by tests/test_precision_census.py, which fails with MXFP6 switched off.
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mxflux.train.config import load_recipe
from mxflux.train.trainer import Trainer

PINNED_FILE = Path(__file__).parent / "data" / "first20_losses.json"
MACHINES = json.loads(PINNED_FILE.read_text())["machines"]
RECIPES = sorted({name for m in MACHINES for name in m["losses"]})
OTHER_MACHINE_STEPS, OTHER_MACHINE_RTOL = 10, 1e-4


def machine_fingerprint() -> dict:
    """What decides the CPU path's summation orders: the CPU (vendor, family, model, the
    instruction sets MKL and oneDNN choose kernels by), torch, its dispatch level and threads."""
    fields, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in fields:
                fields[key] = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the platform's own description
        import platform

        fields["model name"] = platform.processor()
    return {"cpu": " / ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "model name")),
            "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}),
            "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def _this_machines_pins() -> dict | None:
    here = machine_fingerprint()
    return next((m["losses"] for m in MACHINES if m["fingerprint"] == here), None)


def first_20_losses(recipe: str, out_dir, overrides=(), steps: int = 20) -> list[float]:
    cfg = load_recipe(recipe, [f"train.out_dir={out_dir}", *overrides])
    tr = Trainer(cfg, device="cpu")
    batches = tr.batches()
    return [tr.train_step([next(batches) for _ in range(tr.accum)]).read()["loss"] for _ in range(steps)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_first_20_losses_bit_exact(recipe, tmp_path):
    got = first_20_losses(recipe, tmp_path)
    pins = _this_machines_pins()
    if pins is not None:
        want = [float.fromhex(h) for h in pins[recipe]]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"{recipe}: first differing step {first}"
        return
    for m in MACHINES:  # another kind of machine: its GEMMs sum in other orders
        want = [float.fromhex(h) for h in m["losses"][recipe]][:OTHER_MACHINE_STEPS]
        assert got[:OTHER_MACHINE_STEPS] == pytest.approx(want, rel=OTHER_MACHINE_RTOL), (
            f"{recipe}: not within {OTHER_MACHINE_RTOL} of the pins recorded on {m['recorded']}; this machine: "
            f"{machine_fingerprint()}")


def test_another_machine_is_held_to_every_recorded_machine_within_the_tolerance(tmp_path, monkeypatch):
    """The branch a machine without pins takes (here: this one under another fingerprint): its
    first 10 losses against each recorded set, which this machine's run meets."""
    monkeypatch.setattr(sys.modules[__name__], "machine_fingerprint", lambda: {"cpu": "a machine with no pins"})
    assert _this_machines_pins() is None and len(MACHINES) >= 2
    test_first_20_losses_bit_exact("tiny-mxfp6", tmp_path)


@pytest.mark.parametrize("option", ["precision.saved_operands=e2m3", "precision.repack_weights=true"])
def test_how_operands_wait_for_backward_leaves_the_pinned_mxfp6_losses(option, tmp_path):
    """Keeping the col operands as 6-bit codes (expanded back to the same FP8 bytes in backward;
    docs/design.md, "Saved operands in six bits") or keeping no Wᵀ (packed again from the
    parameter in backward) changes only what waits for backward: the losses are those of the
    default, bit for bit, on this machine."""
    got = first_20_losses("tiny-mxfp6", tmp_path / "option", [option], steps=6)
    pins = _this_machines_pins()
    want = ([float.fromhex(h) for h in pins["tiny-mxfp6"][:6]] if pins is not None
            else first_20_losses("tiny-mxfp6", tmp_path / "default", steps=6))
    assert got == want


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import datetime

    recorded = {}
    for name in RECIPES:
        with tempfile.TemporaryDirectory() as tmp:
            recorded[name] = [v.hex() for v in first_20_losses(name, tmp)]
    here = machine_fingerprint()
    entry = {"fingerprint": here, "recorded": f"{datetime.date.today()}, {here['cpu']}", "losses": recorded}
    machines = [m for m in MACHINES if m["fingerprint"] != here] + [entry]
    PINNED_FILE.write_text(json.dumps({"machines": machines}, indent=1) + "\n")
    print(f"recorded {PINNED_FILE} for {here}: {sorted(recorded)}")
