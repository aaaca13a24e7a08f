"""The run's report of how its step runs: each fast part that is off names the field or fact that
turns it off (the 2-rank FSDP2 case runs in test_train_distributed)."""

from __future__ import annotations

import pytest

from mxflux.train import load_recipe
from mxflux.train.build import build_model, rows_release_off, weight_state_off
from mxflux.train.step_path import step_path_line


@pytest.mark.parametrize("recipe, overrides, reason", [
    ("tiny-bf16", [], "precision bf16: nothing kept between optimizer steps"),
    ("tiny-mxfp6", ["precision.weight_exponents_in_optimizer=false"], "precision.weight_exponents_in_optimizer: false"),
    ("tiny-mxfp6", ["optim.implementation=fused"], "optim.implementation: fused"),
    ("tiny-mxfp6", ["optim.clip_in_optimizer=false"], "optim.clip_in_optimizer: false"),
    ("tiny-mxfp6", ["precision.mx_gemm=blockwise"], "no MXFP6 layer with the row granularity"),
    ("tiny-mxfp6", [], "the Triton step runs on CUDA only"),
])
def test_the_weight_state_says_what_turns_it_off(recipe, overrides, reason):
    cfg = load_recipe(recipe, overrides)
    model, _ = build_model(cfg, "cpu")
    assert weight_state_off(cfg, model).startswith(reason)


@pytest.mark.parametrize("overrides, reason", [
    ([], None),
    (["model.compile=true", "model.activation_checkpointing=mx_inputs"], None),
    (["model.compile=true", "model.activation_checkpointing=mx_packers"], None),
    (["precision.release_weight_rows=false"], "precision.release_weight_rows: false"),
    (["train.cuda_graph=true"], "train.cuda_graph: true"),
    (["model.compile=true", "model.compile_mode=reduce-overhead"], "model.compile_mode: reduce-overhead"),
    (["model.activation_checkpointing=full"], "model.activation_checkpointing: full (backward runs the GEMMs'"),
    (["model.activation_checkpointing=attention"], "model.activation_checkpointing: attention"),
])
def test_the_row_operands_are_freed_only_where_nothing_reads_them_before_the_step(overrides, reason):
    """By default (`precision.release_weight_rows`) the weights' row operands are freed between forward
    and the step except where something reads them again: a captured step or per-block CUDA graphs (at
    their old addresses) and checkpointing that runs the GEMMs' forward again; the reason names the
    field. Turned off, the reason is the field itself."""
    got = rows_release_off(load_recipe("tiny-mxfp6", overrides))
    assert got == reason if reason is None else got.startswith(reason), got


def test_the_console_line_counts_graph_breaks_only_where_compiled():
    path = {"compiled": "per block, mode default", "graph_breaks": [0, 2], "mx_gemm": "opaque op (cpu kernels)",
            "mx_packers": "opaque op (cpu kernels)",
            "mx_weights": "packed each forward: x", "cuda_graphs": "none"}
    assert "2 graph break(s) on some rank" in step_path_line(path)
    assert "0 graph breaks" in step_path_line({**path, "graph_breaks": [0, 0]})
    assert "graph break" not in step_path_line({**path, "compiled": "no (model.compile: false)"})


@pytest.mark.parametrize("overrides, inline_pack, static, want", [
    ([], True, True, "inline: the packer kernel launched from inductor's code"),
    (["model.activation_checkpointing=full"], True, True,
     "opaque op (model.activation_checkpointing: full; packer calls stay"),
    ([], False, True, "opaque op (the default; MXFLUX_INLINE_PACK=1"),
    ([], True, False, "opaque op (inductor's static launch of user kernels is off"),
    (["model.compile=false"], True, True, "opaque op (model.compile: false)"),
    (["precision.held_col_erefs=true"], False, True, "opaque op (the default; MXFLUX_INLINE_PACK=1"),
])
def test_the_packers_path_names_what_keeps_them_off_inductors_code(overrides, inline_pack, static, want,
                                                                   monkeypatch):
    """`step_path`'s `mx_packers` for a CUDA run (no CUDA is touched: the report reads settings only)."""
    from types import SimpleNamespace

    import torch

    from mxflux.train import step_path as sp

    monkeypatch.setattr(sp, "INLINE_PACK", inline_pack)
    monkeypatch.setattr(sp, "static_launch_on", lambda: static)
    monkeypatch.setattr(sp, "FORCE_REFERENCE", False)
    cfg = load_recipe("tiny-mxfp6", ["model.compile=true", 'precision.fused_mlp="off"', *overrides])
    model, _ = build_model(cfg, "cpu")
    trainer = SimpleNamespace(cfg=cfg, device=torch.device("cuda"), model=model, optimizer=None,
                              block_graphs=SimpleNamespace(on=False), accum=1, world=1)
    path = sp.step_path(trainer)
    assert path["mx_packers"].startswith(want)
    assert f"MX packers {path['mx_packers']};" in step_path_line(path)
    held = "X and dY in one read each, their columns against the last step's e_ref" in path["mx_packers"]
    assert held == ("precision.held_col_erefs=true" in overrides)


@pytest.mark.parametrize("overrides, clip, want", [
    ([], True, "torch's fused AdamW, the clipping factor as its grad_scale"),
    (["optim.clip_in_optimizer=false"], False, "torch's AdamW (the gradients clipped before it"),
    (["optim.implementation=foreach"], True, "torch's AdamW after a multiply of every gradient"),
])
def test_the_optimizer_path_says_which_kernel_took_the_step_and_what_keeps_ours_off(overrides, clip, want):
    """`step_path`'s `optimizer`: the kernel that took the last step, read from the optimizer itself
    (a real step on the CPU), with the field or fact that keeps our Triton kernel off; before any step,
    that none was taken."""
    from types import SimpleNamespace

    import torch

    from mxflux.train import step_path as sp
    from mxflux.train.build import build_optimizer
    from mxflux.train.clipping import clip_and_step

    cfg = load_recipe("tiny-bf16", overrides)
    model, _ = build_model(cfg, "cpu")
    optimizer = build_optimizer(cfg, model)
    trainer = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), model=model, optimizer=optimizer,
                              block_graphs=SimpleNamespace(on=False), accum=1, world=1)
    assert sp.step_path(trainer)["optimizer"] == "not stepped yet"
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    clip_and_step(optimizer, model.parameters(), 0.1, in_optimizer=clip)
    path = sp.step_path(trainer)
    assert path["optimizer"].startswith(want)
    reason = {"optim.clip_in_optimizer=false": "(optim.clip_in_optimizer: false)",
              "optim.implementation=foreach": "(optim.implementation: foreach;"}
    assert reason.get(overrides[0] if overrides else "", "needs fp32 parameters on one CUDA device") in path["optimizer"]
    assert f"optimizer {path['optimizer']};" in step_path_line(path)


@pytest.mark.parametrize("kinds, accumulation, kernel, available, tvm_ffi, want", [
    ("off", "fp32", "rowwise", True, True, None),
    ("auto", "fp32", "rowwise", True, True,
     "; those of >= 2048 tokens with M and N in whole tile clusters, before either, on the CuTe-DSL row-scaled GEMM, "
     "each k-tile's sums added in fp32, called through TVM-FFI (MXFLUX_CUTE_GEMM=auto)"),
    ("auto", "fp32", "rowwise", True, False,
     "; those of >= 8192 tokens with M and N in whole tile clusters, before either, on the CuTe-DSL row-scaled GEMM, "
     "each k-tile's sums added in fp32, called through the DSL's own convention (more host time per call: "
     "apache-tvm-ffi not installed) (MXFLUX_CUTE_GEMM=auto)"),
    ("bias,fp32", "fast", "rowwise", True, True,
     "; those computing bias,fp32 with M and N in whole tile clusters, before either, on the CuTe-DSL row-scaled "
     "GEMM, fast accumulation (all of K in the tensor cores' accumulator, MXFLUX_CUTE_ACCUMULATE=fast), called "
     "through TVM-FFI (MXFLUX_CUTE_GEMM=bias,fp32)"),
    ("bias", "fp32", "rowwise", True, True,
     "row-scaled GEMM, each k-tile's sums added in fp32, called through TVM-FFI (MXFLUX_CUTE_GEMM=bias)"),
    ("all", "fp32", "rowwise", False, True, "(MXFLUX_CUTE_GEMM=bf16,bias,fp32, not available here)"),
    ("auto", "fp32h", "rowwise", True, True,
     "row-scaled GEMM, each k-tile's sums added in fp32, in 2 parts of N, each added under the later parts' MMAs "
     "(MXFLUX_CUTE_ACCUMULATE=fp32h), called through TVM-FFI (MXFLUX_CUTE_GEMM=auto)"),
    ("auto", "fp32", "quack-cooperative", True, True,
     "on quack-kernels' cooperative GEMM with our epilogue (MXFLUX_CUTE_KERNEL=quack-cooperative), each k-tile's "
     "sums added in fp32, called through TVM-FFI (MXFLUX_CUTE_GEMM=auto)"),
])
def test_the_gemm_path_names_the_cute_gemm_where_it_is_asked_for(kinds, accumulation, kernel, available, tvm_ffi,
                                                                want, monkeypatch):
    """A run says which GEMMs MXFLUX_CUTE_GEMM asks the CuTe kernel for (by default those of 2048 tokens or
    more through TVM-FFI's calling convention, 8192 through the DSL's), how it sums K where that is not the
    contract's way, how it is called, and whether CuTe DSL is there to take them (without it the GEMMs stay
    cuBLAS's)."""
    from types import SimpleNamespace

    import torch

    from mxflux.kernels.gemm_cute import cute_gemm_choice
    from mxflux.train import step_path as sp

    from mxflux.kernels import gemm_cute

    monkeypatch.setattr(gemm_cute, "tvm_ffi_present", lambda: tvm_ffi)
    monkeypatch.setattr(sp, "cute_tvm_ffi", lambda: tvm_ffi)
    monkeypatch.setattr(sp, "CUTE_GEMM", cute_gemm_choice(kinds))
    monkeypatch.setattr(sp, "CUTE_ACCUMULATION", accumulation)
    monkeypatch.setattr(sp, "CUTE_KERNEL", kernel)
    monkeypatch.setattr(sp, "cute_available", lambda: available)
    monkeypatch.setattr(sp, "FORCE_REFERENCE", False)
    cfg = load_recipe("tiny-mxfp6", ["model.compile=true"])
    model, _ = build_model(cfg, "cpu")
    trainer = SimpleNamespace(cfg=cfg, device=torch.device("cuda"), model=model, optimizer=None,
                              block_graphs=SimpleNamespace(on=False), accum=1, world=1)
    gemm = sp.step_path(trainer)["mx_gemm"]
    assert ("CuTe" not in gemm) if want is None else gemm.endswith(want)


@pytest.mark.parametrize("switch, available, want", [
    ("off", True, "; on cuBLAS's 1x128 block-scaled GEMM (MXFLUX_CUTE_BLOCKWISE=off)"),
    ("on", True, "; on the CuTe-DSL GEMM with block scales at the promotion (MXFLUX_CUTE_BLOCKWISE=on)"),
    ("on", False, "; on the CuTe-DSL GEMM with block scales at the promotion (MXFLUX_CUTE_BLOCKWISE=on, not "
                  "available here)"),
])
def test_the_gemm_path_names_the_blockwise_gemm(switch, available, want, monkeypatch):
    """`mx_gemm: blockwise` on CUDA: the run says whether its 1x128 GEMMs are cuBLAS's or the CuTe kernel's with
    block scales at the promotion (MXFLUX_CUTE_BLOCKWISE, opt-in), and the row-scaled CuTe clause is not there."""
    from types import SimpleNamespace

    import torch

    from mxflux.train import step_path as sp

    monkeypatch.setattr(sp, "CUTE_BLOCKWISE", switch)
    monkeypatch.setattr(sp, "cute_available", lambda: available)
    monkeypatch.setattr(sp, "FORCE_REFERENCE", False)
    cfg = load_recipe("tiny-mxfp6", ["precision.mx_gemm=blockwise", "model.compile=true"])
    model, _ = build_model(cfg, "cpu")
    trainer = SimpleNamespace(cfg=cfg, device=torch.device("cuda"), model=model, optimizer=None,
                              block_graphs=SimpleNamespace(on=False), accum=1, world=1)
    gemm = sp.step_path(trainer)["mx_gemm"]
    assert gemm.endswith(want) and "row-scaled GEMM" not in gemm, gemm
