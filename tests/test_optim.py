"""`mxflux.optim.AdamW` where the Triton step does not run (this CPU): torch's fused AdamW, the
clipping by its grad_scale, refusals in one line. Its Triton step: tests/gpu/test_user_adamw.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mxflux.nn import MXFP6Linear
from mxflux.optim import AdamW

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(MXFP6Linear(64, 96), torch.nn.GELU(approximate="tanh"), MXFP6Linear(96, 64))


def _step(model, opt, x, clip=None):
    model(x).float().square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def test_on_the_cpu_it_is_torchs_fused_adamw(gen):
    seed = int(torch.randint(2**31, (1,), generator=gen))
    x = torch.randn(40, 64, generator=gen).bfloat16()
    ours, theirs = _model(seed), _model(seed)
    opt = AdamW(ours, **HP)
    assert opt.weight_state is None  # no kernel here: the layers pack their weights themselves
    ref = torch.optim.AdamW(theirs.parameters(), fused=True, **HP)
    for _ in range(3):
        _step(ours, opt, x)
        _step(theirs, ref, x)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    # an LR schedule drives it as any torch optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert opt.param_groups[0]["lr"] == HP["lr"] * 0.5 and sched.get_last_lr() == [HP["lr"] * 0.5]


def test_it_clips_to_max_grad_norm_and_reports_the_norm(gen):
    seed = int(torch.randint(2**31, (1,), generator=gen))
    x = torch.randn(40, 64, generator=gen).bfloat16() * 8
    ours, theirs = _model(seed), _model(seed)
    opt = AdamW(ours, max_grad_norm=0.01, **HP)
    ref = torch.optim.AdamW(theirs.parameters(), fused=True, **HP)
    _step(ours, opt, x)
    norm = _step(theirs, ref, x, clip=0.01)
    assert float(norm) > 0.01  # it clipped
    torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-6, atol=0)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the factor applied by another kernel


def test_refusals_name_the_argument():
    model = _model(0)
    with pytest.raises(ValueError, match="max_grad_norm: expected a positive number or None, got 0"):
        AdamW(model, max_grad_norm=0)
    frozen = _model(0).requires_grad_(False)
    with pytest.raises(ValueError, match="model: no parameter requires a gradient"):
        AdamW(frozen)
    with pytest.raises(ValueError, match="step: no closure"):
        AdamW(model).step(lambda: 0.0)
    with pytest.raises(ValueError, match="keep_cols: expected True or False, got 'no'"):
        AdamW(model, keep_cols="no")
    with pytest.raises(ValueError, match="keep_operands: expected True or False, got 1"):
        AdamW(model, keep_operands=1)


def test_the_readme_loop_runs_and_learns():
    """README's "MXFP6 in your own code": its Python, as written, trains (the loss falls over its steps)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## MXFP6 in your own code"):]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S)[:2])
    assert "mxflux.optim import AdamW" in code
    torch.manual_seed(0)
    losses = []
    scope = {"print": lambda *a: None}
    exec(code.replace("    optimizer.step()", "    losses.append(float(loss)); optimizer.step()"),
         {**scope, "losses": losses})
    assert len(losses) == 3 and losses[-1] < losses[0], losses
