"""The fused Triton kernels (norms, SwiGLU, RoPE, paged attention) against their PyTorch references.

With CUDA the kernels run compiled: the small-shape tests, and the `gpu` tests at Llama-3.1-8B
shapes. Without CUDA the small-shape tests (marker `interpreter`) run in Triton's interpreter, in
the child process of tests/test_interpreter.py (TRITON_INTERPRET=1 must be set before triton is
first imported); `TRITON_INTERPRET=1 pytest tests/test_kernels_triton.py` runs them directly.
Inputs are fresh random draws; outputs are allocated poisoned (NaN), so an element a kernel never
writes fails its test.
"""
from __future__ import annotations

import pytest
import torch

import engine.kernels.attention as attention
import engine.kernels.decode_inputs as decode_inputs
import engine.kernels.norms as norms
import engine.kernels.rope as rope
import engine.kernels.swiglu as swiglu
from engine.kernels.platform import triton_runs
from tests.numerics import rel_err

pytestmark = pytest.mark.interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    # bf16: both sides round to bf16 (the interpreter truncates), ~2^-9 per element
    return 1e-5 if dtype == torch.float32 else 8e-3


def assert_close(out, ref, dtype, what=""):
    assert not out.float().isnan().any(), f"{what}: unwritten (NaN) elements"
    err = rel_err(out, ref)
    assert err < tol(dtype), f"{what}: relative error {err:.2e} >= {tol(dtype):.0e}"


def e4m3_ulp(v):
    """Spacing of the float8_e4m3fn grid at |v| (subnormals below 2^-6 are spaced 2^-9)."""
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -10))).clamp(min=-6)
    return torch.exp2(exponent - 3)


def assert_fp8_rows(q, scale, y):
    """q, scale: a per-row float8_e4m3fn quantisation of y (float64 [M, N]). Checks scale = amax/448
    and that every code is y / scale rounded to the nearest e4m3 value (half an ulp, plus slack for
    the fp32 rounding of y inside the kernel)."""
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert not q.float().isnan().any() and not scale.isnan().any(), "unwritten (NaN) elements"
    want_scale = y.abs().amax(-1) / 448.0
    assert rel_err(scale, want_scale) < 1e-5
    v = y / scale.double()[:, None]
    err = (q.double() - v).abs()
    assert (err <= 0.5 * e4m3_ulp(v) * (1 + 1e-3) + 1e-5 * v.abs()).all(), \
        f"fp8 codes off by up to {(err / e4m3_ulp(v)).max().item():.2f} ulp"
    deq = q.double() * scale.double()[:, None]
    assert rel_err(deq, y) < 2.0 ** -4     # e4m3: 3 mantissa bits


def rms_rows64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


# --------------------------------------------------------------------------------------------------
# norms

NORM_SHAPES = [(1, 300), (37, 576), (130, 1000)]   # 1 row, SmolLM2's hidden, many rows


def check_rms_norm(m, n, dtype, with_residual, quant):
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    residual = torch.randn(m, n, device=DEVICE, dtype=dtype) if with_residual else None
    weight = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype)
    out = norms.rms_norm_triton(x, weight, 1e-5, residual, quant)
    ref = norms.rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        out, new_residual = out
        ref, ref_residual = ref
        assert_close(new_residual, ref_residual, dtype, "residual")
        normed_input = new_residual
    else:
        normed_input = x
    if quant == "fp8":
        # quantised from the fp32 normalised row of the kernel's own residual output
        assert_fp8_rows(*out, rms_rows64(normed_input, weight, 1e-5))
    else:
        assert out.dtype == dtype
        assert_close(out, ref, dtype, "rms_norm")


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", NORM_SHAPES)
def test_rms_norm(poisoned, m, n, dtype, with_residual, quant):
    check_rms_norm(m, n, dtype, with_residual, quant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", NORM_SHAPES)
def test_l2_norm(poisoned, m, n, dtype):
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    assert_close(norms.l2_norm_triton(x), norms.l2_norm_ref(x), dtype, "l2_norm")


def test_rms_norm_fp8_zero_row(poisoned):
    """An all-zero row (after the residual add) quantises to zeros with a finite scale."""
    x = torch.randn(3, 200, device=DEVICE)
    residual = x.clone()
    residual[1] = -x[1]
    (q, scale), new_residual = norms.rms_norm_triton(x, torch.ones(200, device=DEVICE), 1e-5, residual, "fp8")
    assert (new_residual[1] == 0).all() and (q[1].float() == 0).all() and torch.isfinite(scale).all()
    assert (q[0].float() != 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_into_the_callers_buffers(dtype):
    """out and residual_out (the step graphs' static buffers): the residual stream updated in place
    (residual_out is residual) and the normed rows written into the first rows of a larger
    poisoned buffer, the same as into new tensors; nothing past them written."""
    m, n = 37, 576
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype)
    stream = torch.randn(m + 5, n, device=DEVICE, dtype=dtype)
    residual_in = stream[:m].clone()
    want, want_residual = norms.rms_norm_triton(x, weight, 1e-5, residual_in)
    out = torch.full((m + 5, n), float("nan"), device=DEVICE, dtype=dtype)
    tail = stream[m:].clone()
    normed, residual = norms.rms_norm_triton(x, weight, 1e-5, stream[:m], out=out[:m], residual_out=stream[:m])
    assert normed.data_ptr() == out.data_ptr() and residual.data_ptr() == stream.data_ptr()
    assert torch.equal(out[:m], want) and torch.equal(stream[:m], want_residual)
    assert out[m:].isnan().all() and torch.equal(stream[m:], tail)
    ref, ref_residual = norms.rms_norm_ref(x, weight, 1e-5, residual_in, out=torch.empty_like(x),
                                           residual_out=residual_in)
    assert_close(out[:m], ref, dtype, "rms_norm reference into out")
    assert_close(stream[:m], ref_residual, dtype, "rms_norm reference's residual in place")


# --------------------------------------------------------------------------------------------------
# SwiGLU

SWIGLU_SHAPES = [(1, 300), (37, 2500), (130, 96)]  # F not a power of two; 2500 > one 2048-wide slice


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,f", SWIGLU_SHAPES)
def test_swiglu(poisoned, m, f, dtype, quant):
    check_swiglu(m, f, dtype, quant)


def check_swiglu(m, f, dtype, quant):
    gate_up = 2 * torch.randn(m, 2 * f, device=DEVICE, dtype=dtype)
    out = swiglu.swiglu_triton(gate_up, quant)
    if quant == "fp8":
        g, u = gate_up.double().chunk(2, dim=-1)
        assert_fp8_rows(*out, torch.nn.functional.silu(g) * u)
    else:
        assert out.dtype == dtype
        assert_close(out, swiglu.swiglu_ref(gate_up), dtype, "swiglu")


# --------------------------------------------------------------------------------------------------
# RoPE

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def check_rope(t, nh, nkv, hd, dtype, max_pos, scaling):
    # q and k are strided views of one fused qkv output, as the model hands them over
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)
    q = qkv[:, :nh * hd].view(t, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd)
    v_before = qkv[:, (nh + nkv) * hd:].clone()
    positions = torch.randint(0, max_pos, (t,), device=DEVICE)
    inv_freq = rope.rope_inv_freq(hd, 500000.0, scaling).to(DEVICE)
    q_ref, k_ref = rope.apply_rope_ref(q.clone(), k.clone(), positions, inv_freq)
    q_out, k_out = rope.apply_rope_triton(q, k, positions, inv_freq)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()   # in place
    assert_close(q, q_ref, dtype, "rope q")
    assert_close(k, k_ref, dtype, "rope k")
    assert torch.equal(qkv[:, (nh + nkv) * hd:], v_before), "rope wrote outside q and k"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 9, 3, 64), (17, 9, 3, 64), (5, 8, 2, 128), (3, 6, 3, 64), (70, 9, 3, 64)])
def test_rope(t, nh, nkv, hd, dtype):
    check_rope(t, nh, nkv, hd, dtype, max_pos=100_000, scaling=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 9, 3, 64), (6, 8, 2, 128), (70, 9, 3, 64)])
def test_rope_stores_k_and_v_in_the_cache(t, nh, nkv, hd, dtype):
    # kv_write: the same launch stores the rotated k and v at their slots of the paged cache,
    # exactly what write_kv would store; q and k are still rotated in place, v is left alone
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)
    q = qkv[:, :nh * hd].view(t, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
    v_before = v.clone()
    positions = torch.randint(0, 100_000, (t,), device=DEVICE)
    inv_freq = rope.rope_inv_freq(hd, 500000.0, None).to(DEVICE)
    q_ref, k_ref = rope.apply_rope_ref(q.clone(), k.clone(), positions, inv_freq)
    num_blocks = t // 16 + 3
    k_cache, v_cache = paged_cache(num_blocks, 16, nkv, hd, dtype)
    slots = torch.randperm(num_blocks * 16, device=DEVICE)[:t]
    k_want, v_want = k_cache.clone(), v_cache.clone()
    rope.apply_rope_triton(q, k, positions, inv_freq, (v, k_cache, v_cache, slots, None))
    assert_close(q, q_ref, dtype, "rope q")
    assert_close(k, k_ref, dtype, "rope k")
    assert torch.equal(v, v_before)
    rope.write_kv_ref(k, v, k_want, v_want, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 9, 3, 64), (6, 8, 2, 128), (70, 9, 3, 64)])
def test_rope_into_a_buffer(t, nh, nkv, hd, dtype):
    """out (the step graphs' static q/k/v buffer): the rotated q and k and the unrotated v land in
    its first t rows, laid out as the qkv GEMM lays them out, and K/V in the cache, bit for bit as
    the in-place launch; the inputs stay as they were, no row past t is written; the reference
    path fills the same buffer."""
    width = (nh + 2 * nkv) * hd
    qkv = torch.randn(t, width, device=DEVICE, dtype=dtype)

    def split(a):
        return (a[:, :nh * hd].view(t, nh, hd), a[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd),
                a[:, (nh + nkv) * hd:].view(t, nkv, hd))
    positions = torch.randint(0, 100_000, (t,), device=DEVICE)
    inv_freq = rope.rope_inv_freq(hd, 500000.0, LLAMA3_SCALING).to(DEVICE)
    num_blocks = t // 16 + 3
    caches = [paged_cache(num_blocks, 16, nkv, hd, dtype) for _ in range(3)]
    for c in caches[1:]:
        c[0].copy_(caches[0][0])
        c[1].copy_(caches[0][1])
    slots = torch.randperm(num_blocks * 16, device=DEVICE)[:t]
    in_place = qkv.clone()
    q, k, v = split(in_place)
    rope.apply_rope_triton(q, k, positions, inv_freq, (v, *caches[0], slots, None))
    buf = torch.full((t + 3, width), float("nan"), device=DEVICE, dtype=dtype)
    q, k, v = split(qkv)
    before = qkv.clone()
    q_out, k_out = rope.apply_rope_triton(q, k, positions, inv_freq, (v, *caches[1], slots, None), out=buf[:t])
    assert torch.equal(qkv, before), "the inputs changed"
    assert torch.equal(buf[:t], in_place) and buf[t:].isnan().all()
    assert q_out.data_ptr() == buf.data_ptr() and torch.equal(k_out, split(buf[:t])[1])
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    ref_buf = torch.full((t, width), float("nan"), device=DEVICE, dtype=dtype)
    rope.apply_rope(q, k, positions, inv_freq, (v, *caches[2], slots, None), fused=False, out=ref_buf)
    assert_close(ref_buf, buf[:t], dtype, "rope reference into out")


def test_rope_llama3_scaling():
    check_rope(9, 4, 2, 128, torch.float32, max_pos=130_000, scaling=LLAMA3_SCALING)


# --------------------------------------------------------------------------------------------------
# paged attention


def paged_cache(num_blocks, block_size, nkv, hd, dtype):
    k_cache = torch.randn(num_blocks, block_size, nkv, hd, device=DEVICE, dtype=dtype)
    return k_cache, torch.randn_like(k_cache)


def block_tables_for(context_lens, block_size, num_blocks):
    """Each sequence gets its own random (non-contiguous) physical blocks; int32 [S, max_blocks]."""
    need = [(c + block_size - 1) // block_size for c in context_lens]
    width = max(need)
    perm = torch.randperm(num_blocks)[:sum(need)].tolist()
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    return tables.to(DEVICE)


def decode_cache(context_lens, nkv, hd, dtype, block_size=16):
    """A random paged cache holding the sequences' context_lens keys in scattered blocks: (k_cache,
    v_cache, block tables, int32 context lengths)."""
    num_blocks = sum((c + block_size - 1) // block_size for c in context_lens) + 3
    k_cache, v_cache = paged_cache(num_blocks, block_size, nkv, hd, dtype)
    tables = block_tables_for(context_lens, block_size, num_blocks)
    return k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)


def check_decode(context_lens, nh, nkv, hd, dtype, num_splits):
    k_cache, v_cache, tables, ctx = decode_cache(context_lens, nkv, hd, dtype)
    b = len(context_lens)
    q = torch.randn(b, nh + 2, hd, device=DEVICE, dtype=dtype)[:, 1:nh + 1]   # strided over heads
    scale = hd ** -0.5
    out = attention.decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    ref = attention.decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale)
    assert_close(out, ref, dtype, f"decode (splits {num_splits})")


def check_decode_rope(context_lens, nh, nkv, hd, dtype, num_splits):
    """The decode kernel given the rows' new k and v (new_kv): q and k rotated in the kernel, k and
    v stored at position context_len - 1. Against the reference (output and caches), and bit for bit
    against what it replaces: the RoPE kernel storing K/V, then the kernel without new_kv."""
    block_size = 16
    k_cache, v_cache, tables, ctx = decode_cache(context_lens, nkv, hd, dtype, block_size)
    b = len(context_lens)
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)   # as the qkv GEMM writes it

    def split(t):
        return (t[:, :nh * hd].view(b, nh, hd), t[:, nh * hd:(nh + nkv) * hd].view(b, nkv, hd),
                t[:, (nh + nkv) * hd:].view(b, nkv, hd))
    inv_freq = rope.rope_inv_freq(hd, 500000.0, LLAMA3_SCALING).to(DEVICE)
    scale = hd ** -0.5
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    q, k, v = split(qkv.clone())
    out = attention.decode_attention(q, *caches[0], tables, ctx, scale, (k, v, inv_freq), num_splits=num_splits)
    assert torch.equal(qkv, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)), "inputs changed"
    q, k, v = split(qkv.clone())
    ref = attention.decode_attention_ref(q, *caches[1], tables, ctx, scale, (k, v, inv_freq))
    assert_close(out, ref, dtype, f"decode with RoPE (splits {num_splits})")
    for mine, want in zip(caches[0], caches[1]):
        assert_close(mine, want, dtype, "cache after the decode kernel's K/V write")
    # what the engine ran before: RoPE's launch rotates and stores, then attention
    q, k, v = split(qkv.clone())
    pos = ctx.long() - 1
    slots = tables.gather(1, (pos // block_size)[:, None]).squeeze(1).long() * block_size + pos % block_size
    rope.apply_rope_triton(q, k, pos, inv_freq, (v, *caches[2], slots, None))
    before = attention.decode_attention(q, *caches[2], tables, ctx, scale, num_splits=num_splits)
    assert torch.equal(out, before), "decode with RoPE differs from RoPE's kernel then decode"
    assert torch.equal(caches[0][0], caches[2][0]) and torch.equal(caches[0][1], caches[2][1])


GQA = [(9, 3, 64), (8, 2, 128)]   # SmolLM2's 9/3 x 64 and a Llama-like group of 4 x 128


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd", GQA)
def test_decode_attention(poisoned, nh, nkv, hd, dtype, num_splits):
    # 1 key; exactly one block; partial last blocks; several 64-key tiles per split
    check_decode([1, 16, 37, 300], nh, nkv, hd, dtype, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("nh,nkv,hd", GQA)
def test_decode_attention_rope(poisoned, nh, nkv, hd, num_splits):
    # the new token alone; at a block's first row; mid-block; in the last of several splits
    check_decode_rope([1, 17, 37, 300], nh, nkv, hd, torch.bfloat16, num_splits)


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_layer_mixed_step_against_the_reference_path(fp8):
    """models.llama's attention on a step of two prefill chunks (one after a cached prefix) and
    three decodes: with the fused kernels, RoPE's launch rotates the prefill rows and the decode
    kernel its own rows; fused off, the RoPE reference and KV write run for every row. The same
    output and the same cache, within fp32 rounding (an FP8 cache: its codes within one step)."""
    from engine.batch import Batch
    from engine.memory.kv_cache import KVCache
    from models.llama import LlamaAttention
    from models.presets import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    layer = LlamaAttention(cfg, 0, DEVICE, torch.float32)
    for lin in (layer.qkv_proj, layer.o_proj):
        lin.load(torch.randn(lin.full_shape, device=DEVICE) * 0.1)
    bs = 16
    chunks = [(5, 0), (20, 9)]                 # (tokens this step, cached prefix)
    decodes = [1, 16, 40]                      # context lengths, this step's token included
    ctx = [n + p for n, p in chunks] + decodes
    cache = KVCache(1, sum(-(-c // bs) for c in ctx) + 1, bs, 2, 32, torch.float32, DEVICE, fp8=fp8)
    for x, sc in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        values = torch.randn(x.shape, device=DEVICE)
        if fp8:
            xq, s = rope.quantize_kv_ref(values)
            x.view(torch.uint8).copy_(xq.view(torch.uint8))
            sc.copy_(s)
        else:
            x.copy_(values)
    tables = block_tables_for(ctx, bs, cache.scratch_block)
    pos = [torch.arange(p, p + n) for n, p in chunks] + [torch.tensor([c - 1]) for c in decodes]
    seq = torch.cat([torch.full((len(x),), i) for i, x in enumerate(pos)]).to(DEVICE)
    pos = torch.cat(pos).to(DEVICE)
    slots = (tables[seq, pos // bs].long() * bs + pos % bs)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    t = len(pos)
    p = sum(n for n, _ in chunks)
    batch = Batch(input_ids=torch.zeros(t, dtype=torch.int64, device=DEVICE), positions=pos, slot_mapping=slots,
                  kv_cache=cache, num_prefills=2, num_prefill_tokens=p,
                  prefill_offsets=torch.tensor([0, 5, 25], dtype=torch.int32, device=DEVICE), prefill_max_len=20,
                  prefill_context_lens=lens[:2], prefill_block_tables=tables[:2], prefill_max_prefix=max(p for _, p in chunks),
                  num_decodes=3, decode_context_lens=lens[2:], decode_block_tables=tables[2:],
                  logits_indices=torch.arange(t, device=DEVICE), sampled=[])
    x = torch.randn(t, 128, device=DEVICE)
    inv_freq = rope.rope_inv_freq(32, 500000.0, LLAMA3_SCALING).to(DEVICE)
    state = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    before = [t.clone() for t in state]
    fused = layer(x, pos, batch, inv_freq)
    after_fused = [t.clone() for t in state]
    for t, b in zip(state, before):
        t.copy_(b)
    layer.fused = False
    reference = layer(x, pos, batch, inv_freq)
    if not fp8:
        assert_close(fused, reference, torch.float32, "attention layer, mixed step")
        assert_close(after_fused[0], cache.k, torch.float32, "k cache")
        assert torch.equal(after_fused[1], cache.v)
        return
    assert_close_fp8_kv(fused, reference, torch.float32, "attention layer, mixed step, FP8 cache")
    assert_same_codes(after_fused[0], cache.k)
    assert_same_codes(after_fused[1], cache.v)
    assert rel_err(after_fused[2], cache.k_scale) < 1e-5 and torch.equal(after_fused[3], cache.v_scale)


def check_prefill(q_lens, prefix_lens, nh, nkv, hd, dtype, with_cache=True, host_block_ends=False,
                  prefix_known=True):
    """prefix_known False: the call does not say the step's longest prefix (max_prefix None)."""
    block_size = 16
    ctx_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    t = sum(q_lens)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64, device=DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(t, nh, hd, device=DEVICE, dtype=dtype)
    kv = torch.randn(t, 2 * nkv * hd, device=DEVICE, dtype=dtype)
    k, v = kv[:, :nkv * hd].view(t, nkv, hd), kv[:, nkv * hd:].view(t, nkv, hd)
    scale = hd ** -0.5
    if with_cache:
        num_blocks = sum((c + block_size - 1) // block_size for c in ctx_lens) + 2
        k_cache, v_cache = paged_cache(num_blocks, block_size, nkv, hd, dtype)   # random prefixes
        tables = block_tables_for(ctx_lens, block_size, num_blocks)
        # the cache holds this step's keys too (the model writes them before attending)
        slots = torch.cat([tables[i, torch.arange(p, c, device=DEVICE) // block_size].long() * block_size
                           + torch.arange(p, c, device=DEVICE) % block_size
                           for i, (p, c) in enumerate(zip(prefix_lens, ctx_lens))])
        rope.write_kv_ref(k, v, k_cache, v_cache, slots)
    else:
        k_cache = v_cache = tables = None
    block_ends = None
    if host_block_ends:     # as engine/batch.py counts them
        m = attention.PREFILL_BLOCK_M
        block_ends = torch.tensor(torch.tensor([-(-n // m) for n in q_lens]).cumsum(0).tolist(),
                                  dtype=torch.int32, device=DEVICE)
    out = attention.prefill_attention_triton(q, k, v, cu, ctx, tables, k_cache, v_cache, scale,
                                             max(prefix_lens) if prefix_known else None, block_ends=block_ends)
    ref = attention.prefill_attention_ref(q, k, v, cu, ctx, tables, k_cache, v_cache, scale)
    assert_close(out, ref, dtype, "prefill")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd", GQA)
def test_prefill_attention_no_prefix(poisoned, nh, nkv, hd, dtype):
    # 130 rows cross a 128-query block; 1-token prompt
    check_prefill([1, 70, 130], [0, 0, 0], nh, nkv, hd, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd", GQA)
def test_prefill_attention_with_prefix(poisoned, nh, nkv, hd, dtype):
    # a decode-like chunk of 1 after 50 cached, a chunk after a block-aligned prefix, a fresh prompt
    check_prefill([1, 70, 40], [50, 32, 0], nh, nkv, hd, dtype)


def test_prefill_attention_full_and_partial_tiles(poisoned):
    # Prefixes of several whole key tiles plus a partial one (300 = 2 x 128 + 44), or exactly whole
    # (256); chunks whose later query blocks see whole tiles of their own keys before the diagonal.
    check_prefill([260, 129, 3], [300, 256, 0], 4, 2, 64, torch.float32)      # 64-key tiles
    check_prefill([260, 3], [2100, 0], 4, 2, 64, torch.bfloat16)              # 128-key tiles, 3 stages
    check_prefill([260, 200, 3], [0, 0, 0], 4, 2, 64, torch.bfloat16)         # fresh: 64-key tiles


def test_attention_into_the_callers_buffer():
    """out (the step graphs' static attention output): decode and prefill attention write their
    rows into a slice of a larger poisoned buffer, bit for bit what they return otherwise, and
    nothing past it."""
    nh, nkv, hd, dtype = 8, 2, 128, torch.bfloat16
    k_cache, v_cache, tables, ctx = decode_cache([1, 37, 300], nkv, hd, dtype)
    q = torch.randn(3, nh, hd, device=DEVICE, dtype=dtype)
    buf = torch.full((5, nh, hd), float("nan"), device=DEVICE, dtype=dtype)
    want = attention.decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    attention.decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, out=buf[1:4])
    assert torch.equal(buf[1:4], want) and buf[0].isnan().all() and buf[4].isnan().all()
    t = 40
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([15, 25], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(t, n, hd, device=DEVICE, dtype=dtype) for n in (nh, nkv, nkv))
    buf = torch.full((t + 2, nh, hd), float("nan"), device=DEVICE, dtype=dtype)
    want = attention.prefill_attention(q, k, v, cu, lens, None, None, None, 0.1)
    attention.prefill_attention(q, k, v, cu, lens, None, None, None, 0.1, out=buf[:t])
    assert torch.equal(buf[:t], want) and buf[t:].isnan().all()
    with pytest.raises(ValueError, match="out"):
        attention.prefill_attention(q, k, v, cu, lens, None, None, None, 0.1, out=buf[:t, :, :64])


def test_prefill_attention_with_the_hosts_query_blocks(poisoned):
    check_prefill([1, 260, 129, 40], [50, 300, 0, 0], 4, 2, 64, torch.bfloat16, host_block_ends=True)


def test_prefill_attention_one_sequence(poisoned):
    check_prefill([45], [20], 4, 1, 64, torch.bfloat16)


def test_prefill_attention_longest_prefix_not_given(poisoned):
    """Without max_prefix the kernel reads whatever prefix there is; with 0 it may skip them."""
    check_prefill([1, 70, 40], [50, 32, 0], 4, 2, 64, torch.bfloat16, prefix_known=False)
    check_prefill([70, 40], [0, 0], 4, 2, 64, torch.bfloat16, prefix_known=False)


def test_prefill_attention_more_sequences_than_one_owner_search_chunk(poisoned):
    """More sequences than the kernel's owner search reads at a time (SEQ_CHUNK): the query blocks
    past the first chunk's sequences still find their own."""
    n = attention.SEQ_CHUNK + 6
    q_lens = torch.randint(1, 6, (n,)).tolist()
    prefixes = [(i % 3) * 7 for i in range(n)]
    check_prefill(q_lens, prefixes, 4, 2, 32, torch.float32, host_block_ends=True)


def test_decode_attention_of_a_mixed_steps_rows(poisoned):
    """A mixed step's decode rows come after its prefill rows: the kernel is handed row slices of
    the step's block tables and context lengths, at any offset (so at any alignment)."""
    lens = [40, 3, 77, 16, 17, 130]
    for first in (1, 2, 3):
        k_cache, v_cache, tables, ctx = decode_cache(lens, 2, 64, torch.float32)
        q = torch.randn(len(lens) - first, 4, 64, device=DEVICE)
        out = attention.decode_attention(q, k_cache, v_cache, tables[first:], ctx[first:], 0.125)
        ref = attention.decode_attention_ref(q, k_cache, v_cache, tables[first:], ctx[first:], 0.125)
        assert_close(out, ref, torch.float32, f"decode rows from row {first}")


def test_compile_step_kernels_writes_no_cache():
    """The engine's start-up compile of the attention kernels reads only its scratch block and
    stores nothing in the cache."""
    k_cache, v_cache = paged_cache(5, 16, 2, 64, torch.float32)
    k0, v0 = k_cache.clone(), v_cache.clone()
    attention.compile_step_kernels(k_cache, v_cache, None, 4, torch.float32, block=4)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_prefill_attention_without_cache(poisoned):
    """The embedding path: no paged cache at all, prompts only."""
    check_prefill([3, 20], [0, 0], 4, 2, 64, torch.float32, with_cache=False)


# --------------------------------------------------------------------------------------------------
# dispatch: what the model calls takes the kernels wherever they apply


def test_dispatch_takes_the_kernels():
    x = torch.randn(4, 64, device=DEVICE)
    assert triton_runs(x)
    w = torch.randn(64, device=DEVICE)
    assert torch.equal(norms.rms_norm(x, w, 1e-6), norms.rms_norm_triton(x, w, 1e-6))
    assert torch.equal(norms.l2_norm(x), norms.l2_norm_triton(x))
    assert torch.equal(swiglu.swiglu(x), swiglu.swiglu_triton(x))
    q, s = norms.rms_norm(x, w, 1e-6, quant="fp8")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4,)


def test_fused_kernels_switch():
    """fused=False (EngineConfig.fused_kernels=False, per model): norm, SwiGLU and RoPE take their
    references; attention keeps its kernels (its reference is a Python loop, not a baseline)."""
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    assert torch.equal(norms.rms_norm(x, w, 1e-6, fused=False), norms.rms_norm_ref(x, w, 1e-6))
    assert torch.equal(swiglu.swiglu(x, fused=False), swiglu.swiglu_ref(x))
    q = torch.randn(3, 2, 64, device=DEVICE)
    k = torch.randn(3, 1, 64, device=DEVICE)
    inv_freq = rope.rope_inv_freq(64, 1e4).to(DEVICE)
    q_out, _ = rope.apply_rope(q, k, torch.arange(3, device=DEVICE), inv_freq, fused=False)
    assert q_out.data_ptr() != q.data_ptr()   # the reference returns new tensors
    q_out, _ = rope.apply_rope(q, k, torch.arange(3, device=DEVICE), inv_freq)
    assert q_out.data_ptr() == q.data_ptr()   # the kernel rotates in place


def test_reference_path_on_cpu_without_interpreter(monkeypatch):
    """With the interpreter off, CPU tensors take the references (how the CPU engine runs)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 32)
    assert not triton_runs(x)
    assert torch.equal(norms.rms_norm(x, torch.ones(32), 1e-6), norms.rms_norm_ref(x, torch.ones(32), 1e-6))


# --------------------------------------------------------------------------------------------------
# Llama-3.1-8B shapes on the GPU: hidden 4096, ffn 14336, 32 query / 8 KV heads x 128

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 8192])
def test_gpu_rms_norm_llama(poisoned, m):
    for with_residual in (False, True):
        for quant in (None, "fp8"):
            check_rms_norm(m, 4096, torch.bfloat16, with_residual, quant)


@pytest.mark.gpu
def test_gpu_l2_norm_llama(poisoned):
    x = torch.randn(8192, 4096, device=DEVICE, dtype=torch.bfloat16)
    assert_close(norms.l2_norm_triton(x), norms.l2_norm_ref(x), torch.bfloat16, "l2_norm")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_gpu_swiglu_llama(poisoned, m):
    for quant in (None, "fp8"):
        check_swiglu(m, 14336, torch.bfloat16, quant)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 8192])
def test_gpu_rope_llama(t):
    check_rope(t, 32, 8, 128, torch.bfloat16, max_pos=131_072, scaling=LLAMA3_SCALING)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_decode_attention_llama(poisoned, num_splits):
    check_decode([1, 1000, 4097, 8191], 32, 8, 128, torch.bfloat16, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_decode_attention_rope_llama(poisoned, num_splits):
    check_decode_rope([1, 1000, 4097, 8191], 32, 8, 128, torch.bfloat16, num_splits)


@pytest.mark.gpu
def test_gpu_decode_attention_batch64(poisoned):
    lens = torch.randint(1, 4096, (64,)).tolist()
    check_decode(lens, 32, 8, 128, torch.bfloat16, None)


@pytest.mark.gpu
def test_gpu_prefill_attention_llama(poisoned):
    check_prefill([1, 200, 1000], [0, 0, 0], 32, 8, 128, torch.bfloat16)
    check_prefill([1, 200, 1000], [700, 100, 513], 32, 8, 128, torch.bfloat16)
    check_prefill([300, 1000], [3000, 2048], 32, 8, 128, torch.bfloat16)   # long prefixes: 3 stages


@pytest.mark.gpu
@pytest.mark.parametrize("nh,nkv,hd", GQA + [(32, 8, 128)])
def test_gpu_prefill_attention_flash(poisoned, nh, nkv, hd):
    """The no-prefix prefill the model runs in bf16: flash's variable-length kernel on packed rows
    (k and v strided views of one qkv-like buffer, as the model hands them over), ragged lengths."""
    q_lens = [1, 77, 128, 1000]
    t = sum(q_lens)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, :nh * hd].view(t, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
    out = attention.prefill_attention_flash(q, k, v, cu, max(q_lens), hd ** -0.5)
    ctx = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    ref = attention.prefill_attention_ref(q, k, v, cu, ctx, None, None, None, hd ** -0.5)
    assert_close(out, ref, torch.bfloat16, "prefill (flash)")


def compiled_binaries(kernel) -> int:
    """How many binaries Triton has compiled of `kernel` (one per specialisation and device)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_attention_kernels_compile_once_for_every_step_shape():
    """Serving launches the attention kernels outside the step graphs on each step's own shapes:
    any number of sequences, block tables of any width, decode rows at any row of a mixed step, any
    split count. What the engine compiles at start (compile_step_kernels, and the decode kernel with
    RoPE, which the decode graphs' capture compiles) serves them all: a shape that needed another
    binary would compile while every request waits."""
    nh, nkv, hd, dtype, page = 32, 8, 128, torch.bfloat16, 16
    inv_freq = rope.rope_inv_freq(hd, 500000.0, LLAMA3_SCALING).to(DEVICE)
    k_cache, v_cache = paged_cache(2 * 70 * 2200 // page, page, nkv, hd, dtype)
    kernels = (attention._decode_kernel, attention._decode_merge_kernel, attention._prefill_kernel)
    attention.compile_step_kernels(k_cache, v_cache, None, nh, dtype, block=0)

    def step(rows, longest, rope_rows, fresh=False):
        """A mixed step's attention: `rows` prefill chunks with cached prefixes (none where `fresh`),
        then as many decode rows, handed over as row slices of the step's block tables and context
        lengths (int32, as uploaded), which start at a different alignment for each row count."""
        q_lens = torch.randint(1, 200, (rows,)).tolist()
        prefixes = [0] * rows if fresh else torch.randint(1, longest + 1, (rows,)).tolist()
        lens = [q + p for q, p in zip(q_lens, prefixes)] + torch.randint(1, longest + 1, (rows,)).tolist()
        ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        tables = block_tables_for(lens, page, k_cache.shape[0])
        t = sum(q_lens)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        qkv = torch.randn(t, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)
        q, k, v = (qkv[:, :nh * hd].view(t, nh, hd), qkv[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd),
                   qkv[:, (nh + nkv) * hd:].view(t, nkv, hd))
        attention.prefill_attention(q, k, v, cu, ctx[:rows], tables[:rows], k_cache, v_cache, hd ** -0.5,
                                    max(prefixes))
        qd = torch.randn(rows, nh, hd, device=DEVICE, dtype=dtype)
        new_kv = (torch.randn(rows, nkv, hd, device=DEVICE, dtype=dtype),
                  torch.randn(rows, nkv, hd, device=DEVICE, dtype=dtype), inv_freq) if rope_rows else None
        attention.decode_attention(qd, k_cache, v_cache, tables[rows:], ctx[rows:], hd ** -0.5, new_kv)

    # What the decode graphs' capture compiles: RoPE rows, with the context split (small buckets) and
    # unsplit (large ones, where the kernel writes `out` itself: its partials' pointers are bf16 then,
    # another binary).
    step(1, 5, rope_rows=True)
    step(70, 5, rope_rows=True)
    before = [compiled_binaries(kernel) for kernel in kernels]
    for rows, longest in [(1, 5), (2, 40), (3, 300), (7, 17), (16, 1000), (33, 260), (70, 64), (5, 2100)]:
        for rope_rows in (False, True):
            step(rows, longest, rope_rows)
        step(rows, longest, False, fresh=True)
    grown = [compiled_binaries(kernel) - b for kernel, b in zip(kernels, before)]
    assert grown == [0, 0, 0], f"binaries compiled while 'serving' (decode, merge, prefill): {grown}"


@pytest.mark.gpu
def test_gpu_fp32_attention_exact():
    """fp32 inputs run the attention dots in IEEE fp32 (no tf32): error at fp32 rounding level."""
    check_decode([1, 333, 2000], 32, 8, 128, torch.float32, 4)
    check_prefill([5, 300], [0, 77], 32, 8, 128, torch.float32)


# --------------------------------------------------------------------------------------------------
# FP8 KV cache: e4m3 rows, an fp32 scale per (token, KV head)


def assert_close_fp8_kv(out, ref, dtype, what):
    """assert_close for attention over an FP8 cache. The kernels scale scores and probabilities where
    the reference scales keys and values: in fp32 that rounds apart by ~1e-7 of a score, which
    fp8_paged_cache's spread of magnitudes (sharp softmaxes) can lift to ~1e-5 of the output; in
    bf16 the value scales ride on the bf16 probabilities, one rounding more than over a bf16 cache
    (which the interpreter truncates)."""
    assert not out.float().isnan().any(), f"{what}: unwritten (NaN) elements"
    err, bound = rel_err(out, ref), 1e-4 if dtype == torch.float32 else 1.5e-2
    assert err < bound, f"{what}: relative error {err:.2e} >= {bound:.0e}"


def fp8_paged_cache(num_blocks, block_size, nkv, hd, decades=4):
    """A random FP8 cache, its rows' magnitudes spread over `decades` powers of ten around 1 so the
    scales matter: (k_cache, v_cache, (k_scale, v_scale))."""
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(num_blocks, block_size, nkv, hd, device=DEVICE)
        x *= 10.0 ** (decades * (torch.rand(num_blocks, block_size, nkv, 1, device=DEVICE) - 0.5))
        xq, sc = rope.quantize_kv_ref(x)
        caches.append(xq)
        scales.append(sc)
    return caches[0], caches[1], tuple(scales)


def assert_same_codes(mine, want):
    """e4m3 codes equal, or one grid step apart where the GPU's fp32 division (not correctly rounded)
    put row / scale on the other side of a rounding midpoint than torch's."""
    a, b = mine.float(), want.float()
    assert not a.isnan().any()
    assert ((a - b).abs() <= e4m3_ulp(torch.maximum(a.abs(), b.abs()))).all()
    assert (a != b).float().mean() < 1e-3


def test_kv_quantisation_reference():
    """Each row: scale = amax / 448, every code the nearest e4m3 value of row / scale; a zero row
    stays zero; dequantised, the row is within e4m3's precision."""
    x = torch.randn(64, 4, 128, dtype=torch.float64) * 10.0 ** (4 * torch.rand(64, 4, 1) - 2)
    x[3, 1] = 0
    xq, sc = rope.quantize_kv_ref(x.float())
    keep = torch.arange(256) != 13
    assert_fp8_rows(xq.flatten(0, 1)[keep], sc.flatten()[keep], x.float().double().flatten(0, 1)[keep])
    assert (xq[3, 1].float() == 0).all()
    assert rel_err(rope.dequantize_kv_ref(xq, sc), x) < 2.0 ** -4


@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 9, 3, 64), (70, 8, 2, 128)])
def test_rope_stores_fp8_k_and_v(t, nh, nkv, hd):
    """The RoPE launch's KV store into an FP8 cache: the codes and scales write_kv_ref stores for
    the rotated k (as the model dtype holds it) and v, bit for bit."""
    dtype = torch.bfloat16
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)
    q = qkv[:, :nh * hd].view(t, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
    positions = torch.randint(0, 100_000, (t,), device=DEVICE)
    inv_freq = rope.rope_inv_freq(hd, 500000.0, None).to(DEVICE)
    num_blocks = t // 16 + 3
    k_cache, v_cache, scales = fp8_paged_cache(num_blocks, 16, nkv, hd)
    want = [k_cache.clone(), v_cache.clone(), scales[0].clone(), scales[1].clone()]
    slots = torch.randperm(num_blocks * 16, device=DEVICE)[:t]
    rope.apply_rope_triton(q, k, positions, inv_freq, (v, k_cache, v_cache, slots, scales))
    rope.write_kv_ref(k, v, want[0], want[1], slots, (want[2], want[3]))     # k: rotated in place
    assert torch.equal(scales[0], want[2]) and torch.equal(scales[1], want[3])
    assert_same_codes(k_cache, want[0])
    assert_same_codes(v_cache, want[1])


def check_decode_fp8(lens, nh, nkv, hd, dtype, num_splits):
    num_blocks = sum(-(-c // 16) for c in lens) + 3
    k_cache, v_cache, scales = fp8_paged_cache(num_blocks, 16, nkv, hd)
    tables = block_tables_for(lens, 16, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), nh, hd, device=DEVICE, dtype=dtype)
    out = attention.decode_attention(q, k_cache, v_cache, tables, ctx, hd ** -0.5, num_splits=num_splits,
                                     kv_scales=scales)
    ref = attention.decode_attention_ref(q, k_cache, v_cache, tables, ctx, hd ** -0.5, kv_scales=scales)
    assert_close_fp8_kv(out, ref, dtype, f"decode over an FP8 cache (splits {num_splits})")


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_fp8_cache(poisoned, dtype, num_splits):
    check_decode_fp8([1, 16, 37, 300], 8, 2, 128, dtype, num_splits)


def check_decode_rope_fp8(lens, nh, nkv, hd, num_splits):
    """new_kv into an FP8 cache: the kernel rotates, quantises and stores the row, then reads it back
    like every other key. Against the reference (output and cache), and bit for bit against the
    RoPE kernel storing the row, then the kernel without new_kv. (Rows of one magnitude: the kernel
    and torch may round a rotated q or k value one bf16 step apart, which a sharper softmax would
    amplify.)"""
    dtype, bs = torch.bfloat16, 16
    num_blocks = sum(-(-c // bs) for c in lens) + 3
    cache = fp8_paged_cache(num_blocks, bs, nkv, hd, decades=0)
    tables = block_tables_for(lens, bs, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    b = len(lens)
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, device=DEVICE, dtype=dtype)

    def split(t):
        return (t[:, :nh * hd].view(b, nh, hd), t[:, nh * hd:(nh + nkv) * hd].view(b, nkv, hd),
                t[:, (nh + nkv) * hd:].view(b, nkv, hd))

    def copy():
        return cache[0].clone(), cache[1].clone(), (cache[2][0].clone(), cache[2][1].clone())
    inv_freq = rope.rope_inv_freq(hd, 500000.0, LLAMA3_SCALING).to(DEVICE)
    caches = [copy() for _ in range(3)]
    q, k, v = split(qkv.clone())
    out = attention.decode_attention(q, *caches[0][:2], tables, ctx, hd ** -0.5, (k, v, inv_freq),
                                     num_splits=num_splits, kv_scales=caches[0][2])
    q, k, v = split(qkv.clone())
    ref = attention.decode_attention_ref(q, *caches[1][:2], tables, ctx, hd ** -0.5, (k, v, inv_freq),
                                         kv_scales=caches[1][2])
    assert_close_fp8_kv(out, ref, dtype, f"decode with RoPE into an FP8 cache (splits {num_splits})")
    for i in range(2):
        assert rel_err(caches[0][2][i], caches[1][2][i]) < 1e-2
        assert rel_err(rope.dequantize_kv_ref(caches[0][i], caches[0][2][i]),
                       rope.dequantize_kv_ref(caches[1][i], caches[1][2][i])) < 1e-2
    q, k, v = split(qkv.clone())
    pos = ctx.long() - 1
    slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs
    rope.apply_rope_triton(q, k, pos, inv_freq, (v, *caches[2][:2], slots, caches[2][2]))
    before = attention.decode_attention(q, *caches[2][:2], tables, ctx, hd ** -0.5, num_splits=num_splits,
                                        kv_scales=caches[2][2])
    assert torch.equal(out, before), "decode with RoPE differs from RoPE's kernel then decode"
    for a, c in zip((caches[0][0], caches[0][1], *caches[0][2]), (caches[2][0], caches[2][1], *caches[2][2])):
        assert torch.equal(a.view(torch.uint8) if a.dtype == rope.KV_FP8 else a,
                           c.view(torch.uint8) if c.dtype == rope.KV_FP8 else c)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_rope_fp8_cache(poisoned, num_splits):
    check_decode_rope_fp8([1, 17, 37, 300], 8, 2, 128, num_splits)


def check_prefill_fp8(q_lens, prefixes, nh, nkv, hd, dtype):
    bs = 16
    ctx_lens = [q + p for q, p in zip(q_lens, prefixes)]
    t = sum(q_lens)
    num_blocks = sum(-(-c // bs) for c in ctx_lens) + 2
    k_cache, v_cache, scales = fp8_paged_cache(num_blocks, bs, nkv, hd)
    tables = block_tables_for(ctx_lens, bs, num_blocks)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(t, n, hd, device=DEVICE, dtype=dtype) for n in (nh, nkv, nkv))
    out = attention.prefill_attention_triton(q, k, v, cu, ctx, tables, k_cache, v_cache, hd ** -0.5, max(prefixes),
                                             kv_scales=scales)
    ref = attention.prefill_attention_ref(q, k, v, cu, ctx, tables, k_cache, v_cache, hd ** -0.5, scales)
    assert_close_fp8_kv(out, ref, dtype, "prefill over an FP8 prefix")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_fp8_prefix(poisoned, dtype):
    """Chunks after cached prefixes in an FP8 cache (the prefix scaled, the chunk's own keys read
    unquantised), full and partial key tiles, and a fresh prompt beside them."""
    check_prefill_fp8([1, 70, 129, 40], [50, 300, 256, 0], 4, 2, 64, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_decode_attention_fp8_llama(poisoned, num_splits):
    check_decode_fp8([1, 1000, 4097, 8191], 32, 8, 128, torch.bfloat16, num_splits)
    check_decode_rope_fp8([1, 1000, 4097, 8191], 32, 8, 128, num_splits)


@pytest.mark.gpu
def test_gpu_prefill_attention_fp8_llama(poisoned):
    check_prefill_fp8([1, 200, 1000], [700, 100, 513], 32, 8, 128, torch.bfloat16)
    check_prefill_fp8([300, 1000], [3000, 2048], 32, 8, 128, torch.bfloat16)   # long prefixes: 3 stages


def test_fp8_cache_attention_against_the_unquantised_cache():
    """What the FP8 cache costs: decode attention over the quantised copy of a bf16 cache against
    the bf16 cache itself, in the reference (e4m3 keeps 3 mantissa bits: a few percent per value,
    averaged down by the softmax's weighted sums)."""
    nh, nkv, hd, bs = 8, 2, 128, 16
    lens = [64, 300, 1000]
    num_blocks = sum(-(-c // bs) for c in lens) + 1
    k_cache, v_cache = paged_cache(num_blocks, bs, nkv, hd, torch.float32)
    (kq, ks), (vq, vs) = rope.quantize_kv_ref(k_cache), rope.quantize_kv_ref(v_cache)
    tables = block_tables_for(lens, bs, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), nh, hd, device=DEVICE) * 0.3
    exact = attention.decode_attention_ref(q, k_cache, v_cache, tables, ctx, hd ** -0.5)
    fp8 = attention.decode_attention_ref(q, kq, vq, tables, ctx, hd ** -0.5, kv_scales=(ks, vs))
    assert rel_err(fp8, exact) < 4e-2


def test_fp8_cache_needs_its_scales():
    k_cache, v_cache, scales = fp8_paged_cache(4, 16, 2, 64)
    q = torch.randn(1, 4, 64, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scales"):
        attention.decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    bf16_cache = paged_cache(4, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="kv_scales"):
        attention.decode_attention(q, *bf16_cache, tables, ctx, 0.1, kv_scales=scales)


# --------------------------------------------------------------------------------------------------
# a decode step's inputs into its graph's static buffers


def graph_buffers(size, width):
    """Static buffers full of earlier steps' values (none is the scratch block's)."""
    return (torch.randint(0, 1000, (size,), device=DEVICE), torch.randint(0, 1000, (size,), device=DEVICE),
            torch.randint(0, 1000, (size,), device=DEVICE),
            torch.randint(2, 1000, (size,), device=DEVICE, dtype=torch.int32),
            torch.randint(0, 1000, (size, width), device=DEVICE, dtype=torch.int32))


@pytest.mark.parametrize("n,rows,width", [(3, 8, 5), (8, 8, 300), (1, 16, 1)])
def test_stage_decode_inputs(n, rows, width):
    """Rows < n take the step's values (only the first `width` table columns), rows n..rows-1 point
    at the scratch block, rows past `rows` and table columns past `width` keep what they held: the
    kernel's buffers equal the eight torch ops', element for element."""
    size, buf_width, scratch_slot, scratch_block = 20, 320, 7 * 16, 7
    src = (torch.randint(0, 1000, (n,), device=DEVICE), torch.randint(0, 1000, (n,), device=DEVICE),
           torch.randint(0, 1000, (n,), device=DEVICE),
           torch.randint(2, 1000, (n,), device=DEVICE, dtype=torch.int32),
           torch.randint(0, 1000, (3 * n, width), device=DEVICE, dtype=torch.int32)[::3])   # rows apart
    mine = graph_buffers(size, buf_width)
    want = tuple(t.clone() for t in mine)
    decode_inputs.stage_decode_inputs(mine, src, rows, scratch_slot, scratch_block)
    decode_inputs.stage_decode_inputs_ref(want, src, rows, scratch_slot, scratch_block)
    for name, a, b in zip(("input_ids", "positions", "slot_mapping", "context_lens", "block_tables"), mine, want):
        assert torch.equal(a, b), name
    assert (want[2][n:rows] == scratch_slot).all() and (want[4][n:rows] == scratch_block).all()


def test_stage_decode_inputs_refuses_what_does_not_fit():
    dst = graph_buffers(8, 16)
    src = graph_buffers(4, 32)
    with pytest.raises(ValueError, match="width 32"):
        decode_inputs.stage_decode_inputs(dst, src, 8, 0, 0)
    with pytest.raises(ValueError, match="into 2"):
        decode_inputs.stage_decode_inputs(dst, graph_buffers(4, 8), 2, 0, 0)
