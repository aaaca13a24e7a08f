"""Every layer a recipe chooses for MXFP6 really computes in MXFP6, checked through the numbers it
produces, independently of the machine's summation orders.

The pinned-loss test (test_regression_losses.py) is bit for bit only on the machine that recorded
its pins; elsewhere it holds the first losses within 1e-4, where tiny-mxfp6 and tiny-bf16 differ by
less than 2e-5, so there it cannot tell the precisions apart. This census can: it trains a few steps
of a recipe, and for every linear the recipe's `precision.include` / `exclude` patterns choose (found
from a freshly built bf16 model, not from what the converter reports), it measures the layer's
output against the same layer in fp64 on the same input. An MXFP6 linear (E2M3 elements under
E8M0 scales, both operands quantized) lands at 24-29 dB, one that silently runs bf16 at 52-53 dB
(tiny-mxfp6 on the CPU, 2026-12-06); one that runs FP8 instead is not an MXFP6 module. A test switches MXFP6 off and expects the
census to fail, naming the layers.
"""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F

from mxflux.mx import snr_db
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear
from mxflux.nn.linear import mx_ineligibility
from mxflux.train.build import build_model
from mxflux.train.config import load_recipe
from mxflux.train.trainer import Trainer

MXFP6_SNR_DB = (20.0, 40.0)  # tiny-mxfp6 after 3 steps: 24.4-28.7 dB; the same layers in bf16: 51.8-53.2


def chosen_linears(cfg) -> list[str]:
    """The linears `cfg.precision` names for MX: include matched, exclude not, MX-eligible shape;
    from a plain bf16 build of the model (what the recipe asks for, not what the converter did)."""
    plain = load_recipe(cfg.name, ["precision={}", f"model.name={cfg.model.name}"])
    model, _ = build_model(plain, "cpu")
    p = cfg.precision
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name
            and any(fnmatch.fnmatchcase(name, pat) for pat in p.include)
            and not any(fnmatch.fnmatchcase(name, pat) for pat in p.exclude)
            and mx_ineligibility(m.in_features, m.out_features, p.mx_gemm) is None]


def _fp64_output(module, x) -> torch.Tensor:
    x = x.double()
    if isinstance(module, FusedMXFP6MLP):
        h = F.linear(x, module.fc1.weight.double(), module.fc1.bias.double())
        return F.linear(F.gelu(h, approximate="tanh"), module.fc2.weight.double(), module.fc2.bias.double())
    return F.linear(x, module.weight.double(), None if module.bias is None else module.bias.double())


def precision_census(recipe: str, out_dir, overrides=(), steps: int = 3) -> list[str]:
    """What is wrong with the recipe's MXFP6 layers after `steps` training steps ([] when every chosen
    linear ran in MXFP6): each line names the layer and what it saw."""
    cfg = load_recipe(recipe, [f"train.out_dir={out_dir}", *overrides])
    expected = chosen_linears(load_recipe(recipe))
    trainer = Trainer(cfg, device="cpu")
    batches = trainer.batches()
    for _ in range(steps):
        trainer.train_step([next(batches) for _ in range(trainer.accum)])
    modules = dict(trainer.model.named_modules())
    snr: dict[str, float] = {}

    def hook(name):
        def record(module, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            snr[name] = snr_db(_fp64_output(module, x), out.detach().reshape(x.shape[0], -1).double())
        return record

    handles = []
    for name, m in modules.items():
        if isinstance(m, FusedMXFP6MLP) and m.fused:
            handles.append(m.register_forward_hook(hook(name)))
        elif isinstance(m, torch.nn.Linear) and name in expected:
            handles.append(m.register_forward_hook(hook(name)))
    with torch.no_grad():  # one more forward, as training runs it, with the hooks measuring each layer
        trainer.training_loss(next(batches))
    for h in handles:
        h.remove()
    problems = []
    for name in expected:
        parent = name.rsplit(".", 1)[0]
        module = modules.get(name)
        fused = isinstance(modules.get(parent), FusedMXFP6MLP) and modules[parent].fused
        seen = snr.get(parent if fused else name)
        if not isinstance(module, MXFP6Linear):
            problems.append(f"{name}: a {type(module).__name__}, not an MXFP6Linear")
        elif seen is None:
            problems.append(f"{name}: never ran")
        elif not (MXFP6_SNR_DB[0] <= seen <= MXFP6_SNR_DB[1]) or math.isnan(seen):
            problems.append(f"{name}: output {seen:.1f} dB from fp64, outside MXFP6's {MXFP6_SNR_DB} dB")
    if not expected:
        problems.append(f"{recipe}: its precision chooses no linear")
    return problems



def test_every_chosen_layer_of_tiny_mxfp6_computes_in_mxfp6(tmp_path):
    assert precision_census("tiny-mxfp6", tmp_path) == []


@pytest.mark.parametrize("off", [["precision.fp6=null"], ["precision={}"], ["precision={fp6: e2m3}", "precision.exclude=[\"double_blocks.*.img_attn.qkv\"]"]],
                         ids=["fp6-null", "bf16", "one-layer-excluded"])
def test_the_census_fails_when_mxfp6_is_off(tmp_path, off):
    """The check above fails when MXFP6 is switched off, whole or for one layer the recipe names."""
    problems = precision_census("tiny-mxfp6", tmp_path, off, steps=1)
    assert problems, off
    assert any("img_attn.qkv" in p for p in problems)


def test_the_census_fails_when_a_layer_silently_computes_in_bf16(tmp_path, monkeypatch):
    """An MXFP6Linear whose GEMM silently took the bf16 path (its type unchanged) is caught by its numbers."""
    monkeypatch.setattr(MXFP6Linear, "forward", lambda self, x: F.linear(x, self.weight.to(x.dtype),
                                                                           self.bias.to(x.dtype)))
    problems = precision_census("tiny-mxfp6", tmp_path, ["precision.fused_mlp=\"off\""], steps=1)
    assert problems and all("outside MXFP6" in p for p in problems), problems
