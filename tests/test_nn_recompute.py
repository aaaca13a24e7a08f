"""`model.activation_checkpointing: mx_packers`: the compiled partitioner recomputes the MX packer
calls on activations in backward instead of keeping their E4M3 column operands
(`mxflux.nn.recompute`, `mxflux.train.parallelize.checkpoint_block`).

The packer is deterministic, so outputs, gradients and the fold-window counters must equal those
of the same compiled block without the policy bit for bit; the counters in particular must not
count a recomputed call's blocks twice. What autograd keeps must lose exactly the activations'
column operands: none in either block, a single block's linear2 input rebuilt from what the block
keeps anyway (docs/design.md, "The three GEMMs and their operands"). CPU inductor, tiny shapes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._python_dispatch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from mxflux.bench.compare import PROXY_OVERRIDES, PROXY_RECIPE, SETTINGS
from mxflux.bench.memory import record_saved_tensors
from mxflux.model import Flux, flux_config, image_ids, text_ids
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear, apply_precision, functional
from mxflux.nn.linear import weight_version
from mxflux.nn.mlp import linears_with_own_forward
from mxflux.nn.recompute import MXPackerRecompute, mx_packer_checkpoint_context
from mxflux.ops import eref_buffer_words
from mxflux.ops.custom_ops import mx_erefs_op, mx_operands, mx_operands_op
from mxflux.train.config import RecipeError, load_recipe
from mxflux.train.parallelize import checkpoint_block

N_TXT, SIDE = 16, 6  # 16 text + 36 image tokens per sample, 2 samples


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own blocks; leave no compiled code behind for the next.
    (Inductor's scalar C++, `cpp.vec_isa_ok: False`, would halve the cold compiles, but with one
    OpenMP thread torch 2.13 still emits at::vec calls there and the C++ does not compile.)"""
    yield
    torch._dynamo.reset()


def _blocks(kind, gen, mode="mx_packers", **precision):
    """Two copies of one tiny Flux block of `kind` in MXFP6 (tiny-mxfp6 with `precision` changed):
    (plain, wrapped for activation checkpointing `mode`), and inputs that put activation blocks outside the fold window."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1)
    model = Flux(cfg)
    apply_precision(model, load_recipe("tiny-mxfp6").precision.model_copy(update=precision))
    block = model.double_blocks[0] if kind == "double" else model.single_blocks[0]
    b, d = 2, cfg.hidden_size
    # The modulation scales sample 0's normalized activations by 2^16 and leaves sample 1's about
    # as they are: the col operands Xᵀ (one fold group per feature, over both samples' tokens)
    # then have sample 1's blocks outside the fold window, so the counters have something to count.
    vec = torch.full((b, d), 16.0)
    vec[1] = -16.0  # silu(-16) ~ -2e-6
    mods = [block.img_mod, block.txt_mod] if kind == "double" else [block.modulation]
    with torch.no_grad():
        for mod in mods:
            for chunk in range(1, mod.multiplier, 3):  # the scale of (shift, scale, gate)
                mod.lin.weight[chunk * d:(chunk + 1) * d] = 2.0**16 / (16 * d)
                mod.lin.bias[chunk * d:(chunk + 1) * d] = 0
    pe = model.pe_embedder(torch.cat([text_ids(b, N_TXT), image_ids(b, SIDE, SIDE)], 1))
    if kind == "double":
        xs = [torch.randn(b, SIDE * SIDE, d, generator=gen), torch.randn(b, N_TXT, d, generator=gen)]
    else:
        xs = [torch.randn(b, N_TXT + SIDE * SIDE, d, generator=gen)]
    return block, checkpoint_block(copy.deepcopy(block), mode), xs, vec, pe


def _compiled_step(block, xs, vec, pe, gen_seed, compile=True):
    """Compile `block` as training does (`module.compile`, autocast outside; unless `compile` is
    False), run forward while counting what autograd keeps, then backward with a fixed random
    output gradient."""
    torch._dynamo.reset()
    counters.clear()
    if compile:
        block.compile()
    xs = [x.clone().requires_grad_() for x in xs]
    for _ in range(2):  # the first call compiles
        for m in block.modules():
            if isinstance(m, MXFP6Linear):
                m.blocks_outside_window.zero_()
        with record_saved_tensors(block) as saved, torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(*xs, vec, pe)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(gen_seed)
        for x in xs:
            x.grad = None
        block.zero_grad()
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])  # one graph
    counts = [m.blocks_outside_window.clone() for m in block.modules() if isinstance(m, MXFP6Linear)]
    grads = [p.grad for p in block.parameters()]
    assert all(g is not None for g in grads)
    return [*outs, *(x.grad for x in xs), *grads], counts, saved


def _both_steps(plain, wrapped, xs, vec, pe, gen, compile=True):
    """The compiled step of `plain` and of `wrapped` on the same inputs and output gradient: every
    output and gradient must be bit-identical and the fold-window counts equal (and non-zero, so
    that the comparison means something). Returns what each kept: (plain's, wrapped's)."""
    seed = int(torch.randint(2**31, (1,), generator=gen))
    ref, ref_counts, ref_saved = _compiled_step(plain, xs, vec, pe, seed, compile)
    got, counts, saved = _compiled_step(wrapped, xs, vec, pe, seed, compile)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), i
    assert sum(int(c) for c in ref_counts) > 0
    assert [int(c) for c in counts] == [int(c) for c in ref_counts]  # counted once
    return ref_saved, saved


def _col_operand_bytes(linear: MXFP6Linear, rows: int) -> int:
    """The E4M3 bytes of a col operand of `linear` with `rows` rows (tokens for Xᵀ, out_features
    for Wᵀ): [in_features, rows padded to whole blocks of 32]."""
    return linear.in_features * -(-rows // 32) * 32


@pytest.fixture(params=[False, True], ids=["one-call", "apart"])
def two_pass(request, monkeypatch):
    """The packers as the CPU has them (one pass per call: forward packs its inputs in one call) and as
    the GPU's two-pass kernels have them (the inputs packed apart under a selective policy)."""
    if request.param:
        monkeypatch.setattr(functional, "_two_pass_packer", lambda x: True)
    return request.param


@pytest.mark.slow
def test_a_compiled_double_block_recomputing_its_packers_is_bit_identical_and_keeps_no_activation_operand(gen, two_pass):
    """With the fused MLP (whose GELU-prologue packer call on fc1's output is recomputed too) and
    repack_weights (no Wᵀ kept): the policy leaves no E4M3 operand at all."""
    plain, wrapped, xs, vec, pe = _blocks("double", gen, repack_weights=True, fused_mlp="on")
    assert plain.img_mlp.fused
    # counted once: the recomputed calls count into a copy that is dropped, not into the module's
    ref_saved, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    # without the policy the block keeps the activations' Xᵀ; with it no E4M3 at all, and nothing
    # else in their place: at least those bytes fewer
    assert ref_saved.by_dtype["float8_e4m3fn"] > 0
    assert "float8_e4m3fn" not in saved.by_dtype, dict(saved.by_dtype)
    ref_bytes, got_bytes = sum(ref_saved.by_dtype.values()), sum(saved.by_dtype.values())
    assert got_bytes <= ref_bytes - ref_saved.by_dtype["float8_e4m3fn"], (ref_bytes, got_bytes)


@pytest.mark.slow
def test_a_compiled_single_block_rebuilds_linear2s_input_and_keeps_no_activation_operand(gen, two_pass):
    """Unfused, Wᵀ kept (repack_weights off): what stays in E4M3 is exactly the two weights' Wᵀ;
    both Xᵀ are gone, linear2's because its input (attention output and GELU concatenated) is
    rebuilt in backward (`mxflux.train.parallelize.mx_packer_rebuilt_ops`), and no bf16 copy of
    that input is kept in their place."""
    plain, wrapped, xs, vec, pe = _blocks("single", gen)
    ref_saved, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    tokens = xs[0].shape[0] * xs[0].shape[1]
    linear1, linear2 = plain.linear1, plain.linear2
    weights = sum(_col_operand_bytes(m, m.out_features) for m in (linear1, linear2))
    activations = _col_operand_bytes(linear1, tokens) + _col_operand_bytes(linear2, tokens)
    assert ref_saved.by_dtype["float8_e4m3fn"] == weights + activations
    assert saved.by_dtype["float8_e4m3fn"] == weights
    assert saved.by_dtype["bfloat16"] <= ref_saved.by_dtype["bfloat16"], (dict(saved.by_dtype), dict(ref_saved.by_dtype))
    # in their place only the inputs' e_ref (`MXConfig.pack_apart`): int32 words per token and feature
    erefs = 4 * sum(eref_buffer_words(tokens, m.in_features) for m in (linear1, linear2)) if two_pass else 0
    assert saved.by_dtype.get("int32", 0) <= erefs
    assert sum(saved.by_dtype.values()) <= sum(ref_saved.by_dtype.values()) - activations + erefs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["double", "single"])
def test_elementwise_recompute_keeps_only_gemm_and_attention_outputs(gen, kind):
    """`activation_checkpointing: elementwise` (repack_weights on, so no Wᵀ either): outputs,
    gradients and counts bit-identical to the plain compiled block; no E4M3 kept, and fewer bf16
    bytes than `mx_packers` keeps (which keeps the norms', RoPE's and the gates' tensors too):
    at most the GEMM outputs, attention's output and the block inputs."""
    plain, wrapped, xs, vec, pe = _blocks(kind, gen, "elementwise", repack_weights=True)
    _, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    _, packers_saved = _both_steps(*_blocks(kind, gen, "mx_packers", repack_weights=True), gen)
    assert "float8_e4m3fn" not in saved.by_dtype, dict(saved.by_dtype)
    assert saved.by_dtype["bfloat16"] < packers_saved.by_dtype["bfloat16"], \
        (dict(saved.by_dtype), dict(packers_saved.by_dtype))
    # the GEMM outputs (bf16) per token: double qkv 3 + proj 1 + fc1 4 + fc2 1 per stream; single
    # linear1 3 + 4 and linear2 1; plus attention's output and the block's input(s), 1 each
    tokens, d = xs[0].shape[0] * sum(x.shape[1] for x in xs), plain.hidden_size
    assert saved.by_dtype["bfloat16"] <= tokens * d * 2 * (11 if kind == "double" else 10), dict(saved.by_dtype)


@pytest.mark.parametrize("kind,fused,two_pass", [pytest.param("double", "on", False, marks=pytest.mark.slow),
                                                 pytest.param("double", "off", False, marks=pytest.mark.slow),
                                                 ("single", "auto", False), ("single", "auto", True)])
def test_mx_inputs_keeps_no_xt_of_inputs_backward_rebuilds(gen, kind, fused, two_pass, monkeypatch):
    """`activation_checkpointing: mx_inputs`: outputs, gradients and counts bit-identical to the plain
    compiled block; the Xᵀ of attention's proj, the MLP's fc2 (fused: the activation's, packed from
    h) and linear2 are not kept, and nothing in their place: the E4M3 bytes drop by exactly theirs,
    the bf16 bytes do not grow (their inputs are rebuilt from what backward keeps anyway). Where the
    packer has two passes (`two_pass`, as on a GPU) each such input's e_ref is kept instead, a few words
    per row and column (`functional._repack_erefs`): the partitioner does not find it again in backward."""
    if two_pass:
        monkeypatch.setattr(functional, "_two_pass_packer", lambda x: True)
    plain, wrapped, xs, vec, pe = _blocks(kind, gen, "mx_inputs", fused_mlp=fused)
    ref_saved, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    tokens = [x.shape[0] * (x.shape[1] if kind == "double" else sum(y.shape[1] for y in xs)) for x in xs]
    if kind == "double":
        assert isinstance(plain.img_mlp, FusedMXFP6MLP) == (fused == "on")
        repacked = [(m, n) for stream, n in zip(("img", "txt"), tokens) for m in
                    (getattr(plain, f"{stream}_attn").proj, getattr(plain, f"{stream}_mlp")[2])]
    else:
        repacked = [(plain.linear2, tokens[0])]
    inputs_xt = sum(_col_operand_bytes(m, n) for m, n in repacked)
    erefs = sum(4 * eref_buffer_words(n, m.in_features) for m, n in repacked) if two_pass else 0
    assert saved.by_dtype["float8_e4m3fn"] == ref_saved.by_dtype["float8_e4m3fn"] - inputs_xt
    assert saved.by_dtype["bfloat16"] <= ref_saved.by_dtype["bfloat16"], (dict(saved.by_dtype), dict(ref_saved.by_dtype))
    assert saved.by_dtype.get("int32", 0) == erefs, dict(saved.by_dtype)
    assert sum(saved.by_dtype.values()) <= sum(ref_saved.by_dtype.values()) - inputs_xt + erefs


def _keep_weight_operands(block) -> list[torch.Tensor]:
    """Attach to the linears of `block` that run their own forward the operands of their weights, as the
    optimizer step keeps them (here from the CPU's packer): their row data tensors."""
    rows = []
    for m in linears_with_own_forward(block):
        ops = mx_operands(m.weight.detach(), None, torch.zeros(1, dtype=torch.int64), True, True,
                          m.cfg.granularity.value, m.cfg.hadamard, "none", False)[:4]
        m.weight_operands, m.weight_state_version = tuple(ops), weight_version(m.weight)
        rows.append(ops[0])
    return rows


def _gemm_traced_as_on_cuda(monkeypatch, deferred: bool) -> None:
    """Compiled, the MX GEMMs go into the graph as CUDA traces them without CuTe DSL: torch's row-scaled
    `_scaled_mm` (`kernels.gemm.scaled_gemm_cuda_traceable`, which the CPU's torch runs too) or, with
    `deferred`, the unit-scaled GEMM with its scales applied after it (at any size here); eager calls
    stay the op."""
    from mxflux.kernels import gemm
    from mxflux.mx import FoldGranularity
    from mxflux.ops.custom_ops import scaled_gemm_op

    monkeypatch.setattr(gemm, "_check", lambda *args: None)  # (which asks for CUDA tensors)
    if deferred:
        monkeypatch.setattr(gemm, "DEFER_SCALES", "all")

    def scaled_gemm(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype):
        if torch.compiler.is_compiling():
            return gemm.scaled_gemm_cuda_traceable(a_data, a_scale, b_data, b_scale,
                                                   FoldGranularity.from_mx_gemm(granularity), bias, out_dtype)
        return scaled_gemm_op(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype)

    monkeypatch.setattr(functional, "scaled_gemm", scaled_gemm)


@pytest.mark.parametrize("gemm", ["op", "scaled_mm", "deferred"])
@pytest.mark.parametrize("kind, mode", [("double", "mx_inputs"), ("single", "mx_inputs"), ("single", "none"),
                                        ("single", "full")])
def test_backward_reads_no_kept_weight_row_operand_unless_it_runs_forward_again(gen, monkeypatch, kind, mode, gemm):
    """What lets the trainer free the weights' kept row operands between forward and the step
    (`precision.release_weight_rows`; `train.build.rows_release_off`): a compiled block's backward does
    not read them, plain or under `mx_inputs` (the partitioner never recomputes the GEMM), with the GEMM
    as the opaque op (the CPU, and CUDA with the CuTe GEMM) or traced as torch's `_scaled_mm`, row-scaled
    or unit-scaled with the scales after it (CUDA's cuBLAS path). Here they are overwritten with E4M3 NaN
    after forward: autograd has not saved them (its version check would fail) and the gradients stay bit
    for bit those of the same step without it. Under full checkpointing backward runs forward's GEMMs
    again and reads them, which is why the trainer keeps them there."""
    if gemm != "op":
        _gemm_traced_as_on_cuda(monkeypatch, deferred=gemm == "deferred")
    plain, wrapped, xs, vec, pe = _blocks(kind, gen, mode if mode != "none" else "full")
    block = plain if mode == "none" else wrapped
    rows = _keep_weight_operands(block)
    assert rows
    good = [r.clone() for r in rows]
    torch._dynamo.reset()
    block.compile()
    xs = [x.clone().requires_grad_() for x in xs]
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    dys = None
    results = []
    for poisoned in (False, False, True):  # the first call compiles
        for r, v in zip(rows, good):
            r.copy_(v)
        for x in xs:
            x.grad = None
        block.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if not results:  # the forward's generated code: the GEMMs as the op, or as `_scaled_mm`
                out, code = run_and_get_code(block, *xs, vec, pe)
                assert ("_scaled_mm(" in "".join(code)) == (gemm != "op")
                assert ("torch.ops.mxflux.scaled_gemm" in "".join(code)) == (gemm == "op")
            else:
                out = block(*xs, vec, pe)
        outs = out if isinstance(out, tuple) else (out,)
        if poisoned:
            for r in rows:
                r.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        dys = dys or [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        try:
            torch.autograd.backward(outs, dys)
        except RuntimeError as e:  # autograd saved them for backward, and its version check saw the write
            assert poisoned and "modified by an inplace operation" in str(e)
            results.append(None)
            break
        results.append([*(x.grad for x in xs), *(p.grad for p in block.parameters())])
    reads = results[2] is None or not all(torch.equal(a, b) for a, b in zip(results[1], results[2]))
    assert reads == (mode == "full")


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_a_fully_checkpointed_block_counts_fold_window_blocks_once(gen, compile):
    """Full checkpointing re-runs the whole forward in backward, packer calls included: compiled
    and eager, their fold-window blocks still count once (they doubled before the block was
    marked)."""
    _both_steps(*_blocks("single", gen, "full"), gen, compile)


@pytest.mark.parametrize("kind", ["double", "single"])
def test_a_compiled_fully_checkpointed_block_keeps_only_its_inputs(gen, kind):
    """Full checkpointing keeps a block's inputs and nothing it computes. torch 2.11's partitioner
    kept the output of every MX GEMM that backward reads (qkv, fc1, linear1) under the plain
    checkpoint, the MX linears' ops lying inside autograd.Functions
    (`mxflux.nn.recompute.full_recompute_context`); on 2.11 this test fails without it."""
    plain, wrapped, xs, vec, pe = _blocks(kind, gen, "full")
    _, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    inputs = sum(t.numel() * t.element_size() for t in (*xs, vec, pe))
    assert sum(saved.by_dtype.values()) <= inputs + 64, (dict(saved.by_dtype), inputs)


@pytest.mark.parametrize("kind", ["double", "single"])
def test_attention_checkpointing_keeps_inputs_and_attention_and_the_kept_blocks_their_gemms(gen, kind):
    """`activation_checkpointing: attention` keeps a block's inputs and attention's output (bf16, one
    value per token and channel) with its log-sum-exp (fp32, one per token and head), nothing else;
    `keep_gemm_outputs` adds the linears' outputs. Outputs, gradients and counts bit-identical to
    the plain compiled block in both."""
    plain, wrapped, xs, vec, pe = _blocks(kind, gen, "attention")
    _, saved = _both_steps(plain, wrapped, xs, vec, pe, gen)
    inputs = sum(t.numel() * t.element_size() for t in (*xs, vec, pe))
    tokens, d, heads = xs[0].shape[0] * sum(x.shape[1] for x in xs), plain.hidden_size, plain.num_heads
    attention = tokens * d * 2 + tokens * heads * 4
    assert inputs + attention <= sum(saved.by_dtype.values()) <= inputs + attention + 64, (dict(saved.by_dtype),
                                                                                         inputs, attention)
    plain, _, xs, vec, pe = _blocks(kind, gen, "attention")
    kept = checkpoint_block(copy.deepcopy(plain), "attention", keep_gemm_outputs=True)
    _, kept_saved = _both_steps(plain, kept, xs, vec, pe, gen)
    # the GEMM outputs per token (bf16): double qkv 3 + proj 1 + fc1 4 + fc2 1; single linear1 3 + 4, linear2 1
    gemms = tokens * d * 2 * (9 if kind == "double" else 8)
    assert sum(kept_saved.by_dtype.values()) >= inputs + attention + gemms - 64, dict(kept_saved.by_dtype)


@pytest.mark.parametrize("mode", ["full", "attention", "mx_packers"])
def test_blocks_of_one_kind_share_their_compiled_code(gen, mode):
    """Dynamo guards a compiled block on its `context_fn`'s identity: one made per block recompiled
    every block, and past dynamo's cache limit (8) Flux-12B's blocks ran eagerly, at half speed.
    Ten single blocks checkpointed alike compile once (twice: the first input needs no gradient)."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    model = Flux(flux_config("flux-tiny", depth=1, depth_single_blocks=10))
    apply_precision(model, load_recipe("tiny-mxfp6").precision)
    blocks = model.single_blocks
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_block(block, mode, keep_gemm_outputs=mode != "mx_packers" and i < 5)
        blocks[i].compile()
    torch._dynamo.reset()
    counters.clear()
    b, d = 2, model.hidden_size
    x = torch.randn(b, N_TXT + SIDE * SIDE, d, generator=gen).requires_grad_()
    pe = model.pe_embedder(torch.cat([text_ids(b, N_TXT), image_ids(b, SIDE, SIDE)], 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for block in blocks:
            x = block(x, torch.randn(b, d, generator=gen), pe)
    x.float().sum().backward()
    # the kept blocks' policy differs from the others': one compile each, the first block's input aside
    assert counters["stats"]["unique_graphs"] <= (2 if mode == "mx_packers" else 3), dict(counters["stats"])


def test_the_policy_refuses_eager_mode(gen):
    """Eager, a recomputed packer call would add its fold-window count a second time."""
    layer = MXFP6Linear(64, 32)
    x = torch.randn(40, 64, generator=gen).bfloat16().requires_grad_()
    with pytest.raises(RuntimeError, match="model.activation_checkpointing=mx_packers or elementwise needs model.compile"):
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=mx_packer_checkpoint_context())
    assert MXPackerRecompute([torch.ops.aten.cat.default]).rebuilt == {torch.ops.aten.cat.default}
    # torch 2.11's inductor re-runs the checkpointed region on fake tensors with `is_compiling()`
    # off (which failed the proxy run on the H200): fake inputs pass, as do other ops
    policy = MXPackerRecompute()
    with FakeTensorMode():
        fake = torch.randn(40, 64).bfloat16()
    assert policy(None, mx_operands_op.default, fake) is CheckpointPolicy.MUST_RECOMPUTE
    assert policy(None, torch.ops.aten.lift_fresh.default, torch.tensor(())) is CheckpointPolicy.PREFER_SAVE


def test_mx_packers_config_takes_the_old_booleans_and_needs_compile():
    for value, mode in (("true", "full"), ("false", "none"), ("full", "full"), ("none", "none")):
        assert load_recipe("tiny-mxfp6", [f"model.activation_checkpointing={value}"]).model.activation_checkpointing \
            == mode
    cfg = load_recipe("tiny-mxfp6", ["model.activation_checkpointing=mx_packers", "model.compile=true"])
    assert cfg.model.activation_checkpointing == "mx_packers"
    with pytest.raises(RecipeError, match="activation_checkpointing: mx_packers needs model.compile: true"):
        load_recipe("tiny-mxfp6", ["model.activation_checkpointing=mx_packers"])
    for mode in ("elementwise", "mx_inputs"):
        with pytest.raises(RecipeError, match=f"activation_checkpointing: {mode} needs model.compile: true"):
            load_recipe("tiny-mxfp6", [f"model.activation_checkpointing={mode}"])
    with pytest.raises(RecipeError, match="model.activation_checkpointing: Input should be 'none', 'full', "
                                          "'attention', 'mx_packers', 'elementwise' or 'mx_inputs'"):
        load_recipe("tiny-mxfp6", ["model.activation_checkpointing=packers"])
    # blocks_keeping_gemm_outputs: under full or attention, and no more blocks than the model has
    kept = load_recipe("tiny-mxfp6", ["model.activation_checkpointing=attention",
                                      "model.blocks_keeping_gemm_outputs={double: 1, single: 2}"]).model
    assert (kept.blocks_keeping_gemm_outputs.double, kept.blocks_keeping_gemm_outputs.single) == (1, 2)
    with pytest.raises(RecipeError, match="blocks_keeping_gemm_outputs: applies under activation_checkpointing "
                                          "full or attention, got 'none'"):
        load_recipe("tiny-mxfp6", ["model.blocks_keeping_gemm_outputs={double: 1, single: 0}"])
    with pytest.raises(RecipeError, match="blocks_keeping_gemm_outputs.single: 9 is more than the model's 2 single"):
        load_recipe("tiny-mxfp6", ["model.activation_checkpointing=full",
                                   "model.blocks_keeping_gemm_outputs={double: 0, single: 9}"])
    # the built-in recipes that checkpoint (written as `true`) still load, as full checkpointing
    assert load_recipe("flux12b-mxfp6-mlperf").model.activation_checkpointing == "full"
    # every benchmark setting is valid on the compiled proxy it runs on
    for name, overrides in SETTINGS.items():
        proxy = load_recipe(PROXY_RECIPE, [*PROXY_OVERRIDES, *overrides])
        assert proxy.model.activation_checkpointing == ("mx_packers" if name.endswith("-sac") else "elementwise"
                                                        if name.endswith("-elementwise") else "mx_inputs"
                                                        if name.endswith("-inputs") else "none"), name
        assert proxy.precision.repack_weights == ("repack" in name), name
        assert (proxy.precision.saved_operands == "e2m3") == ("6bit" in name), name


class _MXCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the mxflux packer ops dispatched while active: ("erefs", None, None) or ("pack", row,
    col, erefs given); compiled code calls them through the dispatcher too."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is mx_operands_op.default:
            self.calls.append(("pack", args[3], args[4], (args[9] if len(args) > 9 else kwargs.get("erefs")) is not None))
        elif func is mx_erefs_op.default:
            self.calls.append(("erefs", None, None, None))
        return func(*args, **kwargs)


def test_a_linear_that_packs_apart_gives_the_same_bits_and_counts(gen, monkeypatch):
    """`MXConfig.pack_apart` (set on the MX linears of a block under a selective-recompute policy):
    forward finds its input's e_ref once, then packs each orientation by its own call with them; the
    output, every gradient and the fold-window count are those of the one call for both (inputs with
    blocks outside the window), eager on the CPU (the split as the GPU's two-pass packers take it; the
    CPU packers, one pass per call, are not split in training)."""
    from mxflux.nn import functional
    from mxflux.nn.functional import MXConfig, mx_linear

    monkeypatch.setattr(functional, "_two_pass_packer", lambda x: True)  # as on a GPU
    x = torch.randn(70, 96, generator=gen).bfloat16()
    x[:35] *= 2.0**14  # half the tokens far above the rest: the col operand has blocks outside the window
    w = torch.randn(64, 96, generator=gen, requires_grad=True)
    b = torch.randn(64, generator=gen, requires_grad=True)
    dy = torch.randn(70, 64, generator=gen).bfloat16()
    results = []
    for apart in (False, True):
        xg = x.clone().requires_grad_()
        w.grad = b.grad = None
        counter = torch.zeros(1, dtype=torch.int64)
        with _MXCalls() as seen:
            y = mx_linear(xg, w, b, counter, MXConfig(recomputed=True, pack_apart=apart))
        forward = seen.calls
        y.backward(dy)
        results.append((y, xg.grad, w.grad.clone(), b.grad.clone(), counter.clone()))
        if apart:  # its e_ref, then the row operand alone and the col operand alone, both from them
            assert forward[:3] == [("erefs", None, None, None), ("pack", True, False, True), ("pack", False, True, True)]
        else:
            assert forward[0] == ("pack", True, True, False)
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)
    assert int(results[0][-1]) > 0


def test_a_repacked_input_is_packed_from_the_e_ref_forward_found(gen, monkeypatch):
    """`MXConfig.repack_input` (`mx_inputs`) where the packer has two passes (as on a GPU): forward finds
    the input's e_ref once and packs its row operand from it; backward packs Xᵀ col-only from the same
    e_ref (its second pass alone: no first pass over the input again); output, gradients and count those
    of the linear keeping Xᵀ (eager on the CPU; the GPU's bits: tests/test_nn_repack_weights.py)."""
    from mxflux.nn import functional
    from mxflux.nn.functional import MXConfig, mx_linear

    monkeypatch.setattr(functional, "_two_pass_packer", lambda x: True)  # as on a GPU
    x = torch.randn(70, 96, generator=gen).bfloat16()
    x[:35] *= 2.0**14  # blocks outside the col operand's window: the count must match
    w = torch.randn(64, 96, generator=gen, requires_grad=True)
    dy = torch.randn(70, 64, generator=gen).bfloat16()
    results = []
    for repack in (False, True):
        xg = x.clone().requires_grad_()
        w.grad = None
        counter = torch.zeros(1, dtype=torch.int64)
        with _MXCalls() as seen:
            y = mx_linear(xg, w, None, counter, MXConfig(repack_input=repack))
        forward = list(seen.calls)
        with _MXCalls() as seen:
            y.backward(dy)
        backward = seen.calls
        results.append((y, xg.grad, w.grad.clone(), counter.clone()))
        if repack:  # x's e_ref, then its row operand alone from them; in backward Xᵀ alone from them
            assert forward[:2] == [("erefs", None, None, None), ("pack", True, False, True)], forward
            assert ("pack", False, True, True) in backward and ("erefs", None, None, None) not in backward, backward
        else:
            assert forward[0] == ("pack", True, True, False), forward
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert int(results[0][-1]) > 0


@pytest.mark.slow
def test_backward_recomputes_only_the_col_operand_of_each_activation(gen, monkeypatch):
    """Compiled under `mx_packers`: in backward the partitioner re-runs, of each activation's packing,
    only the col operand's call (one orientation, from the e_ref forward kept: no `mx_erefs` in
    backward, no row operand packed from kept e_ref); everything else backward packs is dY's (both
    orientations, its own first pass). Bit-identical to the plain block (`_both_steps`)."""
    monkeypatch.setattr(functional, "_two_pass_packer", lambda x: True)  # as on a GPU
    plain, wrapped, xs, vec, pe = _blocks("double", gen, repack_weights=True)
    _both_steps(plain, wrapped, xs, vec, pe, gen)  # compiles `wrapped`; outputs and counts as the plain block's
    xs = [x.clone().requires_grad_() for x in xs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapped(*xs, vec, pe)
    with _MXCalls() as seen:
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    recomputed = [c for c in seen.calls if c[0] == "pack" and c[3]]
    assert recomputed and all(c == ("pack", False, True, True) for c in recomputed), seen.calls
    assert ("erefs", None, None, None) not in seen.calls
    assert [c for c in seen.calls if c[0] == "pack" and not c[3]], seen.calls  # the dY packs
