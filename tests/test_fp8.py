"""FP8 GEMMs: quantisation math, the reference, dispatch, the Triton small-M kernel (interpreter),
CuTe DSL compiles for sm_90a / sm_100a (PTX inspected) and, on a GPU, the kernels against float64."""
import pytest
import torch

from engine.formats import fp8
from engine.kernels import fp8_triton
from tests.cute_ptx import SANITIZER, compile_in_subprocess, run_python, run_under_memcheck
from tests.numerics import rel_err

BF16_ROUNDING = 2.5e-3  # bf16 output rounding alone gives ~1.7e-3 relative (8-bit significand)


def e4m3_round_by_hand(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to e4m3 (3 mantissa bits, min normal 2^-6, subnormal step 2^-9), RNE."""
    a = v.abs()
    exp = torch.floor(torch.log2(a.clamp_min(2.0 ** -6))).clamp_min(-6)
    step = 2.0 ** (exp - 3)
    r = torch.round(a / step) * step  # torch.round is round-half-even
    return torch.sign(v) * r.clamp_max(448.0)


# ------------------------------------------------------------------------------ quantisation (CPU)
def test_weight_quantisation_matches_hand_written_reference():
    w = torch.randn(48, 320, dtype=torch.float64) * torch.logspace(-3, 2, 48, dtype=torch.float64)[:, None]
    qw, scale = fp8.quantize_rows_fp8(w)
    assert qw.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (48,)
    amax = w.abs().amax(1).float()
    assert torch.equal(scale, amax / 448.0)
    hand = e4m3_round_by_hand((w.float() / scale[:, None]).double())
    assert torch.equal(qw.double(), hand)
    # Round trip: half an e4m3 ulp relative (2^-4) for normals, half the subnormal step absolutely.
    deq = fp8.dequantize_fp8(qw, scale).double()
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale.double()[:, None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert 0.01 < rel_err(deq, w) < 0.05


def test_per_channel_scales_saturate_each_row_at_448():
    w = torch.randn(16, 256)
    w[3] *= 1000.0
    qw, scale = fp8.quantize_rows_fp8(w)
    assert torch.equal(qw.float().abs().amax(1), torch.full((16,), 448.0))
    # The scaled-up row gets its own scale; the others are untouched by it.
    assert scale[3] > 100 * scale[torch.arange(16) != 3].max()


def test_zero_rows_get_scale_one_and_quantise_to_zero():
    w = torch.randn(8, 128)
    w[[2, 5]] = 0.0
    qw, scale = fp8.quantize_rows_fp8(w)
    assert torch.equal(scale[[2, 5]], torch.ones(2))
    assert (qw[[2, 5]].float() == 0).all()
    assert torch.isfinite(fp8.dequantize_fp8(qw, scale)).all()


def test_saturation_at_448():
    # The quantiser clamps before the cast (a raw cast past 448 is NaN or 448 depending on the
    # backend), so the row maximum lands on exactly +-448 and nothing overflows.
    x = torch.tensor([[3.0e38, -3.0e38, 1.0, 0.0], [1e-30, 448.0, -449.0, 5.0]])
    qx, scale = fp8.quantize_act_fp8(x)
    assert torch.isfinite(qx.float()).all() and torch.isfinite(scale).all()
    assert torch.equal(qx.float()[:, :2], torch.tensor([[448.0, -448.0], [0.0, 448.0 * 448 / 449]]).to(torch.float8_e4m3fn).float())
    assert qx.float()[1, 2] == -448.0


def test_activation_quantisation_is_per_token():
    x = torch.randn(5, 192, dtype=torch.bfloat16) * torch.tensor([1e-2, 1.0, 10.0, 1e3, 0.1])[:, None].bfloat16()
    qx, scale = fp8.quantize_act_fp8(x)
    assert scale.shape == (5,) and torch.equal(scale, x.float().abs().amax(1) / 448.0)
    assert rel_err(fp8.dequantize_fp8(qx, scale), x.float()) < 0.05


# ------------------------------------------------------------------------------ reference and dispatch (CPU)
def test_reference_is_the_product_of_dequantised_operands():
    x, w = torch.randn(7, 256), torch.randn(96, 256)
    qx, xs = fp8.quantize_act_fp8(x)
    qw, ws = fp8.quantize_rows_fp8(w)
    ref64 = fp8.dequantize_fp8(qx, xs).double() @ fp8.dequantize_fp8(qw, ws).double().t()
    out = fp8.fp8_linear_reference(qx, xs, qw, ws, out_dtype=torch.float32)
    assert rel_err(out, ref64) < 1e-6
    # And fp8 quantisation of both operands costs a few percent against the unquantised product.
    assert 0.005 < rel_err(out, x.double() @ w.double().t()) < 0.08


def test_fp8_linear_cpu_paths_agree():
    # fp8_linear takes 2-D x [M, K] (callers flatten tokens).
    x, w = torch.randn(6, 128, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    res = torch.randn(6, 64, dtype=torch.bfloat16)
    qw, ws = fp8.quantize_rows_fp8(w)
    y = fp8.fp8_linear(x, qw, ws, residual=res)
    assert y.shape == (6, 64) and y.dtype == torch.bfloat16
    qx, xs = fp8.quantize_act_fp8(x)
    y_pre = fp8.fp8_linear(qx, qw, ws, residual=res, x_scale=xs)
    assert torch.equal(y, y_pre)
    ref = fp8.fp8_linear_reference(qx, xs, qw, ws, residual=res, out_dtype=torch.float64)
    assert rel_err(y, ref) < BF16_ROUNDING
    with pytest.raises(ValueError, match="x_scale"):
        fp8.fp8_linear(qx, qw, ws)


def test_fp8_weight_backend():
    w = torch.randn(64, 192, dtype=torch.bfloat16)
    b = fp8.Fp8Weight.from_dense(w)
    assert (b.out_features, b.in_features) == (64, 192) and b.name == "fp8"
    assert b.weight_bytes() == 64 * 192 + 64 * 4
    assert b.dequantize().dtype == torch.bfloat16 and rel_err(b.dequantize(), w) < 0.05
    x = torch.randn(5, 192, dtype=torch.bfloat16)
    y = b.forward(x)
    assert y.dtype == torch.bfloat16 and rel_err(y, x.double() @ w.double().t()) < 0.08


# ------------------------------------------------------------------------------ Triton small-M kernel (interpreter)
def test_small_m_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    out = run_python("""
        import torch
        from engine.formats import fp8
        from engine.kernels import fp8_triton
        torch.manual_seed(0)
        for m, n, k, split in [(1, 64, 512, 1), (5, 128, 1024, 2), (16, 64, 576, 1), (16, 100, 1024, 4),
                               (16, 100, 1024, 4)]:
            qx, xs = fp8.quantize_rows_fp8(torch.randn(m, k))
            qw, ws = fp8.quantize_rows_fp8(torch.randn(n, k))
            res = torch.randn(m, n).bfloat16()
            y = torch.full((m, n), float("nan")).bfloat16()
            fp8_triton.fp8_gemm_small_m(qx, xs, qw, ws, residual=res, split=split, out=y)
            ref = fp8.fp8_linear_reference(qx, xs, qw, ws, residual=res, out_dtype=torch.float64)
            print(m, n, k, split, ((y.double() - ref).norm() / ref.norm()).item())
    """, {"TRITON_INTERPRET": "1"}, timeout=240)
    errs = [float(line.split()[-1]) for line in out.strip().splitlines()]
    # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): allow twice the rounding.
    # (The last case repeats the one before it: split-K scratch must be back at zero.)
    assert len(errs) == 5 and all(e < 2 * BF16_ROUNDING for e in errs), out


def test_custom_ops_have_fake_kernels():
    # torch.compile traces the kernels as these ops; their fake kernels give the output metadata.
    pytest.importorskip("cutlass")
    from torch._subclasses.fake_tensor import FakeTensorMode
    import engine.kernels.cute.fp8_gemm_sm90  # noqa: F401  (registers microengine::fp8_gemm_sm90)
    import engine.kernels.fp8_triton  # noqa: F401  (registers microengine::fp8_gemm_small_m)
    with FakeTensorMode():
        qx = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="cuda")
        qw = torch.empty(128, 256, dtype=torch.float8_e4m3fn, device="cuda")
        xs, ws = torch.empty(5, device="cuda"), torch.empty(128, device="cuda")
        for out in (torch.ops.microengine.fp8_gemm_sm90(qx, xs, qw, ws, None, True),
                    torch.ops.microengine.fp8_gemm_small_m(qx, xs, qw, ws)):
            assert out.shape == (5, 128) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


def test_small_m_launch_is_the_streaming_rule_for_one_byte_weights():
    """FP8 weights launch by stream_triton's rule with 1-byte weights: 16 KB stages are 256 deep."""
    pytest.importorskip("triton")
    from engine.kernels.stream_triton import stream_config

    def tile(n, k):
        c = stream_config(n, k, 132, weight_bytes=1)
        return c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_stages"]
    assert tile(28672, 4096) == (64, 256, 1, 4)   # 448 tiles: no split, 4 stages
    assert tile(6144, 4096) == (64, 256, 1, 6)    # 96 tiles: deeper pipeline, still no split
    assert tile(4096, 14336) == (64, 256, 4, 4)   # 64 tiles: split K four ways
    assert tile(4096, 4096) == (64, 256, 2, 4)    # a split keeps 8 tiles of K: 2,048
    assert tile(1024, 4096) == (64, 256, 2, 4)
    assert tile(576, 576) == (64, 64, 1, 6)       # K 576: 64 deep, too shallow to split
    assert tile(1040, 576) == (64, 64, 1, 6)      # 16.25 tiles: the last one's rows past N are clamped


# ------------------------------------------------------------------------------ CuTe DSL compiles (CPU)
COMPILE_SM90 = """
    import sys, time
    from engine.kernels.cute.fp8_gemm_sm90 import Fp8GemmSm90
    for tile, res, fast in [((128, 128), True, False), ((128, 256), False, True)]:
        t = time.time()
        ptx = Fp8GemmSm90(tile, 1024, 512, res, 132, fast).compile().__ptx__
        print("TIME", time.time() - t, file=sys.stderr)
        print("PTX", tile, ptx.count("wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3" % tile[1]),
              ptx.count("setmaxnreg.dec"), ptx.count("setmaxnreg.inc"),
              ptx.count("cp.async.bulk.tensor.2d.shared::cta.global"), ptx.count("stmatrix"))
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("cutlass"), reason="needs nvidia-cutlass-dsl")
def test_sm90_kernel_compiles_to_e4m3_wgmma(tmp_path):
    out = compile_in_subprocess(COMPILE_SM90, "sm_90a", tmp_path)
    lines = [l.split() for l in out.splitlines() if l.startswith("PTX")]
    assert len(lines) == 2
    for fields, batch in zip(lines, (8, 4)):
        wgmma, dec, inc, tma_loads, stmatrix = map(int, fields[-5:])
        # 4 k32 WGMMAs per 128-wide k-tile (8 where the precise mode promotes every 2 k-tiles), a
        # producer/consumer register split, TMA loads of A and B.
        assert wgmma == batch and dec == 1 and inc == 1 and tma_loads >= 2 and stmatrix > 0, fields


COMPILE_SM100 = """
    from engine.kernels.cute.fp8_gemm_sm100 import Fp8GemmSm100
    for cta_group in (1, 2):
        ptx = Fp8GemmSm100(cta_group, 1024, 512, True).compile().__ptx__
        print("PTX", cta_group, ptx.count("tcgen05.mma.cta_group::%d.kind::f8f6f4" % cta_group),
              ptx.count("tcgen05.alloc.cta_group::%d" % cta_group), ptx.count("tcgen05.ld"),
              ptx.count("cp.async.bulk.tensor"))
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("cutlass"), reason="needs nvidia-cutlass-dsl")
def test_sm100_kernel_compiles_to_tcgen05_one_and_two_sm(tmp_path):
    out = compile_in_subprocess(COMPILE_SM100, "sm_100a", tmp_path)
    lines = [l.split() for l in out.splitlines() if l.startswith("PTX")]
    assert [f[1] for f in lines] == ["1", "2"]
    for fields in lines:
        mma, alloc, tmem_ld, tma = map(int, fields[-4:])
        assert mma > 0 and alloc > 0 and tmem_ld > 0 and tma > 0, fields


def test_sm90_shape_checks_and_tile_choice():
    pytest.importorskip("cutlass")
    from engine.kernels.cute import fp8_gemm_sm90 as k
    with pytest.raises(ValueError, match="multiples of 64"):
        k.check_shapes(6144, 4000)
    assert k.choose_tile(8192, 28672, 132) == (128, 128)
    assert k.choose_tile(8192, 28672, 132, fast_accum=True) == (128, 256)
    assert k.choose_tile(1024, 6144, 132) == (128, 128)  # 384 tiles fill waves better than 192
    assert k.choose_tile(128, 6144, 132) == (64, 128)
    assert k.choose_tile(512, 6144, 132) == (128, 128)  # 2 waves of 128-row tiles beat 3 of 64-row ones
    assert k.choose_tile(17, 576, 132) == (64, 64)
    # Promote every 2 k-tiles where K's k-tiles split evenly, else every one (576 = 5 k-tiles).
    assert [k.choose_promote_every(kk) for kk in (4096, 14336, 576, 1536)] == [2, 2, 1, 2]
    with pytest.raises(ValueError, match="promote_every=3"):
        k.Fp8GemmSm90((128, 128), 1024, 4096, False, 132, promote_every=3)


def test_activation_storage_holds_whole_tiles_of_rows():
    """FP8 activations are allocated with rows rounded up to 128, and the GEMMs describe A to TMA
    with whole tiles of rows only where the storage holds them."""
    from engine.kernels.cute.common import tma_rows
    from engine.kernels.platform import ACTIVATION_ROW_ALIGN, activation_empty, storage_rows
    assert ACTIVATION_ROW_ALIGN == 128
    for m, rows in [(1, 128), (127, 128), (128, 128), (129, 256), (300, 384)]:
        t = activation_empty(m, 64, torch.float8_e4m3fn, "cpu")
        assert t.shape == (m, 64) and t.is_contiguous() and storage_rows(t) == rows
        assert tma_rows(t, 64) == -(-m // 64) * 64 and tma_rows(t, 128) == rows
    tight = torch.empty(160, 64, dtype=torch.float8_e4m3fn)
    assert storage_rows(tight) == tma_rows(tight, 128) == 160
    big = torch.empty(10, 64)
    assert storage_rows(big[:3]) == 10 and storage_rows(big[2:5]) == 8
    assert storage_rows(big[:, :32]) == 10          # a column slice: rows 64 apart, 32 wide
    assert storage_rows(big.t()) == 64              # not row-major: its own rows only
    assert storage_rows(big[:0]) == 0


# ------------------------------------------------------------------------------ GPU
LLAMA_NK = [(6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096)]


def gpu_operands(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * (1 + 3 * torch.rand(m, 1, device="cuda", generator=g))
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    qx, xs = fp8.quantize_act_fp8(x.bfloat16())
    qw, ws = fp8.quantize_rows_fp8(w)
    return qx, xs, qw, ws


FAST_ACCUM_BOUND = 6e-3  # Hopper fp8 WGMMA's reduced-precision sums: 2.1e-3 at K=4096, 3.3e-3 at K=14336


def check_kernel(run, qx, xs, qw, ws, residual, bound=BF16_ROUNDING):
    m, n = qx.shape[0], qw.shape[0]
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    run(out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{out.isnan().sum().item()} outputs unwritten or NaN"
    ref = (qx.double() @ qw.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    if residual is not None:
        ref += residual.double()
    err = rel_err(out, ref)
    assert err < bound, err
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 64, 127, 129, 1000, 4097, 9000])
def test_sm90_kernel_matches_float64(m):
    from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
    shapes = LLAMA_NK if m < 4000 else [LLAMA_NK[m % 3]]
    for j, (n, k) in enumerate(shapes):
        qx, xs, qw, ws = gpu_operands(m, n, k, seed=m * 10 + j)
        res = torch.randn(m, n, device="cuda").bfloat16() if j % 2 else None
        check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, res, out=out), qx, xs, qw, ws, res)


@pytest.mark.gpu
def test_sm90_every_tile_both_accumulation_modes_and_residual():
    from engine.kernels.cute.fp8_gemm_sm90 import PRECISE_TILES, TILES, fp8_gemm_sm90
    m, n, k = 333, 1024, 4096
    qx, xs, qw, ws = gpu_operands(m, n, k, seed=7)
    res = torch.randn(m, n, device="cuda").bfloat16()
    for fast, tiles, bound in [(False, PRECISE_TILES, BF16_ROUNDING), (True, TILES, FAST_ACCUM_BOUND)]:
        for tile in tiles:
            for r in (None, res):
                check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, r, tile_mn=tile, out=out,
                                                       fast_accum=fast), qx, xs, qw, ws, r, bound)


@pytest.mark.gpu
def test_sm90_every_tile_order():
    # Grouped tile orders visit every output tile exactly once (poisoned output fully written), for
    # M not a multiple of the tile and more row-blocks than SMs' worth of tiles per group.
    from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
    m, n, k = 2000, 2048, 512
    qx, xs, qw, ws = gpu_operands(m, n, k, seed=11)
    for swizzle in (1, 2, 4, 8, 16):
        check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=(128, 128), out=out, swizzle=swizzle),
                     qx, xs, qw, ws, None)
    with pytest.raises(ValueError, match="does not divide"):
        fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=(128, 128), swizzle=3)


@pytest.mark.gpu
def test_sm90_every_promotion_interval():
    # Promoting every 1, 2 or 4 k-tiles: every output written, error within bf16 rounding (the
    # benchmark's accuracy table gives each interval's error), M and N with tails.
    from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
    for m, n, k in [(1100, 1024, 4096), (300, 4096, 14336)]:
        qx, xs, qw, ws = gpu_operands(m, n, k, seed=k)
        res = torch.randn(m, n, device="cuda").bfloat16()
        for p in (1, 2, 4):
            for r in (None, res):
                check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, r, tile_mn=(128, 128), out=out,
                                                       promote_every=p), qx, xs, qw, ws, r)
    with pytest.raises(ValueError, match="promote_every=3"):
        fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=(128, 128), promote_every=3)


@pytest.mark.gpu
def test_sm90_reads_whole_tiles_of_padded_activations():
    """A's rows past M, read where the storage holds them (whatever they hold: here e4m3 NaN codes),
    change no output bit: the same GEMM on a copy of A with tight storage gives the same result."""
    from engine.kernels.cute.common import tma_rows
    from engine.kernels.cute.fp8_gemm_sm90 import PRECISE_TILES, fp8_gemm_sm90
    from engine.kernels.platform import activation_empty, storage_rows
    n, k = 1024, 4096
    for m in (136, 160, 224, 320):
        made, xs, qw, ws = gpu_operands(m, n, k, seed=m)
        tight = made.clone()                             # storage of exactly M rows
        qx = activation_empty(m, k, torch.float8_e4m3fn, "cuda")
        qx.as_strided((storage_rows(qx), k), (k, 1)).view(torch.uint8).fill_(0x7F)     # NaN codes in every row
        qx.copy_(made)
        for tile in PRECISE_TILES:
            assert tma_rows(qx, tile[0]) == -(-m // tile[0]) * tile[0] and tma_rows(tight, tile[0]) == m
            check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=tile, out=out), qx, xs, qw, ws, None)
            a = fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=tile)
            b = fp8_gemm_sm90(tight, xs, qw, ws, tile_mn=tile)
            assert torch.equal(a, b), (m, tile)


@pytest.mark.gpu
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer (the CUDA toolkit)")
def test_fp8_gemms_read_nothing_past_their_operands():
    """M ending inside a tile, with a residual: the sm90 kernel's 64- and 128-row tiles and the
    streaming kernel (split K; also with N ending inside a row tile) under memcheck, each tensor its
    own allocation. A is read in whole tiles where its storage holds them (activation_empty); the
    scales and the residual hold M rows only, so the epilogue must clamp its loads to M, not to
    A's tiles."""
    run_under_memcheck("""
        import torch
        from engine.formats import fp8
        from engine.kernels import fp8_triton
        from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
        from engine.kernels.stream_triton import stream_config
        for m, n, k, tile in [(17, 4096, 4096, (64, 128)), (129, 1024, 4096, (128, 128)), (5, 4096, 4096, None),
                              (3, 1000, 4096, None)]:
            qx, xs = fp8.quantize_act_fp8(torch.randn(m, k, device="cuda").bfloat16())
            qw, ws = fp8.quantize_rows_fp8(torch.randn(n, k, device="cuda") * 0.02)
            res = torch.randn(m, n, device="cuda").bfloat16()
            if tile is None:
                assert stream_config(n, k, 132, weight_bytes=1)["SPLIT_K"] > 1
                fp8_triton.fp8_gemm_small_m(qx, xs, qw, ws, res)
            else:
                fp8_gemm_sm90(qx, xs, qw, ws, res, tile_mn=tile)
            torch.cuda.synchronize()
        """)


@pytest.mark.gpu
def test_fp8_activations_come_padded():
    """Every producer of the GEMMs' e4m3 activations allocates whole tiles of rows."""
    from engine.kernels.norms import rms_norm
    from engine.kernels.platform import storage_rows
    from engine.kernels.swiglu import swiglu
    x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    made = [fp8.quantize_act_fp8(x)[0], rms_norm(x, w, 1e-5, quant="fp8")[0], swiglu(x, quant="fp8")[0],
            rms_norm(x, w, 1e-5, residual=x.clone(), quant="fp8")[0][0]]
    assert [storage_rows(q) for q in made] == [256] * 4


@pytest.mark.gpu
def test_sm90_compiles_once_for_every_m():
    from engine.kernels.cute import fp8_gemm_sm90 as sm90
    n, k = 512, 1024
    qw, ws = fp8.quantize_rows_fp8(torch.randn(n, k, device="cuda"))
    sm90.fp8_gemm_sm90(*fp8.quantize_act_fp8(torch.randn(40, k, device="cuda")), qw, ws, tile_mn=(64, 128))
    compiled = len(sm90._cache)
    for m in (17, 300, 1111, 5000):
        qx, xs = fp8.quantize_act_fp8(torch.randn(m, k, device="cuda"))
        check_kernel(lambda out: sm90.fp8_gemm_sm90(qx, xs, qw, ws, tile_mn=(64, 128), out=out), qx, xs, qw, ws, None)
    assert len(sm90._cache) == compiled


@pytest.mark.gpu
def test_sm90_small_model_shapes():
    # SmolLM2-135M: hidden 576 (K not a multiple of 128), kv 192, FFN 1536.
    from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
    for m, n, k in [(300, 576, 576), (65, 192, 576), (200, 576, 1536), (129, 1536, 576)]:
        qx, xs, qw, ws = gpu_operands(m, n, k, seed=m)
        check_kernel(lambda out: fp8_gemm_sm90(qx, xs, qw, ws, out=out), qx, xs, qw, ws, None)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_small_m_kernel_matches_float64(m):
    for j, (n, k) in enumerate(LLAMA_NK[:3] + [(576, 576), (1000, 4096)]):   # N = 1000: a partial row tile
        qx, xs, qw, ws = gpu_operands(m, n, k, seed=100 + m * 10 + j)
        res = torch.randn(m, n, device="cuda").bfloat16() if j % 2 else None
        # Each split twice: the split-K accumulator and counters must be back at zero.
        for split in (None, 2, 2, 4, 4, 8) if k % 2048 == 0 else (None,):
            check_kernel(lambda out: fp8_triton.fp8_gemm_small_m(qx, xs, qw, ws, res, split=split, out=out),
                         qx, xs, qw, ws, res)


@pytest.mark.gpu
def test_quantize_act_triton_matches_reference():
    x = torch.randn(37, 14336, device="cuda", dtype=torch.bfloat16) * 3
    x[5] = 0
    q, s = fp8.quantize_act_fp8(x)
    q_ref, s_ref = fp8.quantize_rows_fp8(x)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 200, 2048])
def test_fp8_linear_dispatch_on_gpu(m):
    n, k = 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    layer = fp8.Fp8Weight.from_dense(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = layer.forward(x, residual=res)
    qx, xs = fp8.quantize_rows_fp8(x)
    ref = fp8.fp8_linear_reference(qx, xs, layer.qweight, layer.scale, residual=res, out_dtype=torch.float64)
    assert y.dtype == torch.bfloat16 and not y.isnan().any() and rel_err(y, ref) < BF16_ROUNDING
