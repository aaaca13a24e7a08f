"""The CuTe-DSL row-scaled GEMM's epilogue coordinates, checked on the CPU through CuTe DSL's layout algebra
(runs where nvidia-cutlass-dsl is installed: `make test-cute`; skipped otherwise, as in CI).

Its first GPU run failed the contract test because every thread of a warp group read its first thread's
scales; these tests fail the same way if `accumulator_coordinates` partitions by the warp group's slice."""

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (make test-cute)")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cutlass_dsl import BaseDSL  # noqa: E402

from mxflux.kernels.cute_rowwise_gemm import accumulator_coordinates, accumulator_register  # noqa: E402

FOUND: dict = {}


@pytest.fixture(autouse=True)
def _hopper():
    """WGMMA's layouts are built for sm_90a only; the DSL reads its target when first imported (another
    test file may have imported it), so set it on the DSL itself and restore it after."""
    envar = BaseDSL._get_dsl().envar
    envar.arch = "sm_90a"
    yield
    del envar.arch  # back to CUTE_DSL_ARCH or detection


@cute.jit
def _coordinates(tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Each listed MMA thread's accumulator coordinates in tile (1, 1) of a 2x2-tile C, as the kernel builds
    its tiled MMA (E4M3 K-major operands, fp32 accumulator, two warp groups along M for 128x256)."""
    atom = (2, 1, 1) if tile_m > 64 and tile_n > 128 else (1, 1, 1)
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
        cutlass.Float32, atom, tiler_mn=(64, tile_n))
    for t in cutlass.range_constexpr(len(threads)):
        coords = accumulator_coordinates(tiled_mma, threads[t], (tile_m * 2, tile_n * 2, 1), (tile_m, tile_n))
        tile = coords[(None, None, None, 1, 1, 0)]
        mine = []
        for i in cutlass.range_constexpr(cute.size(tile)):
            mine.append(tuple(int(x) for x in tile[i]))
        FOUND[threads[t]] = mine


@pytest.mark.parametrize("tile", [(128, 256), (128, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_the_mma_threads_hold_each_element_of_a_tile_once(tile):
    tm, tn = tile
    threads = tuple(range(256 if tn > 128 else 128))
    FOUND.clear()
    _coordinates(tm, tn, threads)
    held = [c for t in threads for c in FOUND[t]]
    assert len(held) == tm * tn
    assert set(held) == {(m, n, 0) for m in range(tm, 2 * tm) for n in range(tn, 2 * tn)}


def test_each_thread_starts_where_wgmma_puts_its_accumulator():
    """WGMMA's accumulator layout: lane l of warp w holds rows 16w + l/4 (and + 8), columns 2(l % 4) (and + 1)
    of each 8 columns; the second warp group the next 64 rows."""
    FOUND.clear()
    _coordinates(128, 256, (0, 1, 4, 32, 128))
    first = {t: FOUND[t][:4] for t in FOUND}
    at = lambda m, n: [(128 + m, 256 + n, 0), (128 + m, 257 + n, 0), (136 + m, 256 + n, 0), (136 + m, 257 + n, 0)]  # noqa: E731
    assert first == {0: at(0, 0), 1: at(0, 2), 4: at(1, 0), 32: at(16, 0), 128: at(64, 0)}


@cute.jit
def _coordinates_by_half(tile_n: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Each listed MMA thread's accumulator coordinates in a 128 x `tile_n` C, as the kernel's whole-tile MMA
    holds them, and as its half-tile MMA (`promotion_halves`: tiler N / 2) holds those of each half."""
    def tiled(n):
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (2, 1, 1), tiler_mn=(64, n))
    whole, half = tiled(tile_n), tiled(tile_n // 2)
    for t in cutlass.range_constexpr(len(threads)):
        mine = []
        coords = accumulator_coordinates(whole, threads[t], (128, tile_n, 1), (128, tile_n))
        tile = coords[(None, None, None, 0, 0, 0)]
        for i in cutlass.range_constexpr(cute.size(tile)):
            mine.append(tuple(int(x) for x in tile[i]))
        halves = []
        coords = accumulator_coordinates(half, threads[t], (128, tile_n, 1), (128, tile_n // 2))
        for h in cutlass.range_constexpr(2):
            tile = coords[(None, None, None, 0, h, 0)]
            halves.append([tuple(int(x) for x in tile[i]) for i in range(cute.size(tile))])
        FOUND[threads[t]] = (mine, halves)


def test_the_half_tile_partials_line_up_with_the_accumulators_halves():
    """`promotion_halves` adds register i of half h's partial tile into accumulator register h * size(half) + i:
    for every MMA thread that must be the same element of C, as the two tiled MMAs lay their registers out."""
    threads = tuple(range(256))
    FOUND.clear()
    _coordinates_by_half(192, threads)
    for t in threads:
        whole, halves = FOUND[t]
        assert len(whole) == 96 and [len(h) for h in halves] == [48, 48]
        for h, coords in enumerate(halves):
            assert [whole[accumulator_register(h, i, 48)] for i in range(48)] == coords, (t, h)
