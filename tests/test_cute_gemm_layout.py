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

from mxflux.kernels.cute_rowwise_gemm import (  # noqa: E402
    RowScaledFP8Gemm, accumulator_coordinates, accumulator_offsets, accumulator_register)

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
def _coordinates_by_part(tile_n: cutlass.Constexpr, parts: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Each listed MMA thread's accumulator coordinates in a 128 x `tile_n` C, as the kernel's whole-tile MMA
    holds them, and as its MMA over a part of N (`promotion_parts`: tiler N / parts) holds those of each part."""
    def tiled(n):
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (2, 1, 1), tiler_mn=(64, n))
    whole, part = tiled(tile_n), tiled(tile_n // parts)
    for t in cutlass.range_constexpr(len(threads)):
        coords = accumulator_coordinates(whole, threads[t], (128, tile_n, 1), (128, tile_n))
        tile = coords[(None, None, None, 0, 0, 0)]
        mine = [tuple(int(x) for x in tile[i]) for i in range(cute.size(tile))]
        by_part = []
        coords = accumulator_coordinates(part, threads[t], (128, tile_n, 1), (128, tile_n // parts))
        for p in cutlass.range_constexpr(parts):
            tile = coords[(None, None, None, 0, p, 0)]
            by_part.append([tuple(int(x) for x in tile[i]) for i in range(cute.size(tile))])
        FOUND[threads[t]] = (mine, by_part)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_the_partial_tiles_of_each_part_line_up_with_the_accumulators(parts):
    """`promotion_parts` adds register i of part p's partial tile into accumulator register
    `accumulator_register(p, i, 96 / parts)`: for every MMA thread that must be the same element of C, as the two
    tiled MMAs lay their registers out."""
    threads = tuple(range(256))
    FOUND.clear()
    _coordinates_by_part(192, parts, threads)
    size = 96 // parts
    for t in threads:
        whole, by_part = FOUND[t]
        assert len(whole) == 96 and [len(c) for c in by_part] == [size] * parts
        for p, coords in enumerate(by_part):
            assert [whole[accumulator_register(p, i, size)] for i in range(size)] == coords, (t, p)


@pytest.mark.parametrize("tile", [(128, 192), (128, 256)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_each_register_lies_where_the_block_scales_look_for_it(tile):
    """`block_scale_columns` picks each register's scales when compiling: its row and column relative to register 0
    (`accumulator_offsets`), and its group of 64 columns as register 0's group plus the offset's (the thread's
    columns start within 8 of a multiple of 8, the tile on a multiple of 64). Every MMA thread, every register."""
    tm, tn = tile
    threads = tuple(range(256 if tn > 128 else 128))
    FOUND.clear()
    _coordinates(tm, tn, threads)
    for t in threads:
        (m0, n0, _), coords = FOUND[t][0], FOUND[t]
        assert [(m - m0, n - n0) for m, n, _ in coords] == [accumulator_offsets(i) for i in range(len(coords))], t
        assert [n // 64 for _, n, _ in coords] == [n0 // 64 + accumulator_offsets(i)[1] // 64
                                                   for i in range(len(coords))], t


def test_block_scales_are_refused_where_the_promotion_cannot_apply_them():
    """The block scales enter at each k-tile's promotion, so they need fp32 accumulation promoted every k-tile in
    one part, a tile N of whole column groups, and one WGMMA tile a warp group (`accumulator_offsets`: a 128x128
    tile's one warp group holds two, its registers 64 on rows 64 further down)."""
    def gemm(tile_n=192, fp32=True, k_tiles=1, parts=1, scales=64):
        return RowScaledFP8Gemm(cutlass.Float32, (128, tile_n), (2, 1), 8, True, fp32, k_tiles, parts, scales)

    assert gemm().block_scale_columns == 64 and gemm(scales=1).block_scale_columns == 1
    for bad in (dict(scales=12), dict(scales=256), dict(fp32=False), dict(k_tiles=2), dict(parts=2), dict(tile_n=160),
                dict(tile_n=128)):
        with pytest.raises(ValueError, match="block_scale_columns"):
            gemm(**bad)
