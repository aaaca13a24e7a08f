"""Selective activation checkpointing of the MX packers: recompute the packer calls on activations
in backward instead of keeping their FP8 column operands (`model.activation_checkpointing:
mx_packers`), or everything but the GEMMs and attention (`elementwise`); docs/design.md, "The
three GEMMs and their operands".

Why. For wgrad an MX linear keeps Xᵀ, the E4M3 column operand of its input (1 B per element).
torchao's FP8 linears keep no such copy: their casts are ordinary ops, which inductor's
partitioner recomputes in backward from bf16 tensors the neighbouring ops keep anyway (a
LayerNorm's input, the attention output, GELU's input). An MX packer is an opaque custom op,
which the partitioner never recomputes by itself. Marking its calls on activations
MUST_RECOMPUTE under a selective-checkpointing policy makes the partitioner run them again in
backward, from what it keeps anyway, and keep no Xᵀ: measured on the CPU's inductor, a compiled
Flux double block then keeps exactly FP8's bytes (benchmarks/RESULTS.md, "What a compiled block
keeps"). The price is the packer work run again. So that it is only the col operand's, the MX
linears of such a block pack their input apart (`MXConfig.pack_apart`): its e_ref alone first
(`mxflux::mx_erefs`, whose few words per row and column the partitioner keeps), then each
orientation by its own call with them; backward re-runs the col call alone, the packer's second
pass for one orientation, where one call for both would run both passes for both again.

Where it pays is a property of the model, not of the op: recomputing a packer only helps when
its bf16 input is kept anyway or can be rebuilt cheaply from what is. When the input is built for
that linear alone (a Flux single block's linear2 reads the attention output concatenated with the
GELU output), recomputing the packer alone makes the partitioner keep that bf16 input (2 B per
element) in place of the E4M3 Xᵀ (1 B), and the block keeps more. Marking the ops that build it
(there: the concatenation and GELU) MUST_RECOMPUTE as well makes the partitioner rebuild it in
backward from the attention output and GELU's input, which backward keeps anyway for attention's
and GELU's own gradients. So a policy takes the ops to rebuild; the caller that knows the block
picks them (`mxflux.train.parallelize.mx_packer_rebuilt_ops`).

The `elementwise` mode goes further, in any precision: it keeps only what costs FLOPs to make,
the outputs of the GEMMs (the MX and FP8 scaled GEMMs, bf16 matmuls) and of attention, and
marks every other op MUST_RECOMPUTE: norms, modulation, RoPE, QK-norm, GELU, the gates and the
residual adds, as well as the packer calls. Those are memory-bound ops over tensors backward
reads anyway, so recomputing them costs bandwidth, not GEMM time. In-place and random ops are
never recomputed (a mutation would happen twice, a random op would differ).

Only under torch.compile. The policy is meant for the partitioner, which saves what backward
needs and no more; eager selective checkpointing instead saves the output of every op the
policy does not mark for recompute. The policy refuses packer calls on real (eager) tensors, and
the recipe validation refuses both modes without compile before a run starts.

The fold-window counters. A packer call adds the blocks it finds outside the fold window to its
module's `blocks_outside_window` in place. Re-run in backward with the same arguments it would
add them again (measured under compile: every forward count doubled), so the MX linears of a
block under this policy are marked (`mark_recomputed`): their forward packer calls count into a
fresh zero counter that forward then adds to the module's, and a recomputed call's count lands
in a copy nobody reads (tests/test_nn_recompute.py checks the counts against the block without
the policy).

What a call's input dtype tells: activations enter the packers in bf16; fp32 master weights
enter in fp32 and are left alone. Under FSDP2's bf16 parameters the weights' packer calls match
too (not measured): Wᵀ is then packed again in backward from the parameter, which FSDP gathers
for backward anyway, as `precision.repack_weights` does.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..ops.custom_ops import mx_erefs_op, mx_operands_op, scaled_gemm_op

__all__ = ["MXPackerRecompute", "full_recompute_context", "mark_input_repacked", "mark_recomputed",
           "mx_packer_checkpoint_context"]

_aten = torch.ops.aten
# What the `elementwise` mode keeps: the outputs of the ops that cost FLOPs. (The attention
# overloads differ by backend and torch version; those a build lacks are skipped.)
_GEMM_AND_ATTENTION = frozenset(
    getattr(getattr(_aten, name), "default")
    for name in ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                 "_efficient_attention_forward")
    if hasattr(_aten, name)) | {scaled_gemm_op.default}


class MXPackerRecompute:
    """Selective-checkpointing policy: MUST_RECOMPUTE for the MX packer calls on bf16 tensors
    (activations) and for the ops in `rebuilt` (aten overloads that build an MX linear's input for
    it alone), and with `elementwise` for every op but the GEMMs and attention (and in-place or
    random ops); PREFER_SAVE for every other op, which to the partitioner is no opinion: it
    decides for them as it would without a policy (only MUST_SAVE binds it).

    With `precision.saved_operands: e2m3` the column operand of a recomputed call passes through
    `mxflux::compact_operand` in forward; the partitioner recomputes that call along with the
    packer's (measured: no codes kept), so it needs no rule here.
    """

    def __init__(self, rebuilt: Collection[torch._ops.OpOverload] = (), *, elementwise: bool = False,
                 packers: bool = True):
        self.rebuilt = frozenset(rebuilt)
        self.elementwise = elementwise
        self.packers = packers

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is mx_operands_op.default and self.packers:
            # Eager means real tensors: torch 2.11's inductor re-runs the checkpointed region on
            # fake tensors with `is_compiling()` off (and makes an RNG seed tensor so), which
            # must pass; the check is on the packer calls only for that reason too.
            if not (torch.compiler.is_compiling() or is_fake(args[0])):
                raise RuntimeError(
                    "selective recompute of the MX packers runs only under torch.compile (eager it "
                    "would count fold-window blocks twice and save every other op's output); in a "
                    "recipe: model.activation_checkpointing=mx_packers or elementwise needs "
                    "model.compile=true")
            if args[0].dtype == torch.bfloat16:
                return CheckpointPolicy.MUST_RECOMPUTE
        elif op is mx_erefs_op.default:
            pass  # a few words per row and column, from a pass over the input: kept, in every mode
        elif op in self.rebuilt or (self.elementwise and op not in _GEMM_AND_ATTENTION and not op._schema.is_mutable
                                    and torch.Tag.nondeterministic_seeded not in op.tags):
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_SAVE


def mx_packer_checkpoint_context(rebuilt: Collection[torch._ops.OpOverload] = (), *, elementwise: bool = False,
                                 packers: bool = True):
    """A `context_fn` for non-reentrant `torch.utils.checkpoint.checkpoint` (or `checkpoint_wrapper`)
    that recomputes the MX packer calls on activations (unless `packers` is False) and the `rebuilt`
    ops (with `elementwise`, every op but the GEMMs and attention); see `MXPackerRecompute`. The same
    object for the same arguments (`_context_fn`)."""
    return _context_fn(MXPackerRecompute, frozenset(rebuilt), elementwise=elementwise, packers=packers)


@functools.cache
def _context_fn(policy_type, *args, **kwargs):
    """One `context_fn` per policy: dynamo guards the compiled block on the identity of the
    `context_fn` it was traced with, so blocks of one kind share their compiled code only if they
    share that object; a new one per block recompiled every block (57 in Flux-12B, past dynamo's
    cache limit of 8, after which the blocks ran eagerly: 2x the 12B LoRA step on an H100)."""
    return functools.partial(create_selective_checkpoint_contexts, policy_type(*args, **kwargs))


# What `keep_attention` and `keep_gemms` keep (`full_recompute_context`): attention's outputs; the
# outputs of the linears' GEMMs (MX, FP8 and bf16 with a bias), not a bare matmul's: a LoRA
# adapter's up-projection (`aten.mm`) makes a tensor as large as its base's output for a sliver of
# its FLOPs, so it is run again.
_ATTENTION = frozenset(op for op in _GEMM_AND_ATTENTION if "attention" in op.name())
_LINEAR_GEMMS = frozenset({_aten.addmm.default, _aten._scaled_mm.default, scaled_gemm_op.default})


class _RecomputeAllBut:
    """Selective-checkpointing policy: MUST_SAVE for the ops in `kept`, PREFER_RECOMPUTE (run
    again in backward) for every other op."""

    def __init__(self, kept: frozenset):
        self.kept = kept

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self.kept else CheckpointPolicy.PREFER_RECOMPUTE


def full_recompute_context(*, keep_attention: bool = False, keep_gemms: bool = False):
    """The `context_fn` for full activation checkpointing of a block (`checkpoint_wrapper`'s
    argument): every op marked for recompute by the op, as the plain checkpoint means, but those
    `keep_attention` and `keep_gemms` name.

    Why not the plain checkpoint. Compiled, the plain checkpoint marks the ops of its region in
    dynamo's graph; the ops inside an autograd.Function's forward (every MX linear's) sit in a
    nested graph, and torch 2.11's partitioner then decides for them as outside any checkpoint: it
    never recomputes a GEMM, so it kept the outputs of every MX GEMM that backward reads (qkv, fc1,
    linear1: 10 GiB of a 12B LoRA step at 1024², tests/test_nn_recompute.py shows it on 2.11 CPU;
    torch 2.13 marks them). A selective-checkpoint policy marks each op as it is dispatched, inside
    autograd.Functions too. Eager, recomputing every op is what the plain checkpoint does.

    `keep_attention` keeps attention's outputs (its output and log-sum-exp: 2 B per token and
    channel), so backward does not run attention's forward again: at FLUX.1-dev's 4608 tokens
    that is 28 MB per block for about 0.4 ms of an H100's time (attention's forward is ~45 ms of
    the 12B LoRA step, run twice over 57 blocks), the cheapest recompute there is to buy back.
    `keep_gemms` keeps the linears' GEMM outputs too (about 7 times more bytes per block for a
    block's forward GEMMs). Both hold eager and compiled: what the policy saves is saved, every
    other op runs again."""
    kept = (_ATTENTION if keep_attention else frozenset()) | (_LINEAR_GEMMS if keep_gemms else frozenset())
    return _context_fn(_RecomputeAllBut, kept)


def mark_recomputed(module: nn.Module, *, selective: bool = False) -> None:
    """Tell every MX linear in `module` that its forward packer calls may run again in backward,
    so that they count fold-window blocks into a fresh counter added to the module's once
    (`MXConfig.recomputed`): without it a recomputed call counts its blocks twice. `selective`
    (a policy picks what is recomputed, not the whole forward): they also pack their input apart
    (`MXConfig.pack_apart`), so that only the col operand's call is recomputed."""
    from .frozen import FrozenMXFP6Linear
    from .linear import MXFP6Linear

    for m in module.modules():
        if isinstance(m, MXFP6Linear):
            m.cfg = m.cfg._replace(recomputed=True, pack_apart=selective)
        elif isinstance(m, FrozenMXFP6Linear):  # packs its input's row operand only: nothing to pack apart
            m.cfg = m.cfg._replace(recomputed=True)


def mark_input_repacked(module: nn.Module) -> None:
    """Tell an MX linear (or a fused MLP: its fc2) to keep its input for backward instead of the
    input's Xᵀ, and pack Xᵀ from it again in backward (`MXConfig.repack_input`; the same bytes). It
    pays only where backward keeps that input anyway or the partitioner rebuilds it from what it
    keeps: `activation_checkpointing: mx_inputs` picks such linears and rebuilds their inputs
    (`mxflux.train.parallelize.mx_repacked_inputs`). A fused MLP's cfg is fc1's and fc2's alike (its
    fused path needs them equal); its Function applies `repack_input` to fc2's input alone, the
    activation, whose Xᵀ it packs from h (kept anyway for GELU's gradient)."""
    from .linear import MXFP6Linear
    from .mlp import FusedMXFP6MLP

    linears = (module.fc1, module.fc2) if isinstance(module, FusedMXFP6MLP) else (module,)
    if not all(isinstance(m, MXFP6Linear) for m in linears):
        raise TypeError(f"mark_input_repacked: expected an MXFP6Linear or a FusedMXFP6MLP, got {type(module).__name__}")
    for m in linears:
        m.cfg = m.cfg._replace(repack_input=True)
