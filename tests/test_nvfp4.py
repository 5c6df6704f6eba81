"""NVFP4: the format against hand-computed cases, the blocked scale layout against its definition,
the Triton kernels against the reference (interpreter on the CPU, compiled on the GPU), the kernel
selection per architecture, the CuTe DSL kernel compiled for sm_100, and the GPU kernels on Llama
shapes."""
import importlib.util
import itertools
import re

import torch

import pytest

from engine.formats import nvfp4 as nv
from tests.cute_ptx import compile_in_subprocess
from tests.numerics import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- the format ----------------------------------------------------------------------------------

def test_decode_all_16_code_points():
    # Written out by hand from the e2m1 definition: s e1 e0 m, bias 1, subnormal at e = 0.
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = nv.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == expected


def test_round_trip_every_code_point_exactly():
    # One row whose first block holds all 16 code values times c, second block random codes:
    # the tensor amax is 6c, so the tensor scale is 6c/2688 and the first block scale is exactly
    # 448; every value then sits on a code point and must come back unchanged.
    c = float(torch.empty(()).uniform_(0.1, 10))
    values = nv.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    second = nv.e2m1_decode(torch.randint(0, 16, (16,), dtype=torch.uint8))
    second[0] = 6.0
    w = torch.cat([values, second]).unsqueeze(0) * c
    q = nv.quantize(w)
    assert q.block_scale.float().tolist() == [[448.0, 448.0]]
    torch.testing.assert_close(q.tensor_scale, torch.tensor(6 * c / 2688), rtol=1e-6, atol=0)
    torch.testing.assert_close(nv.dequantize(q), w, rtol=1e-6, atol=0)
    codes = nv.unpack_nibbles(q.packed)[0, :16]
    # -0 quantises to +0 (code 0); every other code is recovered.
    assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]


def test_rounding_ties_to_even_and_saturation():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # Ties go to the code with mantissa 0: 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0.
    assert nv.e2m1_round(midpoints).tolist() == [0, 2, 2, 4, 4, 6, 6]
    eps = 1e-3
    assert nv.e2m1_round(midpoints + eps).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert nv.e2m1_round(midpoints - eps).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert nv.e2m1_round(torch.tensor([6.0, 6.5, 1e6])).tolist() == [7, 7, 7]


def test_saturation_at_six_times_the_stored_block_scale():
    # Block amax 6.2 with tensor scale 1: the block scale 6.2/6 = 1.033 rounds to e4m3 1.0, so
    # 6.2 exceeds 6 x scale and must saturate to 6, -6.2 to -6; nothing overflows to NaN/inf.
    w = torch.randn(1, 16) * 0.5
    w[0, 3], w[0, 9] = 6.2, -6.2
    q = nv.quantize(w, tensor_scale=torch.tensor(1.0))
    assert q.block_scale.float().item() == 1.0
    dq = nv.dequantize(q)
    assert dq[0, 3].item() == 6.0 and dq[0, 9].item() == -6.0
    assert torch.isfinite(dq).all()


def test_zero_blocks_quantise_to_zero():
    w = torch.randn(3, 64)
    w[1, 16:32] = 0
    w[2, :] = 0
    q = nv.quantize(w)
    assert q.block_scale[1, 1].float().item() == 0 and (q.block_scale[2].float() == 0).all()
    dq = nv.dequantize(q)
    assert torch.isfinite(dq).all()
    assert (dq[1, 16:32] == 0).all() and (dq[2] == 0).all()
    assert (dq[0] != 0).any()


def test_nibble_order_low_is_even_k():
    assert nv.pack_nibbles(torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)).tolist() == [
        [0x21, 0x8F]]


def test_quantisation_error_within_half_a_step():
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3
    q = nv.quantize(w)
    scale = (q.block_scale.float() * q.tensor_scale).repeat_interleave(16, dim=1)
    a = (w.abs() / scale)
    # Half the gap between neighbouring code points: 0.25 up to 2, 0.5 up to 4, then 1
    # (beyond 6 only through e4m3 rounding of the scale, at most 6/16, still under 1).
    half_step = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    assert ((nv.dequantize(q) - w).abs() <= half_step * scale * (1 + 1e-6)).all()
    assert 0.05 < rel_err(nv.dequantize(q), w) < 0.15  # e2m1 on Gaussian data: about 0.1


def test_to_blocked_matches_its_index_definition():
    rows, cols = 200, 7  # both padded: to 256 rows, 8 columns
    scales = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    blocked = nv.to_blocked(scales)
    col_tiles = 2
    assert blocked.numel() == 256 * 8
    expected = torch.zeros(256 * 8, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * col_tiles + c // 4
            offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            expected[offset] = scales[r, c]
    assert torch.equal(blocked, expected)


def test_tiled_storage_matches_its_index_definition():
    # Tiles of 16 rows x 128 K: packed[b, s, r, c] = row-major packed[16b + r, 64s + c], scales
    # likewise with 8 per tile row; to_rows inverts it; shapes that do not tile are refused.
    w = nv.quantize(torch.randn(48, 384) * torch.rand(48, 1))
    t = nv.to_tiles(w)
    assert t.tiled and not w.tiled and t.shape == w.shape
    assert t.packed.shape == (3, 3, 16, 64) and t.block_scale.shape == (3, 3, 16, 8)
    for b, s_, r in ((0, 0, 0), (2, 1, 15), (1, 2, 7)):
        assert torch.equal(t.packed[b, s_, r], w.packed[16 * b + r, 64 * s_:64 * s_ + 64])
        assert torch.equal(t.block_scale[b, s_, r].view(torch.uint8),
                           w.block_scale[16 * b + r, 8 * s_:8 * s_ + 8].view(torch.uint8))
    back = nv.to_rows(t)
    assert torch.equal(back.packed, w.packed)
    assert torch.equal(back.block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))
    assert torch.equal(nv.dequantize(t), nv.dequantize(w))
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    torch.testing.assert_close(nv.nvfp4_linear_op(x, t.packed, t.block_scale, t.tensor_scale),
                               nv.nvfp4_linear_reference(x, w))
    with pytest.raises(ValueError, match="tiled storage"):
        nv.to_tiles(nv.quantize(torch.randn(40, 384)))


def test_backend_from_dense():
    w = torch.randn(96, 128, dtype=torch.bfloat16)
    backend = nv.Nvfp4Weight.from_dense(w)
    assert backend.weight_bytes() == 96 * 64 + 96 * 8 + 4
    dq = backend.dequantize()
    assert dq.dtype == torch.bfloat16 and dq.shape == w.shape
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    y = backend.forward(x)
    ref = x.double() @ nv.dequantize(backend.tensor).double().t()
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 5e-3


def test_backend_on_the_cpu_tunes_nothing():
    class Tuner:
        enabled = True

        def best(self, problem, candidates):
            raise AssertionError("off CUDA the tuner is never asked")
    backend = nv.Nvfp4Weight.from_dense(torch.randn(64, 128, dtype=torch.bfloat16))
    backend.tune(Tuner(), [1, 16, 64], swiglu=True)
    assert backend.tuned == {}


def test_custom_op_matches_reference_and_passes_opcheck():
    w = nv.quantize(torch.randn(48, 64))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    args = (x, w.packed, w.block_scale, w.tensor_scale)
    torch.testing.assert_close(nv.nvfp4_linear_op(*args), nv.nvfp4_linear_reference(x, w))
    # (test_schema is left out: its input-mutation check cannot compare fp8 tensors on the CPU)
    torch.library.opcheck(nv.nvfp4_linear_op, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_static"))


def test_kernel_selection_per_architecture():
    # What nvfp4_linear runs, by architecture and M (engine/kernels/select.py), faked on the CPU:
    # sm_90: the Gluon mma.sync decode to M = 4, the Gluon wgmma decode to 16, Triton decode to 128,
    # then decode to FP8 + the CuTe DSL FP8 GEMM
    # on e4m3 activations (decode to bf16 + cuBLAS without CuTe DSL or where N % 64 != 0); sm_100:
    # the CuTe DSL kernel on row-major storage where installed; fp32 activations or K % 64 only the
    # reference.
    from engine.kernels.platform import cute_available, fake_capability
    from engine.kernels.select import Problem, clear_cache, select

    def pick(m, n=4096, k=4096, dtype=torch.bfloat16, tiled=True, table=nv.NVFP4_GEMM, op="nvfp4_gemm",
             device="cuda"):
        return select(table, Problem(op, m, n, k, torch.device(device), (dtype, tiled))).kernel.name
    clear_cache()
    try:
        with fake_capability((9, 0)):
            if cute_available():
                assert [pick(m) for m in (1, 3, 4, 5, 9, 16, 17, 64, 128, 129, 200, 2048)] == (
                    ["gluon_decode"] * 3 + ["gluon_wgmma_decode"] * 3 + ["triton_decode"] * 3
                    + ["fp8_dequantize_wgmma"] * 3)
                assert pick(200, n=4000) == "dequantize_cublas"
            else:
                assert pick(200) == "dequantize_cublas"
            assert pick(1, k=576, tiled=False) == "gluon_decode"
            assert pick(1, k=576, tiled=True) == "triton_decode"  # Gluon reads tiles 128 K deep
            assert pick(16, k=576, tiled=False) == "gluon_wgmma_decode"
            assert pick(16, k=576, tiled=True) == "triton_decode"
            with pytest.warns(RuntimeWarning, match="reference"):
                assert pick(3, k=4000) == "reference"
            with pytest.warns(RuntimeWarning, match="reference"):
                assert pick(3, dtype=torch.float32) == "reference"
            swiglu = dict(table=nv.NVFP4_SWIGLU, op="nvfp4_swiglu")
            assert [pick(m, n=8192, **swiglu) for m in (1, 4, 5, 16, 17)] == (
                ["gluon_decode_swiglu"] * 2 + ["gluon_wgmma_decode_swiglu"] * 2 + ["separate"])
        with fake_capability((10, 0)):
            first = "cute_tcgen05_sm100" if cute_available() else "triton_decode"
            assert pick(1, tiled=False) == first and pick(1, tiled=True) == "triton_decode"
            assert pick(2048, tiled=False) == ("cute_tcgen05_sm100" if cute_available() else "dequantize_cublas")
            assert pick(1, n=8192, **dict(table=nv.NVFP4_SWIGLU, op="nvfp4_swiglu")) == "separate"
        assert pick(1, device="cpu") == "reference" and pick(2048, device="cpu") == "reference"
        emulated = dict(table={"other": nv.sm90_reference_kernels()}, op="nvfp4_sm90_emulated", device="cpu")
        assert [pick(m, **emulated) for m in (128, 200)] == ["sm90_w4a16_reference", "sm90_fp8_path_reference"]
        assert pick(200, n=4000, **emulated) == "sm90_dequantize_reference"    # as on sm_90: W4A16
    finally:
        clear_cache()


def test_fp8_path_takes_e4m3_from_the_norm_and_the_swiglu(monkeypatch):
    """Where the NVFP4 kernel for M multiplies e4m3 activations (sm_90 past 128 rows; here a kernel
    list of two references on the CPU), the post-attention RMSNorm and the SwiGLU write them
    quantised: the GEMM quantises only o_proj's input (the attention's output) itself. The layer's
    output agrees with the one where every GEMM quantises its bf16 input itself, and both with
    W4A16's, to what e4m3 rounding explains; at 128 rows and under, every GEMM takes bf16."""
    from dataclasses import replace

    from engine.kernels.select import clear_cache
    from models.llama import LlamaDecoderLayer
    from models.presets import LlamaConfig
    calls, inside = [], []

    def recorded(run):
        def call(x, *args, **kwargs):
            calls.append(x.dtype)
            return run(x, *args, **kwargs)
        return call
    w4a16, fp8_path, _ = (replace(k, run=recorded(k.run)) for k in nv.sm90_reference_kernels())
    assert w4a16.max_m == 128 and fp8_path.input_quant == "fp8"
    monkeypatch.setitem(nv.NVFP4_GEMM, "other", [w4a16, fp8_path])
    quantize = nv.quantize_act_fp8
    monkeypatch.setattr(nv, "quantize_act_fp8", lambda x: inside.append(tuple(x.shape)) or quantize(x))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                      num_kv_heads=1)
    layer = LlamaDecoderLayer(cfg, 0, dtype=torch.bfloat16)
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape) * 0.05)
            lin.convert("nvfp4")
    clear_cache()
    try:
        for m in (200, 128):
            o, residual = torch.randn(m, 128, dtype=torch.bfloat16), torch.randn(m, 128, dtype=torch.bfloat16)
            calls.clear(), inside.clear()
            y, _ = layer.after_attention(o, residual)
            if m <= 128:
                assert calls == [torch.bfloat16] * 3 and inside == []
                continue
            assert calls == [torch.float8_e4m3fn] * 3 and inside == [(m, 128)]
            with monkeypatch.context() as patch:
                patch.setattr(nv.Nvfp4Weight, "input_quant", lambda self, m: None)
                y_inside, _ = layer.after_attention(o, residual)
            assert inside == [(m, 128), (m, 128), (m, 128), (m, 256)]
            with monkeypatch.context() as patch:    # W4A16 at every M: no activation rounded to e4m3
                patch.setitem(nv.NVFP4_GEMM, "other", [replace(w4a16, max_m=None)])
                clear_cache()
                y_w4a16, _ = layer.after_attention(o, residual)
            clear_cache()
            # Two e4m3 roundings of the same activations differ by a step here and there; the FP8
            # weights and activations move the layer's output ~6% from W4A16's on random weights.
            assert rel_err(y, y_inside) < 0.05
            assert rel_err(y, y_w4a16) < 0.1 and rel_err(y_inside, y_w4a16) < 0.1
    finally:
        clear_cache()


# --- the Triton kernels: interpreter on the CPU, compiled on the GPU ----------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k,config", [
    (1, 64, 64, None),
    (3, 70, 128, None),  # N tail
    (16, 200, 576, None),  # K = 9 x 64, N tail
    (5, 100, 512, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WPT=2, SPLIT_K=2, num_warps=4,
                       num_stages=1)),
    (3, 64, 1024, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, WPT=1, SPLIT_K=4, num_warps=4,
                       num_stages=1)),
    (16, 70, 512, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, WPT=4, SPLIT_K=1, num_warps=4,
                       num_stages=1)),
    (33, 70, 256, None),  # 64-token tile, N tail
    (100, 48, 256, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, WPT=4, SPLIT_K=1, num_warps=4,
                        num_stages=1)),  # 128-token tile
    (17, 64, 576, None),  # 32-token tile, K = 9 x 64
    (64, 100, 512, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, WPT=4, SPLIT_K=2, num_warps=4,
                        num_stages=1)),
])
def test_triton_decode_kernel_small(m, n, k, config):
    # The decode kernel's logical K order and split-K reduction, through the interpreter's
    # arithmetic decode (the PTX decode is checked against that decode below, and on the GPU).
    from engine.kernels.nvfp4_triton import decode_gemm
    w = nv.quantize(torch.randn(n, k, device=DEVICE) * torch.rand(n, 1, device=DEVICE))
    ref = None
    for _ in range(2):  # twice: the split-K accumulator and counters must be back at zero
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        out = torch.full((m, n), float("nan"), device=DEVICE)
        decode_gemm(x, w, out, config)
        ref = x.double() @ nv.dequantize(w).double().t()
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-5


def _bf16_bits_to_float(bits: int) -> float:
    import struct
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _run_decode_ptx(ptx: str, operands: dict) -> dict:
    """Execute the decoders' PTX in Python: and, mul.lo, shr, shl, mov (of a register or of a pair
    of 16-bit halves), cvt.u32.u16, prmt (both modes), lop3 (a | (b & c) only), mul.rn.bf16x2 and
    mul.rn.f16x2, whose products are computed exactly (they are exact on the GPU: <= 6 significant
    bits; subnormals included), and cvt.rn.satfinite.e4m3x2.f16x2 (upper half to the upper byte,
    rounded as torch rounds to float8_e4m3fn)."""
    import re
    import struct
    def f16(bits):
        return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]

    def f16_bits(value):
        bits = struct.unpack("<H", struct.pack("<e", value))[0]
        assert f16(bits) == value, "inexact f16 product"
        return bits

    def e4m3(value):
        return torch.tensor([value]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    regs = dict(operands)
    for line in ptx.splitlines():
        m = re.match(r"([a-z0-9.]+) ([^;]+);", line.strip())
        if not m or m.group(1).startswith("."):
            continue
        pair = re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", m.group(2))
        if m.group(1) == "mov.b32" and pair:   # two 16-bit halves, the first one low
            regs[pair.group(1)] = regs[pair.group(2)] & 0xFFFF | (regs[pair.group(3)] & 0xFFFF) << 16
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        d, vals = args[0], [regs[a] if a in regs else int(a, 0) for a in args[1:]]
        if op == "and.b32":
            regs[d] = vals[0] & vals[1]
        elif op == "mul.lo.u32":
            regs[d] = (vals[0] * vals[1]) & 0xFFFFFFFF
        elif op in ("shr.u32", "shr.b32"):
            regs[d] = vals[0] >> vals[1]
        elif op == "shl.b32":
            regs[d] = (vals[0] << vals[1]) & 0xFFFFFFFF
        elif op in ("mov.b32", "cvt.u32.u16"):
            regs[d] = vals[0] & (0xFFFF if op == "cvt.u32.u16" else 0xFFFFFFFF)
        elif op == "prmt.b32":
            pool = vals[0] | vals[1] << 32
            sel = [(vals[2] >> (4 * i)) & 0xF for i in range(4)]
            picked = [(pool >> (8 * (s_ & 7))) & 0xFF for s_ in sel]
            # selector bit 3: the byte's top bit replicated over the byte (sign-replicate mode)
            picked = [(0xFF if b_ & 0x80 else 0) if s_ & 8 else b_ for s_, b_ in zip(sel, picked)]
            regs[d] = sum(b_ << (8 * i) for i, b_ in enumerate(picked))
        elif op == "lop3.b32":
            assert vals[3] == 0xF8, "only a | (b & c) is modelled"
            regs[d] = vals[0] | (vals[1] & vals[2])
        elif op == "mul.rn.f16x2":
            regs[d] = (f16_bits(f16(vals[0]) * f16(vals[1]))
                       | f16_bits(f16(vals[0] >> 16) * f16(vals[1] >> 16)) << 16)
        elif op == "cvt.rn.satfinite.e4m3x2.f16x2":
            regs[d] = e4m3(f16(vals[0])) | e4m3(f16(vals[0] >> 16)) << 8
        elif op == "mul.rn.bf16x2":
            lanes = []
            for shift in (0, 16):
                prod = _bf16_bits_to_float(vals[0] >> shift) * _bf16_bits_to_float(vals[1] >> shift)
                f32 = struct.unpack("<I", struct.pack("<f", prod))[0]
                assert f32 & 0xFFFF == 0, "inexact bf16 product"
                lanes.append(f32 >> 16)
            regs[d] = lanes[0] | lanes[1] << 16
        else:
            raise AssertionError(f"unmodelled instruction {op}")
    return regs


def test_decode_ptx_matches_arithmetic_decode():
    # The PTX decode (modelled instruction by instruction above) against the element order the
    # interpreter path uses: register (r8, h, b) lane p of a thread's fragment holds nibble
    # h + 2b + 4p of its row's word, times the block scale x 2^-8 (bf16 exact, any e4m3 scale).
    from engine.kernels.nvfp4_triton import _decode_ptx
    ptx = _decode_ptx()
    codes = torch.arange(16, dtype=torch.uint8)
    for trial in range(64):
        nibbles = [int(c) for c in codes[torch.randperm(16)][:8]] if trial else list(range(8))
        word = sum(c << (4 * i) for i, c in enumerate(nibbles))
        word8 = int(torch.randint(0, 2**32, ()).item())
        scales = [float(v) for v in nv.E2M1_MAGNITUDES[1:]] + [2.0 ** -9, 448.0, 0.0]
        s0, s8 = (torch.tensor(scales)[torch.randint(0, len(scales), (2,))] *
                  torch.tensor(2.0 ** 118)).bfloat16().view(torch.int16).int().tolist()
        operands = {f"${i}": 0 for i in range(40)}
        operands.update({"$8": word, "$10": word8, "$24": (s0 & 0xFFFF) * 0x10001,
                         "$26": (s8 & 0xFFFF) * 0x10001})
        regs = _run_decode_ptx(ptx, operands)
        for r8, w_, s in ((0, word, s0), (1, word8, s8)):
            scale = _bf16_bits_to_float(s) * 2.0 ** -118
            for h in (0, 1):
                for b in (0, 1):
                    for p in (0, 1):
                        got = _bf16_bits_to_float(regs[f"${r8 + 2 * h + 4 * b}"] >> (16 * p))
                        code = (w_ >> (4 * (h + 2 * b + 4 * p))) & 0xF
                        want = float(nv.e2m1_decode(torch.tensor([code], dtype=torch.uint8)))
                        assert got == want * scale * 2.0 ** -8, (trial, r8, h, b, p, code)


def test_e4m3_decode_ptx_matches_to_fp8():
    # The FP8-rows decode's PTX (modelled instruction by instruction above): every code in every
    # nibble, signs included, times every finite block scale (subnormals and 0 included), gives
    # to_fp8's e4m3 value, each packed byte's two codes in K order (even K in the low byte).
    from engine.kernels.nvfp4_triton import FP8_SHIFT, _e2m1_to_e4m3_ptx
    ptx = _e2m1_to_e4m3_ptx()
    scale_codes = torch.arange(0, 0x7F, dtype=torch.uint8)     # 0x7F is NaN; block scales are >= 0
    for trial in range(32):     # nibble i holds code (trial + 3i) % 16; byte j scale (4 trial + j) % 127
        nibbles = [(trial + 3 * i) % 16 for i in range(8)]
        word = sum(c << (4 * i) for i, c in enumerate(nibbles))
        scales = scale_codes[[(4 * trial + j) % 127 for j in range(4)]].view(torch.float8_e4m3fn).float()
        halves = (scales / FP8_SHIFT.value).half().view(torch.int16).int().tolist()
        regs = _run_decode_ptx(ptx, {"$2": word, "$3": halves[0] & 0xFFFF | (halves[1] & 0xFFFF) << 16,
                                     "$4": halves[2] & 0xFFFF | (halves[3] & 0xFFFF) << 16})
        out = torch.tensor([(regs[f"${i // 4}"] >> (8 * (i % 4))) & 0xFF for i in range(8)], dtype=torch.uint8)
        codes = torch.tensor(nibbles, dtype=torch.uint8)
        want = (nv.e2m1_decode(codes) * scales.repeat_interleave(2) / FP8_SHIFT.value).to(torch.float8_e4m3fn)
        assert torch.equal(out.view(torch.float8_e4m3fn).float(), want.float()), (trial, nibbles, scales)


def test_gluon_scale_asm_every_e4m3_code():
    # The Gluon kernel's block-scale conversion: 2 (u16) or 4 (u32) e4m3 codes -> as many bf16x2
    # words, each s x 2^118 twice, exact for every finite non-negative code, subnormals included.
    from engine.kernels.nvfp4_gluon import _SCALE2_ASM, _SCALE4_ASM
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN; block scales are >= 0
    values = codes.view(torch.float8_e4m3fn).double().tolist()
    for asm, count in ((_SCALE2_ASM, 2), (_SCALE4_ASM, 4)):
        picks = torch.stack([torch.randperm(127) for _ in range(count)], 1).tolist()
        for trial in picks:
            packed = sum(code << (8 * i) for i, code in enumerate(trial))
            regs = _run_decode_ptx(asm.value, {f"${count}": packed})
            for i, code in enumerate(trial):
                for half in (0, 16):
                    got = _bf16_bits_to_float(regs[f"${i}"] >> half)
                    assert got == values[code] * 2.0 ** 118, (count, code, got)


def test_gluon_decode_asm_nibble_order():
    # The Gluon kernel's decode of one word: register j lane p holds nibble j + 4p, times the
    # scale (given as s x 2^118) x 2^-126 (the e2m1 bits decoded by position): value x s x 2^-8.
    from engine.kernels.nvfp4_gluon import _DECODE_ASM
    magnitudes = [float(v) for v in nv.E2M1_MAGNITUDES[1:]] + [2.0 ** -9, 448.0, 0.0, 0.75]
    for trial in range(64):
        word = int(torch.randint(0, 2**32, ()).item()) if trial else 0x76543210
        scale = magnitudes[trial % len(magnitudes)]
        bits = int(torch.tensor(scale * 2.0 ** 118).bfloat16().view(torch.int16).item()) & 0xFFFF
        regs = _run_decode_ptx(_DECODE_ASM.value, {"$4": word, "$12": bits * 0x10001})
        for j in range(4):
            for p in (0, 1):
                code = (word >> (4 * (j + 4 * p))) & 0xF
                want = float(nv.e2m1_decode(torch.tensor([code], dtype=torch.uint8)))
                got = _bf16_bits_to_float(regs[f"${j}"] >> (16 * p))
                assert got == want * scale * 2.0 ** -8, (trial, j, p, code)


# Run-time arguments of the Gluon decode kernel, for compiling it on the CPU.
GLUON_ARGS = dict(x_ptr="*bf16", words_ptr="*i32", scale_ptr="*u8", tensor_scale_ptr="*fp32", out_ptr="*bf16",
                  acc_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", stride_xm="i32", stride_om="i32")


def test_gluon_decode_kernel_compiles_for_sm90():
    # Compiled on the CPU for sm_90: the K loop is mma.sync on registers only. Packed words arrive
    # 16 bytes a thread straight in the MMA's A-operand registers, x as 16-byte vectors; no shared
    # memory in the loop, none at all where the warps split rows only (WK = 1, no split-K); with
    # WK = 4 the warps' K slices meet once, after the loop.
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from gluon_ptx import compile_sm90, ptx_loops
    from engine.kernels.nvfp4_gluon import nvfp4_decode_kernel

    def compile_decode(k, block_n, wpt, mp, wk, split_k=1, tiled=False):
        return compile_sm90(nvfp4_decode_kernel, GLUON_ARGS, {"K": k, "BLOCK_N": block_n, "WPT": wpt,
                                                               "MP": mp, "WK": wk, "SPLIT_K": split_k,
                                                               "TILED": tiled})
    # Row-major and tiled storage (engine/formats/nvfp4.py) compile to the same loop.
    for block_n, wk, mp, tiled in ((64, 1, 8, False), (16, 4, 16, False), (64, 1, 8, True),
                                   (32, 2, 16, True)):
        ptx = compile_decode(4096, block_n, 4, mp, wk, tiled=tiled)
        loops = ptx_loops(ptx)
        assert len(loops) == 1, len(loops)
        body = loops[0]
        # Per thread and loop body (2 K steps of 128): 2 16-row blocks' worth of 16-byte word
        # loads (rows g and g+8) over the warp's 64 // (16 * (4 // wk)) blocks, 8 k16 MMAs per
        # block, step and 8-token tile.
        blocks = block_n // (16 * (4 // wk))
        vector_loads = body.count("ld.global.v4.b32")
        assert vector_loads == 2 * 2 * blocks + 2 * 4 * (mp // 8), vector_loads
        mmas = body.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
        assert mmas == 2 * 8 * blocks * (mp // 8), mmas
        assert "shared" not in body and "bar.sync" not in body
        shared = ptx.count("ld.shared") + ptx.count("st.shared")
        assert (shared == 0) if wk == 1 else (shared > 0), shared
    # Small K: one K step per warp, odd step counts (K = 64: 1 step; 256 over 2 warps: 1 each;
    # 704: 11), as llama-tiny's layers and any K a multiple of 64 give.
    for k, block_n, wk, wpt in ((64, 64, 1, 2), (256, 32, 2, 4), (704, 64, 1, 2)):
        assert "mma.sync.aligned.m16n8k16" in compile_decode(k, block_n, wpt, 8, wk), k
    # Split-K: the partial sums meet in one launch (atomics, a CTA barrier: thread_barrier in
    # Triton 3.6, barrier later; both compile).
    ptx = compile_decode(14336, 16, 4, 8, 4, split_k=4)
    assert re.search(r"\b(atom|red)\.global", ptx)
    assert not re.search(r"\b(atom|red)\.global", compile_decode(14336, 16, 4, 8, 4))


def test_gluon_wgmma_decode_kernel_compiles_for_sm90():
    # Compiled on the CPU for sm_90: per loop body (2 K steps of 128) each thread loads 2 x 2
    # 16-byte weight vectors per 16-row block straight into registers, feeding wgmma's A operand
    # (m64 n8 / n16 k16, 8 per step and 64-row block); x travels through registers (16-byte loads)
    # into the shared-memory ring, which wgmma reads through its descriptors: the loop stores to
    # shared memory but never loads from it, and synchronises the CTA.
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_ptx import compile_sm90, ptx_loops
    from engine.kernels.nvfp4_gluon import nvfp4_wgmma_decode_kernel

    for block_n, mp, warps, split_k, tiled, swiglu in ((64, 16, 4, 4, True, False), (128, 8, 4, 1, False, True),
                                                       (128, 16, 8, 2, True, False), (256, 16, 8, 4, True, True)):
        ptx = compile_sm90(nvfp4_wgmma_decode_kernel, GLUON_ARGS,
                           {"K": 4096, "BLOCK_N": block_n, "WPT": 4, "MP": mp, "SPLIT_K": split_k,
                            "TILED": tiled, "SWIGLU": swiglu}, num_warps=warps)
        loops = ptx_loops(ptx)
        assert len(loops) == 1, len(loops)
        body = loops[0]
        blocks = block_n // (16 * warps)  # 16-row blocks per warp
        assert body.count(f"wgmma.mma_async.sync.aligned.m64n{mp}k16.f32.bf16.bf16") == 2 * 8 * blocks
        x_vectors = 2 * mp * 128 // (8 * 32 * warps)  # a step's x, 8 bf16 a thread
        assert body.count("ld.global.v4.b32") == 2 * 2 * blocks + x_vectors, body.count("ld.global.v4.b32")
        assert "ld.shared" not in body and "st.shared" in body and "bar.sync" in body
        assert "mma.sync" not in ptx
        assert bool(re.search(r"\b(atom|red)\.global", ptx)) == (split_k > 1)
    # Short K: one, two or three steps per program (no loop iteration), and the row-major K of 64.
    for k, wpt, split_k in ((128, 4, 1), (256, 4, 1), (384, 4, 1), (576, 2, 3), (64, 2, 1)):
        ptx = compile_sm90(nvfp4_wgmma_decode_kernel, GLUON_ARGS,
                           {"K": k, "BLOCK_N": 64, "WPT": wpt, "MP": 16, "SPLIT_K": split_k})
        assert ptx.count("wgmma.mma_async") == k // split_k // 16, k


def test_gluon_decode_configurations_do_not_spill():
    # Every launch configuration the NVFP4 format's Gluon kernels take at the decoder GEMMs and LM
    # head of the single-GPU presets (H100 PCIe / SXM and H200 SM counts, M up to each kernel's
    # limit, gate/up with and without the SwiGLU epilogue) assembles for sm_90a with no register
    # spilled to local memory: a spill in the K loop would put a memory round trip between the
    # weight loads (ptxas of the installed Triton; the GPU runs may use another release).
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_ptx import compile_sm90, preset_gemms, ptxas_usage
    from engine.kernels import nvfp4_gluon as g

    launches = {}
    for role, n, k in preset_gemms("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"):
        for sms, m, swiglu in itertools.product((114, 132), (1, 2, 4, 8, 16), (False, True)):
            if swiglu and role != "gate_up":
                continue
            kernels = [(g.nvfp4_wgmma_decode_kernel, g.wgmma_config(m, n, k, sms, swiglu=swiglu))]
            if m <= 4:
                kernels.append((g.nvfp4_decode_kernel, (g.swiglu_config if swiglu else g.decode_config)(m, n, k, sms)))
            for kernel, cfg in kernels:
                constexprs = dict(cfg, K=k, MP=8 if m <= 8 else 16, TILED=True, SWIGLU=swiglu)
                warps = constexprs.pop("num_warps")
                launches[(kernel.fn.__name__, warps, *sorted(constexprs.items()))] = (kernel, constexprs, warps)
    assert len(launches) > 10
    for key, (kernel, constexprs, warps) in launches.items():
        registers, spilled = ptxas_usage(compile_sm90(kernel, GLUON_ARGS, constexprs, num_warps=warps))
        assert spilled == 0, (key, registers, spilled)


@pytest.mark.interpreter
def test_triton_kernels_read_tiled_storage():
    # Every Triton kernel on a weight stored in 16-row x 128-K tiles: the decode kernel (16-, 32-
    # and 64-token tiles, split-K), dequantisation; a 64-deep K step is refused.
    from engine.kernels import nvfp4_triton as dec
    for m, n, k, config in [(1, 64, 256, None), (5, 96, 512, None), (33, 80, 256, None),
                            (3, 64, 1024, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, WPT=2, SPLIT_K=4,
                                               num_warps=4, num_stages=1))]:
        w = nv.quantize(torch.randn(n, k, device=DEVICE) * torch.rand(n, 1, device=DEVICE))
        t = nv.to_tiles(w)
        for _ in range(2):
            x = torch.randn(m, k, device=DEVICE).bfloat16()
            out = torch.full((m, n), float("nan"), device=DEVICE)
            dec.decode_gemm(x, t, out, config)
            assert not out.isnan().any()
            assert rel_err(out, x.double() @ nv.dequantize(w).double().t()) < 1e-5, (m, n, k)
        torch.testing.assert_close(dec.dequantize_bf16(t, torch.float32), nv.dequantize(w), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="multiple of 128"):
        dec.decode_gemm(torch.randn(2, 256, device=DEVICE).bfloat16(),
                        nv.to_tiles(nv.quantize(torch.randn(32, 256, device=DEVICE))),
                        torch.empty(2, 32, device=DEVICE), dec.small_m_config(2, 32, 256, 4, block_n=32, block_k=64))


@pytest.mark.interpreter
def test_triton_dequantize_small():
    from engine.kernels.nvfp4_triton import dequantize_bf16
    w = nv.quantize(torch.randn(70, 320)).to(DEVICE)
    got = dequantize_bf16(w, torch.float32)
    torch.testing.assert_close(got, nv.dequantize(w), rtol=1e-6, atol=0)


def check_fp8_rows(w, got_q, got_scale):
    """The kernel's FP8 rows equal to_fp8's (as values: a code of -0 may come out +0); to_fp8 is
    within e4m3's rounding of the weight: half a unit in the 4th significant bit (2^-4 relative),
    or, below e4m3's normal range (2^-6), half its subnormal step (2^-10)."""
    q, scale = nv.to_fp8(w)
    assert torch.equal(got_q.float().cpu(), q.float().cpu())
    assert torch.equal(got_scale.cpu(), scale.cpu())
    exact = nv.dequantize(w).cpu() / scale.cpu()[:, None]    # on q's scale, up to fp32 rounding
    err = (q.float().cpu() - exact).abs()
    bound = torch.where(exact.abs() >= 2.0 ** -6, exact.abs() * 2.0 ** -4, 2.0 ** -10)
    assert (err <= bound * (1 + 1e-5)).all()
    assert 0 < rel_err(q.float().cpu(), exact) < 0.05   # the rounding is real, and small


@pytest.mark.interpreter
@pytest.mark.parametrize("n,k,tiled", [(70, 320, False), (48, 512, True)])
def test_triton_dequantize_fp8_small(n, k, tiled):
    from engine.kernels.nvfp4_triton import dequantize_fp8
    w = nv.quantize(torch.randn(n, k) * torch.rand(n, 1)).to(DEVICE)
    w = nv.to_tiles(w) if tiled else w
    q = torch.full((n, k), 1.0, device=DEVICE).to(torch.float8_e4m3fn)
    scale = torch.full((n,), float("nan"), device=DEVICE)
    dequantize_fp8(w, q, scale)
    check_fp8_rows(w, q, scale)


# --- CuTe DSL kernels, compiled on the CPU ------------------------------------------------------

needs_cute = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                reason="needs nvidia-cutlass-dsl")


@needs_cute
def test_sm100_kernel_compiles_to_block_scaled_tcgen05(tmp_path):
    out = compile_in_subprocess("""
        from engine.kernels.cute.nvfp4_gemm_sm100 import compiled_gemm
        ptx = compiled_gemm(1024, 512).__ptx__
        for pattern in ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale", "tcgen05.cp",
                        "tcgen05.ld", "cp.async.bulk.tensor", "tcgen05.alloc", ".target sm_100a"):
            print(pattern, ptx.count(pattern))
    """, "sm_100a", tmp_path)
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}
    # A 256-deep k-tile is 4 MMAs of k64, each with e4m3 scales for 16-element blocks.
    assert counts["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale"] == 4, counts
    # Scales staged smem -> TMEM (A and B), accumulator read back, TMA loads of all four tiles.
    assert counts["tcgen05.cp"] >= 2 and counts["tcgen05.ld"] > 0, counts
    assert counts["cp.async.bulk.tensor"] >= 4 and counts["tcgen05.alloc"] >= 1, counts
    assert counts[".target sm_100a"] == 1, counts


# --- GPU: the Hopper kernels at Llama-3.1-8B shapes ----------------------------------------------

LLAMA_NK = [(6144, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("n,k", LLAMA_NK)
def test_gpu_matmul_llama_shapes(n, k, tiled):
    # Through nvfp4_linear (the kernel selection: Gluon decode, Gluon wgmma decode, Triton decode,
    # decode + cuBLAS) in bf16, and each decode kernel directly where its M range allows, into bf16
    # and fp32 outputs.
    from engine.kernels.nvfp4_gluon import decode_matmul, wgmma_matmul
    from engine.kernels.nvfp4_triton import MAX_M, decode_gemm
    w = nv.quantize(torch.randn(n, k, device="cuda") * 0.02)
    dq = nv.dequantize(w).double()
    if tiled:  # the storage Nvfp4Weight keeps on CUDA
        w = nv.to_tiles(w)
    random_ms = torch.randint(2, 4001, (3,)).tolist()
    for m in [1, 3, 5, 16, 17, 64, 127, 200, 1024, 2048, 4000] + random_ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dq.t()
        y = nv.nvfp4_linear(x, w)
        assert y.dtype == torch.bfloat16 and not y.isnan().any(), m
        err = rel_err(y, expected(x, w))
        assert err < 5e-3, (m, "nvfp4_linear", err)
        kernels = [("triton_decode", lambda out: decode_gemm(x, w, out))] if m <= MAX_M else []
        if m <= 16:
            kernels.append(("gluon_decode", lambda out: decode_matmul(x, w, out)))
            kernels.append(("gluon_wgmma_decode", lambda out: wgmma_matmul(x, w, out)))
        for name, run in kernels:
            for out_dtype, tol in ((torch.bfloat16, 5e-3), (torch.float32, 1e-5)):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
                run(out)
                assert not out.isnan().any(), (m, name, out_dtype)
                err = rel_err(out, ref)
                assert err < tol, (m, name, out_dtype, err)


@pytest.mark.gpu
def test_gpu_decode_kernel_configs_and_tails():
    # Random N (tails) and M <= 64, every words-per-thread, split-K up to 8, each config twice (the
    # split-K accumulator must be back at zero), output poisoned first.
    from engine.kernels.nvfp4_triton import decode_gemm, small_m_config
    torch.manual_seed(1)
    for n, k, tiled in [(int(torch.randint(65, 3000, ())), 4096, False), (4096, 14336, False),
                        (300, 576, False), (16 * int(torch.randint(5, 190, ())), 4096, True),
                        (4096, 14336, True)]:
        w = nv.quantize(torch.randn(n, k, device="cuda") * 0.02)
        dq = nv.dequantize(w).double()
        if tiled:
            w = nv.to_tiles(w)
        # The Triton decode kernel by its configs: its defaults and four others.
        configs = [small_m_config(1, n, k, 132)] + [
            small_m_config(1, n, k, 132, block_n=bn, block_k=bk, words_per_thread=wpt,
                           split_k=split)
            for bn, bk, wpt, split in [(64, 256, 1, 2), (128, 256, 2, 8), (64, 128, 4, 4),
                                       (128, 512, 4, 1)]
            if k % (bk * split) == 0 and bk >= 32 * wpt and (bk % 128 == 0 or not tiled)]

        def check_twice(m, config):
            for _ in range(2):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
                decode_gemm(x, w, out, config)
                assert not out.isnan().any(), (n, k, m, config)
                assert rel_err(out, x.double() @ dq.t()) < 1e-5, (n, k, m, config)
        for config in configs:
            for m in (1, int(torch.randint(2, 16, ())), 16):
                check_twice(m, config)
        # 32-, 64- and 128-token tiles (17 <= M <= 128): the default and a 64-row, 4-warp config.
        for m in (int(torch.randint(17, 33, ())), int(torch.randint(33, 64, ())), 64,
                  int(torch.randint(65, 129, ()))):
            for config in (small_m_config(m, n, k, 132),
                           small_m_config(m, n, k, 132, block_n=64, block_k=128, num_warps=4)):
                check_twice(m, config)


def random_weight(n, k, tiled):
    """An NVFP4 weight of N rows with scales spread over rows (tiled storage if asked) on the GPU,
    and its dequantised values [N, K] in float64."""
    w = nv.quantize(torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda"))
    dq = nv.dequantize(w).double()
    return (nv.to_tiles(w) if tiled else w), dq


def check_matmul(matmul, w, dq, configs, ms):
    """matmul(x, w, out, config) for every config and M, twice (the split-K scratch must be back at
    zero), into poisoned fp32 and bf16 outputs, against x @ dq^T in float64."""
    n, k = dq.shape
    for config in configs:
        for m in ms:
            for _ in range(2):
                x = torch.randn(m, k, device=dq.device, dtype=torch.bfloat16)
                ref = x.double() @ dq.t()
                for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-3)):
                    out = torch.full((m, n), float("nan"), device=dq.device, dtype=dtype)
                    matmul(x, w, out, config)
                    assert not out.isnan().any(), (n, k, m, config, dtype)
                    assert rel_err(out, ref) < tol, (n, k, m, config, dtype)


@pytest.mark.gpu
def test_gpu_gluon_decode_kernel_configs_and_tails():
    # The Gluon decode kernel: random N (tails), K with an odd number of steps (576), M from both
    # token tiles (1..8 and 9..16), warps along rows and along K, 2, 4 or 8 words per thread and
    # step, split-K up to 4, each config twice (the split-K accumulator must be back at zero),
    # outputs poisoned first.
    from engine.kernels.nvfp4_gluon import decode_config, decode_matmul
    torch.manual_seed(2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (384, 256) and (200, 64): one K step per warp (a compiled loop of no iteration).
    # Tiled storage (16-row x 128-K tiles; 4 or 8 words per thread) on N a multiple of 16.
    for n, k, tiled in [(int(torch.randint(65, 3000, ())), 4096, False), (4096, 14336, False),
                        (300, 576, False), (384, 256, False), (200, 64, False),
                        (16 * int(torch.randint(5, 190, ())), 4096, True), (4096, 14336, True),
                        (384, 256, True)]:
        w, dq = random_weight(n, k, tiled)
        configs = [None] + [decode_config(1, n, k, sms, num_warps=nw, block_n=bn, warps_k=wk,
                                          split_k=split, words_per_thread=wpt)
                            for nw, bn, wk, split, wpt in [(4, 64, 1, 2, 4), (4, 32, 2, 4, 4),
                                                           (8, 32, 4, 1, 8), (4, 16, 4, 2, 8),
                                                           (2, 32, 1, 3, 2)]
                            if k % (split * wk * 32 * wpt) == 0 and k != 14336 and (wpt >= 4 or not tiled)]
        ms = (1, int(torch.randint(2, 9, ())), 9, int(torch.randint(10, 17, ())))
        check_matmul(decode_matmul, w, dq, configs, ms)


def check_swiglu(matmul, w, dq, configs, ms):
    """matmul(x, w, out, config, swiglu=True), W a fused gate/up weight whose dequantised values
    are dq [2F, K] (float64), for every config and M, twice (the split-K scratch must be back at
    zero), into poisoned fp32 outputs, against silu(gate) * up in float64."""
    f, k = dq.shape[0] // 2, dq.shape[1]
    for config in configs:
        for m in ms:
            for _ in range(2):
                x = torch.randn(m, k, device=dq.device, dtype=torch.bfloat16)
                y = x.double() @ dq.t()
                ref = torch.nn.functional.silu(y[:, :f]) * y[:, f:]
                out = torch.full((m, f), float("nan"), device=dq.device, dtype=torch.float32)
                matmul(x, w, out, config, swiglu=True)
                assert not out.isnan().any(), (f, k, m, config)
                assert rel_err(out, ref) < 1e-5, (f, k, m, config)


@pytest.mark.gpu
def test_gpu_gluon_swiglu_epilogue():
    # silu(gate) * up of a fused gate/up weight in the Gluon decode kernel's epilogue: random F
    # (tails), both storage orders, warps splitting rows or K, split-K (twice: the scratch must be
    # back at zero), outputs poisoned; and through Nvfp4Weight.swiglu_forward.
    from engine.kernels.nvfp4_gluon import decode_config, decode_matmul, swiglu_config
    torch.manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for f, k, tiled in [(16 * int(torch.randint(3, 400, ())), 4096, True), (14336, 4096, True),
                        (16 * int(torch.randint(3, 400, ())), 4096, False), (304, 576, False)]:
        n = 2 * f
        w, dq = random_weight(n, k, tiled)
        wpt = 4 if k % 128 == 0 else 2
        configs = [swiglu_config(1, n, k, sms)] + [
            decode_config(1, n, k, sms, num_warps=nw, block_n=bn, warps_k=wk, split_k=split,
                          words_per_thread=wpt)
            for nw, bn, wk, split in [(4, 32, 4, 1), (4, 64, 2, 2), (4, 128, 1, 1), (8, 64, 4, 4)]
            if k % (split * wk * 32 * wpt) == 0]
        check_swiglu(decode_matmul, w, dq, configs, (1, int(torch.randint(2, 5, ())), 9))
    backend = nv.Nvfp4Weight.from_dense(torch.randn(2 * 4096, 1024, device="cuda", dtype=torch.bfloat16))
    assert backend.tensor.tiled
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    y = x.double() @ nv.dequantize(backend.tensor).double().t()
    h = backend.swiglu_forward(x)
    assert h.shape == (3, 4096) and h.dtype == torch.bfloat16
    assert rel_err(h, torch.nn.functional.silu(y[:, :4096]) * y[:, 4096:]) < 5e-3
    assert backend.swiglu_forward(torch.randn(17, 1024, device="cuda", dtype=torch.bfloat16)) is None


@pytest.mark.gpu
def test_gpu_gluon_wgmma_decode_kernel_configs_and_tails():
    # The Gluon wgmma decode kernel: random N (tails), K of 1, 3, 9 and 32 steps a program and odd
    # step counts (the ring's tails), both storage orders, M from 1 to 16 (both token tiles), one
    # or two warpgroups, split-K from 1 to 8, each config twice (the split-K scratch must be back
    # at zero), into bf16 and fp32 outputs poisoned first; then its SwiGLU epilogue.
    from engine.kernels.nvfp4_gluon import wgmma_config, wgmma_matmul
    torch.manual_seed(5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k, tiled in [(int(torch.randint(65, 3000, ())), 4096, False), (4096, 14336, True),
                        (300, 576, False), (200, 64, False), (16 * int(torch.randint(5, 190, ())), 4096, True),
                        (384, 384, True), (384, 256, True)]:
        w, dq = random_weight(n, k, tiled)
        steps = k // (128 if k % 128 == 0 else 64)
        splits = {1, max(1, steps // 3) if steps % 3 == 0 else 1} if k < 4096 else {1, 7 if steps % 7 == 0 else 2}
        configs = [None] + [wgmma_config(1, n, k, sms, split_k=s, block_n=bn, num_warps=nw)
                            for s in sorted(splits) for bn, nw in ((64, 4), (128, 4), (128, 8))]
        ms = (1, int(torch.randint(2, 9, ())), 9, int(torch.randint(10, 17, ())), 16)
        check_matmul(wgmma_matmul, w, dq, configs, ms)
    for f, k, tiled in [(16 * int(torch.randint(3, 400, ())), 4096, True), (14336, 4096, True),
                        (16 * int(torch.randint(3, 400, ())), 4096, False), (304, 576, False)]:
        n = 2 * f
        w, dq = random_weight(n, k, tiled)
        configs = [None, wgmma_config(1, n, k, sms, split_k=1, swiglu=True),
                   wgmma_config(1, n, k, sms, block_n=256, num_warps=8, swiglu=True)]
        check_swiglu(wgmma_matmul, w, dq, configs, (1, 9, 16))
    backend = nv.Nvfp4Weight.from_dense(torch.randn(2 * 4096, 1024, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(12, 1024, device="cuda", dtype=torch.bfloat16)
    y = x.double() @ nv.dequantize(backend.tensor).double().t()
    h = backend.swiglu_forward(x)  # 12 tokens: the wgmma kernel's epilogue
    assert h.shape == (12, 4096) and h.dtype == torch.bfloat16
    assert rel_err(h, torch.nn.functional.silu(y[:, :4096]) * y[:, 4096:]) < 5e-3


@pytest.mark.gpu
def test_gpu_decode_kernel_arithmetic_fallback(monkeypatch):
    # Where the compiled layout does not suit the PTX decode, the kernel decodes arithmetically.
    from engine.kernels import nvfp4_triton as dec
    monkeypatch.setattr(dec, "_ptx_decode_layout_ok", lambda *args: False)
    for n, k in [(300, 576), (1000, 4096)]:
        w = nv.quantize(torch.randn(n, k, device="cuda") * 0.02)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
            dec.decode_gemm(x, w, out, dec.small_m_config(m, n, k, 132))
            assert not out.isnan().any()
            assert rel_err(out, x.double() @ nv.dequantize(w).double().t()) < 1e-5, (n, k, m)


@pytest.mark.gpu
def test_gpu_tuning_offers_the_decode_kernels_and_runs_each_pick(tmp_path):
    # Nvfp4Weight.tune at 1, 4 and 16 tokens offers exactly the decode kernels that can run there
    # (and, for a fused gate/up weight, their SwiGLU epilogues and "separate"); whichever it is
    # handed back is what forward / swiglu_forward then run, right and replayable in a CUDA graph.
    # Past 16 tokens nothing is timed. Then the real tuner, whose cache a second weight reuses.
    from engine.kernels.platform import capture
    from engine.kernels.tuner import Tuner
    torch.manual_seed(5)
    w = torch.randn(2 * 1536, 1024, device="cuda", dtype=torch.bfloat16)
    dq = nv.dequantize(nv.quantize(w)).double()
    want = {1: (["gluon_decode", "gluon_wgmma_decode", "triton_decode"],
                ["gluon_decode_swiglu", "gluon_wgmma_decode_swiglu", "separate"]),
            4: (["gluon_decode", "gluon_wgmma_decode", "triton_decode"],
                ["gluon_decode_swiglu", "gluon_wgmma_decode_swiglu", "separate"]),
            16: (["gluon_wgmma_decode", "triton_decode"], ["gluon_wgmma_decode_swiglu", "separate"])}

    def check(backend, m):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        y = x.double() @ dq.t()
        assert rel_err(backend(x), y) < 5e-3, (m, backend.tuned)
        h = backend.swiglu_forward(x)
        if h is None:
            assert backend._swiglu_choice(m, x.dtype).kernel.name == "separate"
        else:
            assert rel_err(h, torch.nn.functional.silu(y[:, :1536]) * y[:, 1536:]) < 5e-3, (m, backend.tuned)
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            out = backend(x)
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, x.double() @ dq.t()) < 5e-3, (m, backend.tuned)

    for pick_index in (0, -1):      # the list's first, then its last (the Triton kernel, "separate")
        offered = {}

        class Picker:
            enabled = True

            def best(self, problem, candidates):
                listed = candidates()
                offered.setdefault(problem.m, []).append([name for name, _, _ in listed])
                for _, _, run in listed:
                    run()           # every candidate runs on the sample it is offered with
                name, config, _ = listed[pick_index]
                return name, config
        backend = nv.Nvfp4Weight.from_dense(w)
        backend.tune(Picker(), [1, 4, 16, 32], swiglu=True)
        assert {m: tuple(v) for m, v in offered.items()} == {m: tuple(v) for m, v in want.items()}
        for m in (1, 4, 16):
            assert backend._gemm_choice(m).kernel.name == want[m][0][pick_index]
            assert backend._swiglu_choice(m, torch.bfloat16).kernel.name == want[m][1][pick_index]
        for m in (1, 3, 4, 5, 16, 32):
            check(backend, m)
    tuner = Tuner(tmp_path / "t.json")
    backend = nv.Nvfp4Weight.from_dense(w)
    backend.tune(tuner, [1, 4, 16], swiglu=True)
    assert tuner.timed > 0 and set(backend.tuned) == {"nvfp4_gemm", "nvfp4_swiglu"}
    for m in (1, 2, 4, 9, 16):
        check(backend, m)
    tuner.save()
    again = Tuner(tmp_path / "t.json")
    cached = nv.Nvfp4Weight.from_dense(w)
    cached.tune(again, [1, 4, 16], swiglu=True)
    assert again.timed == 0 and cached.tuned == backend.tuned


@pytest.mark.gpu
def test_gpu_tail_n_and_dispatch():
    # N not a multiple of any tile, M crossing the decode/GEMM boundary (past it the FP8 GEMM takes
    # no N % 64 != 0: decode to bf16 + cuBLAS); through nvfp4_linear.
    w = nv.quantize(torch.randn(1000, 4096, device="cuda"))
    for m in (1, 16, 33, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        y = nv.nvfp4_linear(x, w)
        assert y.dtype == torch.bfloat16 and not y.isnan().any()
        assert rel_err(y, expected(x, w)) < 5e-3
    # Large M decodes into reused scratch buffers: back-to-back GEMMs of a smaller, a larger (the
    # buffers grow) and a tiled weight, each against its own reference.
    ws = [nv.quantize(torch.randn(1024, 4096, device="cuda")), nv.quantize(torch.randn(3072, 4096, device="cuda")),
          nv.to_tiles(nv.quantize(torch.randn(512, 4096, device="cuda")))]
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    ys = [nv.nvfp4_linear(x, wi) for wi in ws]
    for wi, y in zip(ws, ys):
        assert rel_err(y, expected(x, wi)) < 5e-3


def expected(x, w):
    """float64 reference of what nvfp4_linear computes for x: W4A16, or past the decode kernels'
    M the FP8 path's (where it is selected) -- itself within a few percent of W4A16."""
    exact = x.double() @ nv.dequantize(w).double().t()
    if nv.nvfp4_kernel(x.shape[0], w, x.device, x.dtype).kernel.input_quant != "fp8":
        return exact
    fp8_path = nv.nvfp4_fp8_linear_reference(x, w, torch.float32).double()
    assert rel_err(fp8_path, exact) < 0.06
    return fp8_path


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_NK)
def test_gpu_dequantize_fp8_llama_shapes(n, k):
    from engine.kernels.nvfp4_triton import dequantize_fp8_scratch
    for w in (nv.quantize(torch.randn(n, k, device="cuda") * 0.02), nv.to_tiles(nv.quantize(torch.randn(n, k, device="cuda")))):
        q, scale = dequantize_fp8_scratch(w)
        check_fp8_rows(w, q, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_NK)
def test_gpu_dequantize_llama_shapes(n, k):
    from engine.kernels.nvfp4_triton import dequantize_bf16
    w = nv.quantize(torch.randn(n, k, device="cuda"))
    out = dequantize_bf16(w, torch.float32)
    torch.testing.assert_close(out, nv.dequantize(w), rtol=1e-6, atol=0)
