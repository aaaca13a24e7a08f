"""`mxflux.kernels.weight_erefs`: when a weight's e_ref buffer counts as current (CPU; the kernels
that fill and read the buffers are tested in tests/gpu/test_weight_erefs.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from mxflux.kernels import weight_erefs


@pytest.fixture(autouse=True)
def _fresh_registry():
    weight_erefs.clear()
    yield
    weight_erefs.clear()


def _tracked(r=64, c=96, hadamard=True):
    p = torch.nn.Parameter(torch.randn(r, c))
    buf = torch.full((weight_erefs.buffer_words(r, c),), 7, dtype=torch.int32)
    weight_erefs.track(p, hadamard, buf)
    return p, buf


def test_buffer_layout_pads_the_rows_to_16_bytes():
    assert weight_erefs.buffer_words(3072, 9216) == 3072 + 9216
    assert weight_erefs.buffer_words(33, 64) == 36 + 64


def test_a_buffer_is_current_from_mark_until_torch_writes_the_weight():
    p, buf = _tracked()
    assert weight_erefs.current_erefs(p, True) is None  # registered, never computed
    weight_erefs.mark_current(p)
    assert weight_erefs.current_erefs(p, True) is buf and weight_erefs.is_current(p)
    assert weight_erefs.current_erefs(p.detach(), True) is buf  # an alias shares the version counter
    assert weight_erefs.current_erefs(p, False) is None  # computed for the rotated blocks only
    assert weight_erefs.current_erefs(p.detach().view(96, 64), True) is None  # another shape
    assert weight_erefs.current_erefs(p.detach()[1:], True) is None  # another address
    with torch.no_grad():
        p.add_(0.0)  # a write through torch, even one that changes no value
    assert weight_erefs.current_erefs(p, True) is None and not weight_erefs.is_current(p)
    weight_erefs.mark_current(p)
    assert weight_erefs.current_erefs(p, True) is buf
    p2 = p.detach()
    p2.copy_(torch.zeros_like(p2))  # through an alias: the same counter
    assert weight_erefs.current_erefs(p, True) is None


def test_a_weight_that_is_gone_is_never_matched():
    p, buf = _tracked()
    weight_erefs.mark_current(p)
    alias = p.detach()  # keeps the storage (address, shape, version) alive after the parameter
    assert weight_erefs.current_erefs(alias, True) is buf
    del p
    gc.collect()
    assert weight_erefs.current_erefs(alias, True) is None
    assert alias.data_ptr() not in weight_erefs._ENTRIES  # and the entry is dropped


def test_track_refuses_what_the_kernels_cannot_use():
    p = torch.nn.Parameter(torch.randn(64, 96))
    with pytest.raises(ValueError, match="erefs: expected int32 \\[160\\]"):
        weight_erefs.track(p, True, torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="param: expected a contiguous 2-D weight"):
        weight_erefs.track(torch.randn(96, 64).t(), True, torch.zeros(160, dtype=torch.int32))


def test_an_inference_tensor_is_never_matched():
    p, buf = _tracked()
    weight_erefs.mark_current(p)
    with torch.inference_mode():
        t = torch.empty(3)
    assert weight_erefs.current_erefs(t, True) is None
