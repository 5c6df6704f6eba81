"""2:4 sparsity: pruning, compression, the Triton kernel (CPU interpreter), backends, kernel
selection, and on the GPU every sparse kernel against the dense product of the pruned weights."""

import itertools
import re

import pytest
import torch

from engine.formats import format_class
from engine.formats import sparse24 as s24
from engine.formats.fp8 import quantize_act_fp8, quantize_rows_fp8
from engine.kernels.norms import rms_norm
from engine.kernels.select import Problem, clear_cache, m_bucket, runnable, select
from engine.linear import Linear
from tests.numerics import rel_err

interpreter = pytest.mark.interpreter   # CPU tensors through the Triton interpreter


def fp64_ref(x, w):
    return x.double() @ w.double().t()


# ----------------------------------------------------------------------------- pruning / storage

def test_prune_keeps_exactly_two_largest_per_group():
    w = torch.randn(24, 64)
    p = s24.prune_24(w)
    groups, kept = w.reshape(24, 16, 4), p.reshape(24, 16, 4)
    assert ((kept != 0).sum(-1) == 2).all()
    top2 = groups.abs().topk(2, dim=-1).indices.sort(-1).values
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top2, True)
    assert torch.equal(kept, groups * mask)


def test_prune_with_score_and_deterministic_ties():
    w = torch.randn(8, 32)
    score = torch.rand(8, 32)
    p = s24.prune_24(w, score)
    top2 = score.reshape(8, 8, 4).topk(2, dim=-1).indices
    kept = torch.zeros(8, 8, 4, dtype=torch.bool).scatter_(-1, top2, True).reshape(8, 32)
    assert torch.equal(p, w * kept)
    # All four scores equal: the two lowest positions win, every time.
    tied = s24.prune_24(torch.randn(4, 16), torch.ones(4, 16))
    assert ((tied.reshape(4, 4, 4)[..., 2:] == 0).all() and (tied.reshape(4, 4, 4)[..., :2] != 0).all())


def test_wanda_score_weights_by_activation_norm():
    w = torch.randn(6, 16)
    act = torch.rand(16) + 0.1
    assert torch.allclose(s24.wanda_score(w, act), w.abs() * act[None, :])
    # A channel with a huge activation norm survives even with a small weight.
    w = torch.tensor([[0.1, 1.0, 2.0, 3.0]])
    kept = s24.prune_24(w, s24.wanda_score(w, torch.tensor([100.0, 1.0, 1.0, 1.0])))
    assert kept[0, 0] != 0 and kept[0, 1] == 0 and kept[0, 2] == 0 and kept[0, 3] != 0


def test_already_24_checkpoint_kept_exactly():
    w = s24.prune_24(torch.randn(16, 64))
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # fewer than 2 nonzeros is still 2:4
    assert s24.is_24_sparse(w) and not s24.is_24_sparse(torch.randn(16, 64))
    assert torch.equal(s24.Sparse24Weight.from_dense(w).dequantize(), w)
    # Even with an activation-aware score, the checkpoint's own pattern is kept.
    assert torch.equal(s24.Sparse24Weight.from_dense(w, score=torch.rand_like(w)).dequantize(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_decompress_exact(dtype):
    w = s24.prune_24(torch.randn(32, 128, dtype=dtype))
    w[3, 8:12] = 0  # an all-zero group
    t = s24.compress_24(w)
    assert t.values.shape == (32, 64) and t.meta.shape == (32, 16) and t.meta.dtype == torch.uint8
    assert torch.equal(s24.decompress_24(t), w)
    assert t.nbytes() == w.numel() // 2 * w.element_size() + w.numel() // 8
    with pytest.raises(ValueError):
        s24.compress_24(torch.randn(4, 16))


# ----------------------------------------------------------------------------- Triton kernel (interpreter)

def _cfg(tile):
    """A launch tuple of the Triton MMA kernel for the interpreter tests: (BLOCK_M,) + (BLOCK_N,
    BLOCK_K, SPLIT_K) + (warps, stages) + (CH groups per thread and chunk, PTX_PACK)."""
    return (16,) + tile + (4, 1) + (min(8, tile[1] // 16), 16)


def _mma_gemm(x, values, meta, scale, config, out=None):
    from engine.kernels.sparse24_triton import mma_gemm
    if out is None:
        out = torch.empty(x.shape[0], values.shape[0], dtype=x.dtype, device=x.device)
    return mma_gemm(x, values, meta, scale, config, out)


@interpreter
@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 128, (16, 64, 1)),
    (5, 40, 200, (32, 128, 1)),  # tails in N and K
    (19, 32, 128, (16, 64, 2)),  # two M tiles, split-K
])
def test_decode_kernel_interpreter(m, n, k, tile):
    cfg = _cfg(tile)
    w = s24.prune_24(torch.randn(n, k, dtype=torch.bfloat16))
    t = s24.compress_24(w)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    y = _mma_gemm(x, t.values, t.meta, None, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert rel_err(y, fp64_ref(x, w)) < 8e-3


@interpreter
def test_decode_kernel_fp8_values_interpreter():
    w = s24.prune_24(torch.randn(32, 128))
    t = s24.compress_24(w)
    q, scale = quantize_rows_fp8(t.values)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    cfg = _cfg((16, 64, 1))
    y = _mma_gemm(x, q, t.meta, scale, cfg)
    w8 = s24.decompress_24(s24.Sparse24Tensor(q, t.meta, t.shape), torch.float32) * scale[:, None]
    assert rel_err(y, fp64_ref(x, w8)) < 8e-3


def _run_ptx(src: str, regs: dict) -> dict:
    """Execute the straight-line PTX of sparse24_triton._DECODE_PTX on 32-bit Python integers."""
    r = dict(regs)

    def val(o):
        return r[o] if o in r else int(o, 0)
    for line in src.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        d, *a = [s.strip() for s in rest.split(",")]
        if op == "mov.b32":
            r[d] = val(a[0])
        elif op == "shl.b32":
            r[d] = (val(a[0]) << val(a[1])) & 0xFFFFFFFF if val(a[1]) < 32 else 0
        elif op == "shr.b32":
            r[d] = val(a[0]) >> val(a[1])
        elif op == "and.b32":
            r[d] = val(a[0]) & val(a[1])
        elif op == "add.u32":
            r[d] = (val(a[0]) + val(a[1])) & 0xFFFFFFFF
        elif op == "sub.u32":
            r[d] = (val(a[0]) - val(a[1])) & 0xFFFFFFFF
        elif op == "prmt.b32":  # default mode: selector nibble = byte index of {b, a}, bit 3 = sign replicate
            src8 = val(a[0]).to_bytes(4, "little") + val(a[1]).to_bytes(4, "little")
            out = 0
            for i in range(4):
                sel = (val(a[2]) >> (4 * i)) & 15
                byte = src8[sel & 7]
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
            r[d] = out
        else:
            raise AssertionError(f"unmodelled instruction {op}")
    return r


@pytest.mark.parametrize("pack", [8, 16])
@pytest.mark.parametrize("i0,i1", [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)])
def test_mma_decode_ptx_places_each_value(i0, i1, pack):
    """The MMA kernel's prmt decode, instruction by instruction: for each row and k16 step of a
    fragment, the kept values land at their positions of the A registers (positions 0, 1 in
    register r8 + 4b, 2, 3 in r8 + 2 + 4b) and the others are zero. pack = 16 takes the meta
    byte (step b's nibble at bit 4b), pack = 8 the nibble."""
    from engine.kernels.sparse24_triton import _decode_ptx
    g = torch.Generator().manual_seed(i0 * 4 + i1 + pack)
    n_out = pack // 2
    for b in range(pack // 8):
        for r8 in (0, 1):
            v0, v1 = (int(v) for v in torch.randint(1, 1 << 16, (2,), generator=g))
            regs = {f"${j}": int(torch.randint(0, 1 << 31, (), generator=g)) for j in range(3 * n_out + pack)}
            e = 2 * r8 + 8 * b
            other = int(torch.randint(0, 16, (), generator=g))  # the other step's nibble
            regs[f"${n_out + e}"] = v0 | v1 << 16
            nib = i0 | i1 << 2
            regs[f"${n_out + pack + e}"] = nib if pack == 8 else (other << 4 | nib if b == 0 else nib << 4 | other)
            r = _run_ptx(_decode_ptx(pack), regs)
            dense = [0] * 4
            dense[i0], dense[i1] = v0, v1
            lo, hi = r[f"${r8 + 4 * b}"], r[f"${r8 + 2 + 4 * b}"]
            assert [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16] == dense


# ----------------------------------------------------------------------------- backends (CPU reference path)

@pytest.mark.parametrize("fmt", ["2:4", "2:4+fp8"])
def test_backend_forward_matches_pruned_dense(fmt):
    lin = Linear(96, 40, dtype=torch.bfloat16)
    lin.weight.data.copy_(torch.randn(40, 96))
    pruned = s24.prune_24(lin.weight.data)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    lin.convert(fmt)
    assert isinstance(lin.backend, format_class(fmt))
    with pytest.raises(RuntimeError, match="dequantize"):  # the dense copy is gone
        lin.weight
    w = lin.backend.dequantize()
    assert s24.is_24_sparse(w) and torch.equal(w != 0, pruned != 0)
    assert rel_err(w, pruned) < (1e-9 if fmt == "2:4" else 0.04)  # fp8: e4m3 has a 3-bit mantissa
    assert rel_err(lin(x).reshape(6, 40), fp64_ref(x.reshape(6, 96), w)) < 8e-3
    dense_bytes = 40 * 96 * 2
    assert lin.backend.weight_bytes() == (dense_bytes * 9 // 16 if fmt == "2:4" else dense_bytes * 5 // 16 + 40 * 4)


def test_fp8_backend_takes_quantised_activations_without_torchao():
    # On the CPU (no torchao kernel) the backend asks for bf16 activations, and an e4m3 activation
    # handed to it anyway is dequantised first.
    w = s24.prune_24(torch.randn(40, 96))
    f = s24.Sparse24Fp8Weight.from_dense(w)
    assert f.input_quant(5) is None
    qx, xs = quantize_rows_fp8(torch.randn(5, 96))
    x = (qx.float() * xs[:, None]).to(torch.float32)
    assert rel_err(f.forward(qx, x_scale=xs), fp64_ref(x, f.dequantize().float())) < 8e-3


def test_backend_wanda_score_through_convert():
    lin = Linear(16, 8, dtype=torch.float32)
    lin.weight.data.copy_(torch.randn(8, 16))
    act = torch.rand(16) * 10
    expected = s24.prune_24(lin.weight.data.clone(), s24.wanda_score(lin.weight.data, act))
    lin.convert("2:4", score=s24.wanda_score(lin.weight.data, act))
    assert torch.equal(lin.backend.dequantize(), expected)


# ----------------------------------------------------------------------------- GPU

def _gpu_case(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = s24.prune_24(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    return w, x


GPU_SHAPES = [(1, 4096, 1024), (7, 1000, 512), (16, 2048, 4096), (33, 1536, 576), (130, 512, 1024),
              (4097, 512, 256), (9000, 256, 512)]


def _triton_configs(m):
    """The Triton kernel's launch configurations for M's bucket (what the tuner times)."""
    return s24.TRITON_CONFIGS[min(max(m_bucket(m), 16), 128)]


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9


def _gluon_runs(m, x, t, scale=None):
    """Every Gluon sparse-MMA configuration of M's bucket that takes these operands (sm_90, M <= 16),
    launched, each into its own output poisoned first: [(config, output)]."""
    from engine.kernels import sparse24_gluon as sp
    if not _sm90() or m > 16:
        return []
    results = []
    for cfg in s24.GLUON_CONFIGS[m_bucket(m)]:
        if sp.unsupported(x, t.values, cfg) is not None:
            continue
        o = torch.full((m, t.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        results.append((cfg, sp.launch(x, t.values, sp.mma_order_meta(t.meta, cfg[3]), scale, cfg, o)))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 1024), (3, 2048, 1024), (7, 1000, 520), (16, 1000, 4096),
                                   (20, 768, 1032), (33, 1536, 576), (60, 1024, 1024), (130, 512, 1024)])
def test_gpu_decode_kernel_all_configs(m, n, k):
    w, x = _gpu_case(m, n, k, m * 7 + n)
    t = s24.compress_24(w)
    ref = fp64_ref(x, w)
    for cfg in _triton_configs(m):
        y = _mma_gemm(x, t.values, t.meta, None, cfg)
        torch.cuda.synchronize()
        assert rel_err(y, ref) < 8e-3, cfg
    for cfg, y in _gluon_runs(m, x, t):
        torch.cuda.synchronize()
        assert rel_err(y, ref) < 8e-3, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_gpu_sparse_mma_kernel(m):
    # The candidates of M's bucket at the Llama-3.1-8B shapes (an N tail on the first), other
    # tilings on small N tails and K down to a few steps per warp, with and without a per-row
    # scale; outputs poisoned first. The metadata layout (two threads per quad, four groups of
    # both rows each, `mma_order_meta`) is what these products check.
    from engine.kernels import sparse24_gluon as sp
    if not _sm90():
        pytest.skip("sm_90 kernel")
    bucket = s24.GLUON_CONFIGS[m_bucket(m)]
    others = [("sp", 16, 64, 2, 2, 8, 2), ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 256, 8, 1, 16, 1)]
    cases = [(777, 4096, bucket, (None,)), (4096, 14336, bucket, (None,)),
             (48, 512, others, (None, "scale")), (1000, 1024, others[:1] + bucket[:1], (None, "scale"))]
    for n, k, cfgs, scales in cases:
        w, x = _gpu_case(m, n, k, 5 * m + n)
        t = s24.compress_24(w)
        for cfg in cfgs:
            assert sp.unsupported(x, t.values, cfg) is None, cfg
            for sc in scales:
                sc = None if sc is None else torch.rand(n, device="cuda") + 0.5
                ref = fp64_ref(x, w if sc is None else w.double() * sc.double()[:, None])
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                sp.launch(x, t.values, sp.mma_order_meta(t.meta, cfg[3]), sc, cfg, out)
                torch.cuda.synchronize()
                assert not torch.isnan(out).any(), cfg
                assert rel_err(out, ref) < 8e-3, (cfg, n, k)
    # Through the backend (selection) every candidate of the bucket runs the sparse kernel itself:
    # the default and each tuned configuration select it, with the weight's MMA-order metadata.
    w, x = _gpu_case(m, 1000, 1024, 3)
    b = s24.Sparse24Weight.from_dense(w)
    assert all(getattr(b, f"meta_mma_{wpt}") is not None for wpt in s24.MMA_ORDER_WPTS)
    ref = fp64_ref(x, w)
    problem = b._problem(b.op, x)
    assert select(b.table, problem).kernel is s24.GLUON_SP
    assert rel_err(b(x), ref) < 8e-3
    cfgs = [c for kernel, c in runnable(b.table, problem) if kernel is s24.GLUON_SP]
    assert cfgs
    for cfg in cfgs:
        tuned = {m_bucket(m): ("gluon_sparse_mma", cfg)}
        choice = select(b.table, problem, tuned)
        assert choice.kernel is s24.GLUON_SP and choice.config == cfg
        b.tuned = {b.op: tuned}
        assert rel_err(b(x), ref) < 8e-3, cfg
    b.tuned = {}


def _fp8_case(m, n, k, seed):
    """A 2:4 weight with e4m3 values and row scales, e4m3 x with token scales, and the float64
    product of the dequantised operands (what every `2:4+fp8` kernel computes)."""
    w, x = _gpu_case(m, n, k, seed)
    f = s24.Sparse24Fp8Weight.from_dense(w)
    qx, xs = quantize_act_fp8(x * (1 + torch.arange(m, device="cuda")[:, None]))  # unequal token scales
    wd = s24.decompress_24(f.tensor, torch.float64) * f.scale.double()[:, None]
    return f, qx, xs, fp64_ref(qx.double() * xs.double()[:, None], wd)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_gpu_sparse_mma_kernel_e4m3(m, tmp_path):
    # The e4m3 path (`2:4+fp8` at decode): every candidate of M's bucket on the Llama-3.1-8B FFN
    # shapes (an N tail on the first), other tilings on small shapes, against float64 of the
    # dequantised operands, token scales unequal; outputs poisoned first. Checks the widening of
    # the stored words and of x to f16 pairs, and the metadata of 2 * WPT.
    from engine.kernels import sparse24_gluon as sp
    from engine.kernels.tuner import Tuner
    if not _sm90():
        pytest.skip("sm_90 kernel")
    bucket = s24.GLUON_CONFIGS[m_bucket(m)]
    others = [("sp", 16, 64, 2, 2, 8, 2), ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 256, 8, 1, 16, 1)]
    for n, k, cfgs in ((777, 4096, bucket), (4096, 14336, bucket), (48, 1024, others[:2]), (1000, 2048, others)):
        f, qx, xs, ref = _fp8_case(m, n, k, 13 * m + n)
        for cfg in cfgs:
            assert sp.unsupported(qx, f.values, cfg) is None, cfg
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            sp.launch(qx, f.values, sp.mma_order_meta(f.meta, 2 * cfg[3]), f.scale, cfg, out, x_scale=xs)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), cfg
            assert rel_err(out, ref) < 8e-3, (cfg, n, k)
    with pytest.raises(ValueError, match="x_scale"):
        sp.launch(qx, f.values, f.meta_mma_4, f.scale, bucket[0], out)
    # Through the backend: selected (it asks the norm / SwiGLU before for e4m3 activations), every
    # configuration of the bucket as a tuned choice, bf16 activations quantised inside to the same
    # bits, and after the tuner's own choice.
    f, qx, xs, ref = _fp8_case(m, 1000, 4096, 3)  # a K that every configuration divides
    assert all(getattr(f, f"meta_mma_{wpt}") is not None for wpt in s24.MMA_ORDER_WPTS)
    problem = f._problem(f.op, qx)
    assert select(f.table, problem).kernel is s24.GLUON_SP_FP8 and f.input_quant(m) == "fp8"
    assert rel_err(f(qx, x_scale=xs), ref) < 8e-3
    x = (qx.float() * xs[:, None]).bfloat16()
    assert torch.equal(f(x), f(*quantize_act_fp8(x)))
    cfgs = [c for kernel, c in runnable(f.table, problem) if kernel is s24.GLUON_SP_FP8]
    assert cfgs == s24.GLUON_CONFIGS[m_bucket(m)]
    for cfg in cfgs:
        f.tuned = {f.op: {m_bucket(m): ("gluon_sparse_mma_fp8", cfg)}}
        assert rel_err(f(qx, x_scale=xs), ref) < 8e-3, cfg
    f.tuned = {}
    f.tune(Tuner(tmp_path / "tuning.json"), [m])
    assert f.tuned[f.op][m_bucket(m)][0] in [k.name for k in f.table[9]]
    assert rel_err(f(qx, x_scale=xs), ref) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 9, 16])
def test_gpu_sparse_mma_norm_handoff(m):
    # The sparse-MMA kernel on both sides of a handed-off RMSNorm (engine/kernels/stream_triton.py):
    # before it (residual += x @ W^T, xg, the row tiles' sums of squares), with every candidate of
    # M's bucket, on the Llama down shape and an N tail, twice (split-K's scratch back at zero);
    # after it, with partial sums of 16- or 64-column groups (columns past M poisoned); and through
    # Sparse24Weight, which takes part where its GEMM is the sparse-MMA kernel, for a fused gate/up
    # only where the SwiGLU kernel follows (the SwiGLU epilogue would apply the row scale too late).
    from engine.kernels import sparse24_gluon as sp
    from engine.kernels.stream_triton import norm_parts
    from tests.handoff import check_norm_out, check_row_scaled, random_parts
    if not _sm90():
        pytest.skip("sm_90 kernel")
    eps = 1e-5
    for n, k in ((4096, 14336), (1000, 1024)):
        w, x = _gpu_case(m, n, k, 7 * m + n)
        t = s24.compress_24(w)
        for cfg in s24.GLUON_CONFIGS[m_bucket(m)]:
            if sp.unsupported(x, t.values, cfg) is not None:
                continue
            meta = sp.mma_order_meta(t.meta, cfg[3])
            for _ in range(2):
                check_norm_out(lambda x, h, g, xg, parts: sp.launch(x, t.values, meta, None, cfg, h,
                                                                    norm_out=(g, xg, parts)),
                               torch.randn_like(x), w.double(), cfg[2])
            for group in (16, 64):
                h, g, xg, parts = random_parts(m, k, group, "cuda")
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                sp.launch(xg, t.values, meta, None, cfg, y, row_scale=(parts, eps))
                check_row_scaled(y, h, g, w.double(), eps, False, tol=8e-3)
    down_w = _gpu_case(m, 4096, 14336, 1)[0]
    down = s24.Sparse24Weight.from_dense(down_w)
    gate_up_w = _gpu_case(m, 2 * 14336, 4096, 2)[0]
    gate_up = s24.Sparse24Weight.from_dense(gate_up_w)
    assert down.norm_handoff(m)
    fused_swiglu = m <= s24.SPARSE24_SWIGLU[9][0].max_m
    assert gate_up.norm_handoff(m, swiglu=True) == (not fused_swiglu)
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    h = residual.clone()
    xg, parts = down.norm_out_forward(x, h, norm_weight)
    assert parts.shape == norm_parts(4096, "cuda", group=down._handoff_config(m, False)[2]).shape
    assert rel_err(h, fp64_ref(x, down_w) + residual.double()) < 8e-3
    if not fused_swiglu:
        check_row_scaled(gate_up.row_scaled_forward(xg, parts, eps, swiglu=True), h, norm_weight,
                         gate_up_w.double(), eps, True, tol=1.2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_gpu_sparse_mma_swiglu_epilogue(m, tmp_path):
    # silu(gate) * up from the GEMM's epilogue: every candidate that can run it, on the 8B gate_up
    # shape and on F = 1040 (a tail: 1040 gate rows are not a multiple of any program's 32..128),
    # against float64 of the pruned weight; outputs poisoned first. Then through the backend and
    # Linear.swiglu, which the model calls, untuned and after tuning (the epilogue timed against
    # the GEMM followed by the SwiGLU kernel).
    from engine.kernels import sparse24_gluon as sp
    from engine.kernels.swiglu import swiglu_ref
    from engine.kernels.tuner import Tuner
    if not _sm90():
        pytest.skip("sm_90 kernel")
    all_cfgs = list(dict.fromkeys(c for cs in s24.GLUON_CONFIGS.values() for c in cs))
    for f, k in ((14336, 4096), (1040, 1024)):
        w, x = _gpu_case(m, 2 * f, k, 11 * m + f)
        t = s24.compress_24(w)
        metas = {wpt: sp.mma_order_meta(t.meta, wpt) for wpt in s24.MMA_ORDER_WPTS}
        y = x.double() @ w.double().t()
        ref = torch.nn.functional.silu(y[:, :f]) * y[:, f:]
        cfgs = [c for c in all_cfgs if sp.unsupported(x, t.values, c, swiglu=True) is None]
        assert len(cfgs) >= 5
        for cfg in cfgs:
            out = torch.full((m, f), float("nan"), device="cuda", dtype=torch.bfloat16)
            sp.launch(x, t.values, metas[cfg[3]], None, cfg, out, swiglu=True)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), cfg
            assert rel_err(out, ref) < 8e-3, (cfg, f, k)
    lin = Linear(k, 2 * f, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    lin.backend = s24.Sparse24Weight.from_dense(w)
    fused = lin.swiglu(x)
    assert fused.shape == (m, f) and rel_err(fused, ref) < 8e-3
    assert rel_err(fused, swiglu_ref(lin(x))) < 8e-3  # the unfused path, GEMM then SwiGLU kernel
    lin.backend.tune(Tuner(tmp_path / "tuning.json"), [m], swiglu=True)
    if m <= s24.SPARSE24_SWIGLU[9][0].max_m:  # the epilogue's range: timed against the unfused path
        pick = lin.backend.tuned["sparse24_swiglu"][m_bucket(m)]
        assert pick[0] in ("gluon_sparse_mma_swiglu", "separate")
    else:
        assert m_bucket(m) not in lin.backend.tuned.get("sparse24_swiglu", {})
    assert rel_err(lin.swiglu(x), ref) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_backends_all_paths(m, n, k):
    from engine.kernels.sparse24_libs import cslt_mm
    torch.manual_seed(m + n + k)
    w, x = _gpu_case(m, n, k, m + 3 * n)
    ref = fp64_ref(x, w)
    b = s24.Sparse24Weight.from_dense(w)
    assert torch.equal(b.dequantize(), w)
    # Every (kernel, config) the tuner could pick for this M, the selected one, cuSPARSELt directly.
    paths = {f"{kernel.name} {config}": (lambda x, kernel=kernel, config=config: kernel.run(x, b, config=config))
             for kernel, config in runnable(b.table, b._problem(b.op, x))}
    assert any(name.startswith("triton_stream") for name in paths)
    paths["auto"] = b.forward
    if b.packed is not None:
        paths["cslt"] = lambda x: cslt_mm(b.packed, x)
    for name, fn in paths.items():
        y = fn(x)
        assert y.shape == (m, n), name
        assert rel_err(y, ref) < 8e-3, name

    f = s24.Sparse24Fp8Weight.from_dense(w)
    ref8 = fp64_ref(x, f.dequantize().float())
    assert rel_err(s24.TRITON.run(x, f, config=_triton_configs(m)[0]), ref8) < 8e-3
    assert f.packed is not None or n % 32 or k % 64, "torchao's 2:4 FP8 kernel did not load"
    chosen = select(f.table, f._problem(f.op, x)).kernel
    assert chosen.name == ("gluon_sparse_mma_fp8" if m <= 16 and k % 128 == 0 else
                           "torchao_cutlass_sm90" if f.packed is not None else "triton_stream")
    if f.packed is not None:
        # torchao's kernel quantizes the activations to e4m3 per token as well: ~3e-2.
        torchao = next(kern for kern in f.table[9] if kern.name == "torchao_cutlass_sm90")
        assert rel_err(torchao.run(x, f, config=None), ref8) < 6e-2
    if chosen.input_quant == "fp8":  # the sparse-MMA kernel or torchao's
        assert rel_err(f.forward(x), ref8) < 6e-2
        # Activations quantised upstream (the fused norm / SwiGLU kernels do it when input_quant
        # says so) give the same bits as quantising inside.
        assert f.input_quant(m) == "fp8"
        qx, xs = quantize_act_fp8(x)
        assert torch.equal(f.forward(qx, x_scale=xs), f.forward(x))
        h, hs = rms_norm(x, torch.ones(k, device="cuda", dtype=torch.bfloat16), 1e-5, quant="fp8")
        ref_h = fp64_ref(rms_norm(x, torch.ones(k, device="cuda", dtype=torch.bfloat16), 1e-5), f.dequantize().float())
        assert rel_err(f.forward(h, x_scale=hs), ref_h) < 6e-2
    else:
        assert f.input_quant(m) is None


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 512), (3, 1000, 512), (17, 384, 1024), (50, 640, 1024),
                                   (200, 256, 520)])
def test_gpu_outputs_fully_written(m, n, k):
    w, x = _gpu_case(m, n, k, 11 * m)
    t = s24.compress_24(w)
    q, scale = quantize_rows_fp8(t.values)
    for cfg in _triton_configs(m):
        for values, sc in ((t.values, None), (q, scale)):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            _mma_gemm(x, values, t.meta, sc, cfg, out)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), cfg
    for sc in (None, torch.rand(n, device="cuda") + 0.5):  # the Gluon kernel: bf16 values only
        for cfg, out in _gluon_runs(m, x, t, sc):
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), cfg


# ----------------------------------------------------------------------------- Gluon sparse-MMA kernel (CPU compile)

SP_ARGS = dict(x_ptr="*i32", words_ptr="*i32", meta_ptr="*i32", scale_ptr="*fp32", x_scale_ptr="*fp32", out_ptr="*bf16",
               acc_ptr="*fp32", count_ptr="*i32", parts_ptr="*fp32", g_ptr="*bf16", xg_ptr="*bf16",
               n_parts="i32", eps="fp32", M="i32", N="i32", stride_xm="i32", stride_om="i32")


def test_sparse_mma_kernel_compiles_for_sm90():
    # mma.sp on the stored words: per K step of 16 * WPT and 8-token tile WPT/2 sparse k32 MMAs,
    # no dense MMA (nor its expansion); the words load straight into the A registers as 16-byte
    # vectors (WPT 4, 8), x as 16-byte vectors whose halves neighbouring lanes swap with shuffles,
    # the metadata registers as they are stored (one vector per row block and step: no integer
    # work on them); no shared memory in the loop.
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from gluon_ptx import compile_sm90, ptx_loops
    from engine.kernels.sparse24_gluon import sparse24_sp_kernel
    for wpt, mp, wk, warps, split, rb in ((4, 8, 2, 4, 1, 1), (8, 16, 4, 4, 2, 1), (4, 16, 1, 8, 1, 1),
                                          (8, 8, 4, 8, 2, 1), (4, 16, 2, 4, 1, 4)):
        ptx = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=8192, BLOCK_N=16 * rb * warps // wk, WPT=wpt, MP=mp,
                                                          WK=wk, SPLIT_K=split, HAS_SCALE=split == 2),
                           num_warps=warps)
        loops = ptx_loops(ptx)
        assert len(loops) == 1
        body = loops[0]
        # 2 steps; RB row blocks per warp share the x registers
        assert body.count("mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32") == 2 * (wpt // 2) * (mp // 8) * rb
        assert "mma.sync.aligned.m16n8k16" not in body
        # per step: 2 rows of WPT words per row block, 8 * WPT bytes of x per token tile, WPT / 2
        # metadata registers per row block (16 bytes at WPT 8, 8 at WPT 4)
        per_step = rb * (wpt // 2 + (1 if wpt == 8 else 0)) + (mp // 8) * wpt // 2
        assert body.count("ld.global.v4.b32") == 2 * per_step, wpt
        assert body.count("ld.global.v2.b32") == (2 * rb if wpt == 4 else 0)
        assert not re.search(r"\b(and|or|shr|shl|prmt|bfe)\.b32", body)
        assert body.count("shfl.sync.bfly.b32") == 2 * (mp // 8) * wpt
        assert "shared" not in body and "bar.sync" not in body
        if rb >= 2 and split == 1:  # the SwiGLU epilogue leaves the loop as it is
            fused = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=8192, BLOCK_N=16 * rb * warps // wk, WPT=wpt,
                                                                MP=mp, WK=wk, SPLIT_K=1, HAS_SCALE=False,
                                                                SWIGLU=True), num_warps=warps)
            fused_loops = ptx_loops(fused)
            assert len(fused_loops) == 1 and fused_loops[0].count("mma.sp") == body.count("mma.sp")
            assert "ex2.approx" in fused and fused.count("st.global") * 2 == ptx.count("st.global")
        # The RMSNorm hand-off's epilogues (engine/kernels/stream_triton.py) leave the loop as it is.
        for handoff in (dict(NORM_OUT=True), dict(NORM_IN=True, PARTS=64)):
            fused = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=8192, BLOCK_N=16 * rb * warps // wk, WPT=wpt,
                                                                MP=mp, WK=wk, SPLIT_K=split, HAS_SCALE=False)
                                 | handoff, num_warps=warps)
            fused_loops = ptx_loops(fused)
            assert len(fused_loops) == 1 and fused_loops[0].count("mma.sp") == body.count("mma.sp")
            assert fused_loops[0].count("ld.global") == body.count("ld.global")
            assert ("sqrt" in fused) == ("NORM_IN" in handoff)
    # e4m3 values and x (`2:4+fp8`): the same loop on f16 pairs. Per step and row block, 2 * WPT
    # stored words widen to 4 * WPT pairs (two cvt each) for WPT f16 k32 MMAs per token tile, and
    # each token tile's 2 * WPT words of x likewise; no e4m3 MMA (ptxas would emulate it).
    for wpt, mp, wk, warps, split, rb in ((4, 8, 1, 8, 1, 1), (8, 16, 2, 4, 2, 1), (4, 16, 2, 4, 1, 2)):
        ptx = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=8192, BLOCK_N=16 * rb * warps // wk, WPT=wpt, MP=mp,
                                                          WK=wk, SPLIT_K=split, HAS_SCALE=True, E4M3=True),
                           num_warps=warps)
        loops = ptx_loops(ptx)
        assert len(loops) == 1
        body, tiles = loops[0], mp // 8
        assert body.count("mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32") == 2 * wpt * tiles * rb
        assert "e4m3.e4m3" not in ptx and "bf16.bf16" not in body
        assert body.count("cvt.rn.f16x2.e4m3x2") == 2 * 4 * wpt * (rb + tiles)
        assert "shared" not in body and "bar.sync" not in body
    # Small K: one K step per warp (K = 64 at WPT 4; 256 over 2 warps at WPT 8), odd step counts
    # (704 = 11 steps of 64), WPT 2
    for k, wpt, wk, warps in ((64, 4, 1, 4), (256, 8, 2, 4), (704, 4, 1, 4), (96, 2, 1, 4)):
        ptx = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=k, BLOCK_N=16 * warps // wk, WPT=wpt, MP=8, WK=wk,
                                                          SPLIT_K=1, HAS_SCALE=True), num_warps=warps)
        assert "mma.sp.sync.aligned.m16n8k32" in ptx, k
    # Split-K: the partial sums meet in one launch (atomics, a CTA barrier: thread_barrier in
    # Triton 3.6, barrier later; both compile).
    ptx = compile_sm90(sparse24_sp_kernel, SP_ARGS, dict(K=14336, BLOCK_N=16, WPT=4, MP=8, WK=4, SPLIT_K=4,
                                                      HAS_SCALE=False), num_warps=4)
    assert re.search(r"\b(atom|red)\.global", ptx)


def test_sparse_mma_configurations_do_not_spill():
    # Every configuration the tuner may choose for the 2:4 FFN GEMMs of Llama-3.1-8B and -3.2-1B
    # (the format's own candidate list at each M bucket), with each epilogue the engine runs there
    # (gate/up: plain, SwiGLU, or taking the RMSNorm hand-off; down: plain or handing it off; e4m3
    # values, `2:4+fp8`: plain), assembles for sm_90a with no register spilled to local memory
    # (ptxas of the installed Triton).
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from gluon_ptx import compile_sm90, preset_gemms, ptxas_usage
    from engine.kernels.sparse24_gluon import sparse24_sp_kernel
    epilogues = {"gate_up": [dict(), dict(SWIGLU=True), dict(NORM_IN=True, PARTS=64), dict(E4M3=True)],
                 "down": [dict(), dict(NORM_OUT=True), dict(E4M3=True)]}
    launches = {}
    for role, n, k in preset_gemms("llama-3.2-1b", "llama-3.1-8b"):
        for m, epilogue in itertools.product((1, 2, 4, 8, 16), epilogues.get(role, [])):
            op = "sparse24_swiglu" if epilogue.get("SWIGLU") else "sparse24_gemm"
            values = torch.float8_e4m3fn if epilogue.get("E4M3") else torch.bfloat16
            problem = Problem(op, m, n, k, torch.device("cpu"), (values, torch.bfloat16, True, True))
            for _, _, bn, wpt, split, warps, wk in s24._gluon_configs(problem):
                constexprs = dict(BLOCK_N=bn, WPT=wpt, MP=8 if m <= 8 else 16, WK=wk, SPLIT_K=split,
                                  HAS_SCALE=False, **epilogue)
                # K sets only the loop's trip count, not its body: one K per configuration and epilogue
                launches.setdefault((warps, *sorted(constexprs.items())), (dict(constexprs, K=k), warps))
    assert len(launches) > 20
    for key, (constexprs, warps) in launches.items():
        registers, spilled = ptxas_usage(compile_sm90(sparse24_sp_kernel, SP_ARGS, constexprs, num_warps=warps))
        assert spilled == 0, (key, registers, spilled)


def test_mma_order_meta_is_the_registers_the_kernel_passes():
    # Register (block, step, g, q, c): rows 16 block + g (bits 0..15) and + 8 (16..31), logical
    # groups 4q .. 4q + 3 of MMA c, a nibble each; byte (WPT/2) m + c of a row's step holds
    # logical groups m (low nibble) and m + 4 (high). Built here from the bytes, independently.
    # (WPT 16: the order the e4m3 kernel at WPT 8 takes, its words widened to twice the pairs.)
    from engine.kernels.sparse24_gluon import mma_order_meta
    for wpt in (2, 4, 8, 16):
        n, k = 37, 16 * wpt * 3
        meta = torch.randint(0, 256, (n, k // 8), dtype=torch.uint8)
        mo = mma_order_meta(meta, wpt)
        steps, c_count = k // (16 * wpt), wpt // 2
        assert mo.dtype == torch.int32 and mo.shape == ((n + 15) // 16, steps, 8, 2, c_count)
        want = torch.zeros(mo.shape, dtype=torch.int64)
        for b, s, g, q, c in itertools.product(range(mo.shape[0]), range(steps), range(8), range(2),
                                               range(c_count)):
            for h, m in itertools.product(range(2), range(4)):
                row = 16 * b + 8 * h + g
                if row < n:
                    byte = int(meta[row, s * 2 * wpt + (wpt // 2) * m + c])
                    want[b, s, g, q, c] |= ((byte >> (4 * q)) & 15) << (4 * m + 16 * h)
        assert torch.equal(mo.long() & 0xFFFFFFFF, want)
    w = s24.prune_24(torch.randn(32, 256).bfloat16())
    for b in (s24.Sparse24Weight.from_dense(w), s24.Sparse24Fp8Weight.from_dense(w)):
        assert all(getattr(b, f"meta_mma_{wpt}") is None for wpt in s24.MMA_ORDER_WPTS)  # CPU


def test_sparse_mma_launch_refuses_handoffs_it_cannot_run():
    """The hand-off's arguments are checked before anything launches (CPU tensors here): not with
    the SwiGLU epilogue, one side a launch (the kernel has one partial-sums buffer), and partial
    sums of the producer's tile count."""
    from engine.kernels import sparse24_gluon as sp
    m, n, k = 2, 64, 256
    x, y = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(m, n, dtype=torch.bfloat16)
    t = s24.compress_24(s24.prune_24(torch.randn(n, k).bfloat16()))
    cfg = (0, 0, 32, 4, 1, 4, 1)     # BLOCK_N 32: two row tiles of N = 64
    norm_out = (torch.ones(n, dtype=torch.bfloat16), torch.zeros_like(y), torch.zeros(2, 16))
    row_scale = (torch.zeros(3, 16), 1e-5)
    with pytest.raises(ValueError, match="SwiGLU"):
        sp.launch(x, t.values, t.meta, None, cfg, y, swiglu=True, row_scale=row_scale)
    with pytest.raises(ValueError, match="one side of the hand-off"):
        sp.launch(x, t.values, t.meta, None, cfg, y, norm_out=norm_out, row_scale=row_scale)
    with pytest.raises(ValueError, match="parts"):
        sp.launch(x, t.values, t.meta, None, cfg, y, norm_out=norm_out[:2] + (torch.zeros(1, 16),))
    with pytest.raises(ValueError, match="parts"):
        sp.launch(x, t.values, t.meta, None, cfg, y, row_scale=(torch.zeros(3, 8), 1e-5))
    # The metadata must be the MMA-order copy of the config's WPT.
    for meta in (t.meta, sp.mma_order_meta(t.meta, 8)):
        with pytest.raises(ValueError, match="meta_mma"):
            sp.launch(x, t.values, meta, None, cfg, y)


def test_sparse_mma_configs_are_decode_candidates():
    # The Gluon sparse-MMA kernel is sm_90's first choice up to 16 tokens (configurations for the
    # buckets 1..16 only); beyond that, without MMA-order metadata or with e4m3 values, the
    # libraries or the Triton kernel, which runs any shape (the untuned default anywhere else).
    for bucket in (1, 2, 4, 8, 16):
        assert s24.GLUON_CONFIGS[bucket] and all(c[0] == "sp" for c in s24.GLUON_CONFIGS[bucket])
    assert set(s24.GLUON_CONFIGS) == {1, 2, 4, 8, 16} and s24.GLUON_SP.max_m == 16
    assert set(s24.MMA_ORDER_WPTS) == {c[3] for cs in s24.GLUON_CONFIGS.values() for c in cs}
    assert s24.SPARSE24_GEMM["other"][-2:] == [s24.TRITON, s24.REFERENCE]

    def pick(m, k=4096, values=torch.bfloat16, library=False, mma_order=True, table=s24.SPARSE24_GEMM,
             op="sparse24_gemm"):
        p = Problem(op, m, 4096, k, torch.device("cuda"), (values, torch.bfloat16, library, mma_order))
        return select(table, p).kernel.name
    clear_cache()
    try:
        from engine.kernels.platform import fake_capability
        with fake_capability((9, 0)):
            # (M = 3, 9, ...: test_sparse_mma_selection_between_powers_of_two)
            assert [pick(m) for m in (1, 2, 4, 8, 16, 17, 300)] == ["gluon_sparse_mma"] * 5 + ["triton_stream"] * 2
            assert pick(17, library=True) == "cusparselt" and pick(1, library=True) == "gluon_sparse_mma"
            assert pick(1, mma_order=False) == "triton_stream"
            assert pick(1, k=4104) == "triton_stream"  # no configuration divides K
            fp8 = dict(values=torch.float8_e4m3fn, table=s24.SPARSE24_FP8_GEMM, op="sparse24_fp8_gemm")
            assert [pick(m, library=True, **fp8) for m in (1, 16, 17)] == ["gluon_sparse_mma_fp8"] * 2 + [
                "torchao_cutlass_sm90"]
            assert pick(1, **fp8) == "gluon_sparse_mma_fp8" and pick(17, **fp8) == "triton_stream"
            assert pick(1, mma_order=False, library=True, **fp8) == "torchao_cutlass_sm90"
            assert pick(1, k=4160, library=True, **fp8) == "torchao_cutlass_sm90"  # no e4m3 K step divides K
            assert pick(1, mma_order=False, **fp8) == "triton_stream"
            swiglu = dict(table=s24.SPARSE24_SWIGLU, op="sparse24_swiglu")
            assert [pick(m, **swiglu) for m in (1, 4, 5, 16)] == ["gluon_sparse_mma_swiglu"] * 2 + ["separate"] * 2
            assert pick(1, values=torch.float8_e4m3fn, **swiglu) == "separate"   # e4m3: the plain epilogue only
        with fake_capability((10, 0)):
            assert pick(1) == "triton_stream" and pick(1, library=True) == "cusparselt"
            assert pick(1, **dict(table=s24.SPARSE24_SWIGLU, op="sparse24_swiglu")) == "separate"
    finally:
        clear_cache()


@pytest.mark.parametrize("m", [3, 9])
def test_sparse_mma_selection_between_powers_of_two(m):
    # M that is not a power of two (3, 5..7, 9..15 tokens) selects like its bucket on sm_90 (select
    # checks the actual M as well as its bucket: the Gluon configurations must be looked up by bucket).
    from engine.kernels.platform import fake_capability
    clear_cache()
    try:
        with fake_capability((9, 0)):
            for table, op, name in ((s24.SPARSE24_GEMM, "sparse24_gemm", "gluon_sparse_mma"),
                                    (s24.SPARSE24_SWIGLU, "sparse24_swiglu", None)):
                p = Problem(op, m, 4096, 4096, torch.device("cuda"), (torch.bfloat16, torch.bfloat16, False, True))
                got = select(table, p).kernel.name
                assert got == (name or ("gluon_sparse_mma_swiglu" if m <= 4 else "separate"))
    finally:
        clear_cache()
