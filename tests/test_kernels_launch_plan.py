"""The Triton packer's host side without Triton: launch plans (validated and computed once per
key) and the compiled-kernel launcher (`CompiledLaunch`), on the CPU with a recording stand-in for
the kernel. The same calls on real kernels are compared bit for bit in tests/gpu/test_launch_plan.py
(CUDA, or Triton's interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mxflux.kernels import operands_cuda as oc
from mxflux.kernels import operands_plan as op
from mxflux.kernels import triton_common
from mxflux.mx import FoldGranularity as G

CONSTEXPRS = ("PASS", "DO_ROW", "DO_COL", "DO_COLSUM", "GRAN", "HADAMARD", "PROLOGUE", "HW", "BR", "NB", "COAL",
              "X_F32", "PAIRS")


class FakeCompiled:
    """What Triton 3.6's `kernel[grid](...)` returns, as far as `compiled_launch` reads it."""

    def __init__(self, args, constexprs, runs):
        names = op.RUNTIME_ARGS + CONSTEXPRS
        values = tuple(args) + tuple(constexprs[k] for k in CONSTEXPRS)
        sig = {n: ("*i8" if isinstance(v, torch.Tensor) else "constexpr" if i >= len(args) else "i32")
               for i, (n, v) in enumerate(zip(names, values))}
        consts = {(i,): v for i, v in enumerate(values) if i >= len(args)}
        self.src = SimpleNamespace(fn=SimpleNamespace(arg_names=list(names)), constants=consts, signature=sig)
        self.function, self.packed_metadata = 1234, (8, 1, 0)
        self.run = lambda *a: runs.append(a)


class FakeKernel:
    """Stands in for `_pack_kernel`: records every normal launch, returns a FakeCompiled."""

    def __init__(self):
        self.calls, self.runs = [], []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, args, kw))
            return FakeCompiled(args, {k: kw[k] for k in CONSTEXPRS}, self.runs)
        return launch


class Hooks:
    launch_enter_hook = None
    launch_exit_hook = None


@pytest.fixture
def fake(monkeypatch):
    """mx_operands_cuda on CPU tensors, as under the interpreter, with launches recorded."""
    kernel = FakeKernel()
    for module in (oc, op):  # the plan's checks and the launches both look
        monkeypatch.setattr(module, "HAS_TRITON", True)
        monkeypatch.setattr(module, "interpreting", lambda: True)
    monkeypatch.setattr(oc, "_pack_kernel", kernel, raising=False)
    monkeypatch.delenv("MXFLUX_PACK_IO", raising=False)
    oc.clear_launch_plans()
    yield kernel
    oc.clear_launch_plans()


@pytest.fixture
def fast(fake, monkeypatch):
    """As `fake`, and compiled launchers are built (as on a GPU with Triton 3.6)."""
    hooks = Hooks()
    env = dict(get_stream=lambda dev: 77, hooks=hooks, current_device=lambda: 0)
    monkeypatch.setattr(oc, "_compiled_launch_device", lambda plan: 0)
    monkeypatch.setattr(oc, "compiled_launch", lambda *a: triton_common.compiled_launch(*a, _env=env))
    fake.hooks = hooks
    return fake


def x_(r=200, c=256, dtype=torch.bfloat16):
    return torch.randn(r, c).to(dtype)


def test_same_key_reuses_the_plan(fake):
    x = x_()
    oc.mx_operands_cuda(x)
    oc.mx_operands_cuda(x_())  # another tensor of the same shape, strides and flags
    assert len(op._PLANS) == 1
    (a, b) = [c for c in fake.calls if c[2]["PASS"] == 2]
    assert a[0] == b[0] and a[2] == b[2] and a[1][2:7] == b[1][2:7] and a[1][15:] == b[1][15:]


@pytest.mark.parametrize("change", ["rows", "cols", "stride", "row_stride", "dtype", "dtype_raises", "row", "col",
                                    "colsum", "hadamard",
                                    "granularity", "prologue", "hw", "io", "counter", "counter_dtype", "misaligned"])
def test_a_different_key_gets_its_own_plan(fake, change, monkeypatch):
    x = x_(200, 256)
    base = dict(row=True, col=True, colsum=False, hadamard=True, granularity=G.ROWWISE, prologue="none")
    oc.mx_operands_cuda(x, **base)
    plan0 = next(iter(op._PLANS.values()))
    kw, y = dict(base), x
    if change == "rows":
        y = x_(224, 256)
    elif change == "cols":
        y = x_(200, 512)
    elif change == "stride":
        y = x_(256, 200).t()  # same shape, column-major: read through a contiguous copy
    elif change == "row_stride":
        y = x_(200, 512)[:, :256]  # same shape, row stride 512: read in place
    elif change == "dtype":
        y = x.float()  # fp32 master weights: the kernel variant that rounds to bf16 as it reads
    elif change == "dtype_raises":
        with pytest.raises(ValueError, match="x: mx_operands_cuda reads torch.bfloat16 or torch.float32, got torch.float16"):
            oc.mx_operands_cuda(x.half(), **kw)
        with pytest.raises(ValueError, match="x: mx_operands_cuda reads torch.bfloat16, got torch.float32"):
            oc.mx_operands_cuda(x.float(), **dict(kw, prologue="gelu_tanh"))
        assert len(op._PLANS) == 1
        return
    elif change in ("row", "col", "colsum", "hadamard"):
        kw[change] = not kw[change]
    elif change == "granularity":
        kw["granularity"] = G.BLOCKWISE
    elif change == "prologue":
        kw["prologue"] = "gelu_tanh"
    elif change == "hw":
        kw["_hw"] = True
    elif change == "io":
        monkeypatch.setenv("MXFLUX_PACK_IO", "blocks")
    elif change == "counter":
        kw["counter"] = torch.zeros(1, dtype=torch.int64)
    elif change == "counter_dtype":
        kw["counter"] = torch.zeros(1, dtype=torch.int32)
    elif change == "misaligned":
        y = torch.empty(200 * 256 + 4, dtype=torch.bfloat16)[4:].view(200, 256)
        y.copy_(x)  # contiguous, address 8 bytes off 16: read through an aligned copy
        assert y.data_ptr() % 16
    oc.mx_operands_cuda(y, **kw)
    assert len(op._PLANS) == 2
    plan1 = [p for p in op._PLANS.values() if p is not plan0][0]
    grid, args, _ = fake.calls[-1]
    if change == "row_stride":
        assert not plan1.copy_x and args[0] is y and args[2] == 512
    assert plan1.meta["X_F32"] == (change == "dtype")
    if change in ("stride", "misaligned"):
        assert plan1.copy_x == (change == "stride")
        assert args[0] is not y and args[0].is_contiguous() and args[0].data_ptr() % 16 == 0
        assert args[2] == 256 and torch.equal(args[0], y)
    if change == "counter":
        assert plan1.direct_counter and fake.calls[-1][1][12] is kw["counter"]
    if change == "counter_dtype":
        assert not plan1.direct_counter


# A compiled pass-2 kernel's TTGIR, as far as the lane-pair check reads it: the shuffle over a
# tensor whose layout is LAYOUT.
_TTGIR = """#blocked = #ttg.blocked<{LAYOUT}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [2, 4], order = [1, 0]}>
      %r = tt.elementwise_inline_asm "shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;" {constraints = "=r,r", \
packed_element = 4 : i32, pure = true} %s : tensor<128x2x16xi8, #blocked> -> tensor<128x2x16xi8, #blocked> loc(#loc1)
"""
PAIRED = "sizePerThread = [1, 1, 16], threadsPerWarp = [32, 1, 1], warpsPerCTA = [4, 2, 1], order = [2, 0, 1]"
BYTEWISE = "sizePerThread = [1, 1, 1], threadsPerWarp = [2, 1, 16], warpsPerCTA = [8, 1, 1], order = [2, 0, 1]"
LANES_ON_DIM1 = "sizePerThread = [1, 1, 16], threadsPerWarp = [1, 32, 1], warpsPerCTA = [4, 2, 1], order = [2, 1, 0]"
TWO_ROWS_PER_THREAD = "sizePerThread = [2, 1, 16], threadsPerWarp = [32, 1, 1], warpsPerCTA = [2, 2, 1], order = [2, 0, 1]"


@pytest.mark.parametrize("layout, holds", [(PAIRED, True), (BYTEWISE, False), (LANES_ON_DIM1, False),
                                           (TWO_ROWS_PER_THREAD, False)])
def test_lane_pair_check_reads_the_compiled_layout(layout, holds):
    ttgir = _TTGIR.replace("LAYOUT", layout)
    assert triton_common.lane_pair_shuffles_hold(ttgir, triton_common.PAIR_SHUFFLE_ASM) == [holds]
    assert triton_common.lane_pair_shuffles_hold(ttgir, "shfl.sync.idx") == []


def test_plan_stores_by_lane_pairs_only_where_the_compiled_kernel_allows(monkeypatch):
    """Before a plan's first launch the pass-2 kernel is compiled (not run) and its layout read,
    once per compiled kernel; a layout that does not pair lanes turns PAIRS off for the plan."""
    warmups = []

    class Compiled:  # one shuffle per orientation stored, as in the real kernel
        def __init__(self, kw):
            self.hash = repr(sorted(kw.items()))
            layout = PAIRED if kw["GRAN"] == 0 else BYTEWISE
            self.asm = {"ttgir": _TTGIR.replace("LAYOUT", layout) * (int(kw["DO_ROW"]) + int(kw["DO_COL"]))}

    def warmup(*args, grid, **kw):
        warmups.append(kw)
        return Compiled(kw)

    monkeypatch.setattr(oc, "_pack_kernel", SimpleNamespace(warmup=warmup), raising=False)
    monkeypatch.setattr(oc, "interpreting", lambda: False)
    oc._PAIRS_HOLD.clear()

    def plan(gran, hw=True, row=True, col=True):
        return SimpleNamespace(hw=hw, row=row, col=col, grid=(1, 1), options={},
                               meta=dict(GRAN=gran, DO_ROW=row, DO_COL=col, PAIRS=False))

    assert oc._paired_stores_hold(plan(0), ()) is True
    assert warmups[-1]["PASS"] == 2 and warmups[-1]["PAIRS"] is True  # the kernel that would run
    assert oc._paired_stores_hold(plan(0, col=False), ()) is True
    assert oc._paired_stores_hold(plan(32), ()) is False
    n = len(warmups)
    assert oc._paired_stores_hold(plan(0, hw=False), ()) is True  # the emulation swaps by reshaping
    assert oc._paired_stores_hold(plan(0, row=False, col=False), ()) is True  # stores nothing
    assert len(warmups) == n
    oc._PAIRS_HOLD["x"] = True  # a cached answer is reused, not recomputed from the layout
    monkeypatch.setattr(Compiled, "__init__", lambda self, kw: setattr(self, "hash", "x"))
    assert oc._paired_stores_hold(plan(32), ()) is True
    oc._PAIRS_HOLD.clear()


def test_a_bool_flag_and_an_int_flag_do_not_share_a_plan(fake):
    oc.mx_operands_cuda(x_())
    with pytest.raises(ValueError, match="row: expected a bool"):
        oc.mx_operands_cuda(x_(), row=1)


def test_plan_geometry_and_constexprs(fake):
    x = x_(200, 256)
    counter = torch.zeros(1, dtype=torch.int64)
    out = oc.mx_operands_cuda(x, granularity=G.ROWWISE, colsum=True, counter=counter)
    (g1, a1, k1), (g2, a2, k2) = fake.calls
    assert (k1["PASS"], k2["PASS"]) == (1, 2) and g1 == g2
    assert k2 == dict(PASS=2, DO_ROW=True, DO_COL=True, DO_COLSUM=True, GRAN=0, HADAMARD=True, PROLOGUE=0,
                      HW=False, BR=128, NB=2, COAL=True, X_F32=False, PAIRS=True, **triton_common.launch_options(8))
    assert a2[2:7] == (256, 256, 200, 256, 224) and a2[15] == 2 and g2 == (4, min(2, -(-16 // 4)))
    assert a2[0] is x and a2[12] is counter and out.blocks_outside_window is counter
    assert a2[7].data_ptr() == out.row_data.data_ptr() and a2[9].data_ptr() == out.col_data.data_ptr()
    assert a2[11].data_ptr() == out.colsum.data_ptr() and out.colsum.shape == (256,)
    assert out.row_scale.shape == (200, 1) and out.col_scale.shape == (256, 1) and out.col_data.shape == (256, 224)
    # workspace parts on 16-byte boundaries, disjoint: colsum [C], row e_ref [R], col e_ref [C]
    ptrs = sorted((a2[i].data_ptr(), n) for i, n in ((11, 256 * 4), (13, 200 * 4), (14, 256 * 4)))
    assert all(p % 16 == 0 for p, _ in ptrs)
    assert all(p + n <= q for (p, n), (q, _) in zip(ptrs, ptrs[1:]))


def test_no_workspace_zeroing_where_nothing_reads_it(fake, monkeypatch):
    """BLOCKWISE without column sums, counting into the caller's counter: no workspace part at all."""
    zeros = []
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: zeros.append(a) or real(*a, **k))
    counter = real(1, dtype=torch.int64)
    oc.mx_operands_cuda(x_(), granularity=G.BLOCKWISE, counter=counter)
    assert zeros == []
    oc.mx_operands_cuda(x_(), granularity=G.BLOCKWISE)  # this call's count lives in the workspace
    assert len(zeros) == 1


def test_counter_on_another_device_or_dtype_is_added_afterwards(fake):
    counter = torch.full((1,), 3, dtype=torch.int32)
    out = oc.mx_operands_cuda(x_(), counter=counter)
    assert out.blocks_outside_window is counter and int(counter) == 3  # the stand-in kernel counts nothing
    assert fake.calls[-1][1][12] is not counter and fake.calls[-1][1][12].dtype == torch.int64


def test_compiled_launch_passes_what_the_normal_launch_passed(fast):
    counter = torch.zeros(1, dtype=torch.int64)
    x = x_(200, 256)
    first = oc.mx_operands_cuda(x, colsum=True, counter=counter)
    assert len(fast.calls) == 2 and fast.runs == []
    plan = next(iter(op._PLANS.values()))
    assert plan.fast and len(plan.fast) == 2
    out = oc.mx_operands_cuda(x, colsum=True, counter=counter)
    assert len(fast.calls) == 2 and len(fast.runs) == 2  # no normal launch: the compiled launcher ran twice
    for (grid, args, kw), run in zip(fast.calls, fast.runs):
        assert run[:9] == (grid[0], grid[1], 1, 77, 1234, (8, 1, 0), None, None, None)
        got = run[9:]
        assert got[17:] == tuple(kw[k] for k in CONSTEXPRS)
        assert got[2:7] == args[2:7] and got[15:17] == args[15:17]
        assert got[0] == x.data_ptr() and got[1] == x.data_ptr() and got[12] == counter.data_ptr()
        assert got[7] == out.row_data.data_ptr() and got[8] == out.row_scale.data_ptr()
        assert got[9] == out.col_data.data_ptr() and got[10] == out.col_scale.data_ptr()
        assert got[11] == out.colsum.data_ptr()
        # the workspace parts at the same offsets as the normal launch's tensors
        base = args[11].data_ptr()
        assert [got[i] - got[11] for i in (13, 14)] == [args[i].data_ptr() - base for i in (13, 14)]
    assert first.row_data.dtype == out.row_data.dtype == torch.float8_e4m3fn


def test_compiled_launch_steps_aside_for_hooks_and_other_devices(fast, monkeypatch):
    x = x_(64, 128)
    oc.mx_operands_cuda(x, granularity=G.EXACT)
    oc.mx_operands_cuda(x, granularity=G.EXACT)
    assert (len(fast.calls), len(fast.runs)) == (1, 1)
    fast.hooks.launch_enter_hook = SimpleNamespace(calls=[print])  # a profiler's hook: Triton's path
    oc.mx_operands_cuda(x, granularity=G.EXACT)
    assert (len(fast.calls), len(fast.runs)) == (2, 1)
    fast.hooks.launch_enter_hook = SimpleNamespace(calls=[])  # an empty hook chain is idle
    oc.mx_operands_cuda(x, granularity=G.EXACT)
    assert (len(fast.calls), len(fast.runs)) == (2, 2)
    plan = next(iter(op._PLANS.values()))
    monkeypatch.setattr(plan.fast[0], "device", 1)  # the current device is 0
    oc.mx_operands_cuda(x, granularity=G.EXACT)
    assert (len(fast.calls), len(fast.runs)) == (3, 2)


def test_compiled_launch_refuses_a_kernel_it_does_not_understand(fake):
    env = dict(get_stream=lambda dev: 0, hooks=Hooks(), current_device=lambda: 0)
    x = x_(64, 128)
    args = (x, x, 128, 128, 64, 128, 64) + (x,) * 8 + (1, 1)
    kw = dict(zip(CONSTEXPRS, (2, True, True, False, 32, True, 0, True, 128, 2, True, False, True)))

    def launch(compiled, a=args, k=kw):
        return triton_common.compiled_launch(compiled, op.RUNTIME_ARGS, a, k, 0, _env=env)

    assert launch(FakeCompiled(args, kw, [])) is not None
    baked = FakeCompiled(args, kw, [])
    baked.src.constants[(17,)] = 1  # compiled for another pass
    assert launch(baked) is None
    renamed = FakeCompiled(args, kw, [])
    renamed.src.fn.arg_names[2] = "stride"
    assert launch(renamed) is None
    as_int = FakeCompiled(args, kw, [])
    as_int.src.signature["x_ptr"] = "i64"  # a tensor where the kernel takes no pointer
    assert launch(as_int) is None
    one = FakeCompiled(args, kw, [])
    one.src.constants[(4,)] = 1  # R specialised to 1 by the compiler, but 64 here
    assert launch(one) is None
    pending = FakeCompiled(args, kw, [])
    pending.result = lambda: None
    assert launch(pending) is None
    assert launch(object()) is None
    assert launch(FakeCompiled(args, kw, []), k={**kw, "EXTRA": 1}) is None


def test_compiled_launch_off_by_switch_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("MXFLUX_COMPILED_LAUNCH", "0")
    assert not triton_common.compiled_launch_supported()
    assert triton_common.compiled_launch(object(), (), (), {}, 0) is None


def test_the_op_hands_its_counter_to_the_cuda_packer(fake, monkeypatch):
    from mxflux.ops import custom_ops

    monkeypatch.setattr(custom_ops, "use_kernels", lambda t: True)
    counter = torch.zeros(1, dtype=torch.int64)
    x = x_(32, 128)
    outs = custom_ops._mx_operands(x, None, counter, True, False, "blockwise", True, "none", False)
    (grid, args, kw), = fake.calls
    assert args[12] is counter  # the kernels count into it: nothing is added afterwards
    assert kw["GRAN"] == 128 and kw["DO_ROW"] and not kw["DO_COL"]
    assert outs[0].data_ptr() == args[7].data_ptr() and outs[0].dtype == torch.float8_e4m3fn
    assert [t.numel() for t in outs[2:]] == [0, 0, 0] and len(outs) == 5


def test_compiled_launch_calls_the_c_launcher_itself_when_no_scratch_is_needed():
    """Triton 3.6's launcher object only adds scratch buffers (None when their sizes are 0) before
    its C function: with none, that function is called directly with what the object would pass."""
    calls = []

    class Runner:
        global_scratch_size, profile_scratch_size, launch_cooperative_grid, launch_pdl = 0, 0, False, True

        def launch(self, *a):
            calls.append(("c", a))

        def __call__(self, *a):
            calls.append(("py", a))

    runner = Runner()
    compiled = SimpleNamespace(run=runner, function=5, packed_metadata=(4, 1, 0))
    env = dict(get_stream=lambda dev: 9, hooks=Hooks(), current_device=lambda: 0)
    triton_common.CompiledLaunch(compiled, 0, ("K",), **env)((3, 2), (10, 11))
    assert calls == [("c", (3, 2, 1, 9, 5, False, True, None, None, (4, 1, 0), None, None, None, 10, 11, "K"))]
    runner.global_scratch_size = 128  # needs Triton's allocator: the launcher object itself
    triton_common.CompiledLaunch(compiled, 0, ("K",), **env)((3, 2), (10, 11))
    assert calls[-1] == ("py", (3, 2, 1, 9, 5, (4, 1, 0), None, None, None, 10, 11, "K"))


@pytest.mark.parametrize("n_col_tiles, n_row_tiles, resident", [
    (48, 128, 264), (192, 128, 264), (144, 128, 264), (240, 256, 264), (48, 32, 264), (336, 24, 264),
    (1, 1, 264), (500, 3, 264), (2, 1000, 8), (7, 13, 5)])
def test_persistent_grid_minimises_waves_times_tiles_per_program(n_col_tiles, n_row_tiles, resident):
    """Programs per column strip: at least one full wave where the tiles allow, at most 4 waves,
    and among those the fewest (waves x row tiles of the busiest program), the smallest such p."""
    p = op.persistent_row_programs(n_col_tiles, n_row_tiles, resident)
    assert 1 <= p <= n_row_tiles

    def cost(q):
        return -(-n_col_tiles * q // resident) * -(-n_row_tiles // q)

    allowed = [q for q in range(1, n_row_tiles + 1)
               if (n_col_tiles * q >= resident or q == n_row_tiles) and n_col_tiles * (q - 1) < 4 * resident]
    assert p in allowed
    assert cost(p) == min(cost(q) for q in allowed)
    assert p == min(q for q in allowed if cost(q) == cost(p))


def test_persistent_grid_of_the_measured_shapes():
    """The H200 shapes of benchmarks/RESULTS.md (264 resident programs, 128-row tiles, 64-column
    strips): X [16384 x 3072] keeps 11 programs per strip; [16384 x 12288] takes 4 (768 programs, 3
    full waves) instead of the 3 (576, a fifth of a last wave) a fixed 2-wave grid gave; dY
    [16384 x 9216] 7 instead of 4; [32768 x 15360] 2, one full wave at least."""
    assert op.persistent_row_programs(48, 128, 264) == 11
    assert op.persistent_row_programs(192, 128, 264) == 4
    assert op.persistent_row_programs(144, 128, 264) == 7
    assert op.persistent_row_programs(240, 256, 264) == 2
    assert op._grid(192, 128, torch.device("cpu"), 8) == (192, op.persistent_row_programs(192, 128, 8))


@pytest.mark.parametrize("n_regs, warps, shared, expected", [
    (80, 8, 0, 3), (126, 8, 0, 2), (128, 8, 0, 2), (129, 8, 0, 1), (255, 8, 0, 1), (64, 4, 0, 8), (32, 4, 0, 16),
    (80, 8, 100_000, 2), (80, 8, 40_000, 3), (40, 2, 0, 25), (1, 1, 0, 32)])
def test_resident_programs_follows_registers_threads_and_shared_memory(n_regs, warps, shared, expected):
    """Hopper's per-SM limits: 64 K registers allocated per warp in 256s, 2048 threads, 228 KB of
    shared memory with 1 KB reserved per program, 32 programs."""
    assert op.resident_programs(n_regs, warps, shared) == expected


def test_each_pass_gets_a_grid_for_its_own_occupancy(monkeypatch):
    """Before a plan's first GPU launch, each pass is compiled (not run) and its grid sized for the
    programs an SM holds of it: 3 of pass 1 (80 registers), 2 of pass 2 (126)."""
    compiled = {1: SimpleNamespace(n_regs=80, metadata=SimpleNamespace(shared=33_000), hash="p1"),
                2: SimpleNamespace(n_regs=126, metadata=SimpleNamespace(shared=33_000), hash="p2")}
    for c in compiled.values():
        c._init_handles = lambda: None
    warmups = []

    def warmup(*args, grid, PASS, **kw):
        warmups.append((PASS, grid, args[-1]))
        return compiled[PASS]

    monkeypatch.setattr(oc, "_pack_kernel", SimpleNamespace(warmup=warmup), raising=False)
    monkeypatch.setattr(oc, "interpreting", lambda: False)
    monkeypatch.setattr(oc, "num_sms", lambda index: 132)
    monkeypatch.setattr(oc, "_RESIDENT", {})
    # X [16384 x 3072]: 48 column strips of 128 row tiles
    plan = SimpleNamespace(hw=True, device=torch.device("cuda", 0), passes=(1, 2), grid=(48, 11), n_rt=128,
                           options={"num_warps": 8}, meta={}, grids={1: (48, 11), 2: (48, 11)})
    oc._size_grids_per_pass(plan, ("args",) * 16 + (11,))
    assert [w[0] for w in warmups] == [1, 2]
    assert plan.grids == {1: (48, op.persistent_row_programs(48, 128, 3 * 132)),
                          2: (48, op.persistent_row_programs(48, 128, 2 * 132))} == {1: (48, 16), 2: (48, 11)}
    # a single-pass plan (one-pass granularities) or the emulation keeps its grid
    for change in (dict(passes=(2,), grids={2: (48, 11)}), dict(hw=False, grids={1: (48, 11), 2: (48, 11)})):
        other = SimpleNamespace(**(plan.__dict__ | change))
        oc._size_grids_per_pass(other, ("args",) * 17)
        assert other.grids == change["grids"]
