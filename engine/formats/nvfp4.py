"""NVFP4: the weight format, its PyTorch references, and the `nvfp4` linear backend.

Format (the one Blackwell's block-scaled tensor cores read):
- values: e2m1 (sign, 2-bit exponent with bias 1, 1-bit mantissa): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6};
  packed two per byte along K, the LOW nibble holding the EVEN K index (as `mma ... kind::mxf4nvf4`
  and `cvt.rn.satfinite.e2m1x2.f32` order them).
- block scale: one e4m3 per 16 consecutive elements along K.
- tensor scale: one fp32 per tensor, amax / (448 * 6), so the largest block scale lands on 448 (the
  e4m3 maximum) and the largest value on 6 (the e2m1 maximum).
A weight element is w = e2m1 * block_scale * tensor_scale.

Storage order: row-major (packed [N, K/2], block_scale [N, K/16]), or, for the Hopper kernels,
tiles of 16 rows x 128 K (`to_tiles`: packed [N/16, K/128, 16, 64], block_scale
[N/16, K/128, 16, 8], each tile contiguous, tiles ordered row block then K), the same bytes
reordered so that a warp's K step of 16 rows is one contiguous 1 KB read, and the K steps of a
row block follow each other. The shape of `packed` says which; the Triton and Gluon kernels read
both, the references and the CuTe DSL kernel read row-major (`to_rows`).

`to_blocked` gives the block-scale arrangement tcgen05 block-scaled MMA reads from memory (the
"128x4" layout; engine/kernels/cute/nvfp4_gemm_sm100.py).

The NVFP4 GEMM, per architecture (engine/kernels/select.py):
- sm_90 (no FP4 tensor cores): M <= 4 the Gluon mma.sync decode kernel, M <= 16 the Gluon wgmma
  decode kernel (engine/kernels/nvfp4_gluon.py: weights straight into registers, x from registers
  or from shared memory), M <= 128 the Triton decode kernel (engine/kernels/nvfp4_triton.py, WGMMA
  with both operands staged through shared memory); all W4A16, the weight decoded in registers to
  bf16 (exact). Larger M is compute-bound: the weight is decoded once per call into a reused
  buffer as FP8 rows (`to_fp8`: one more rounding of each weight, to e4m3's 4 significant bits)
  and the CuTe DSL FP8 GEMM runs (W8A8 on tensor cores twice as fast as bf16's;
  `nvfp4_fp8_linear_reference`). Its activations are e4m3 per token: the RMSNorm or SwiGLU
  before the GEMM writes them so (`input_quant`), as for `--weights fp8`. Where the FP8 GEMM
  cannot run (no CuTe DSL, or N % 64 != 0), the weight is decoded to bf16 for cuBLAS instead
  (W4A16, exact).
- sm_100: the CuTe DSL tcgen05 block-scaled kernel (W4A4: activations quantised to NVFP4 per call;
  N % 128 == 0, K % 256 == 0), else the Triton decode kernel, else decode to bf16 + cuBLAS (exact).
- anything else: the Triton decode kernel, decode + cuBLAS, or the reference.
The order is bench_nvfp4.py --decode's on the Llama-3.1-8B shapes. Up to 16 tokens, where the
fastest decode kernel differs between shapes, the engine's tuner times them per weight at start,
and the fused gate/up projection's SwiGLU epilogue against the GEMM plus the SwiGLU kernel.
The RMSNorm hand-off (engine/kernels/stream_triton.py) does not pay in the Gluon kernel, whose
epilogues cost what the norm kernels do (BENCHMARKS.md, "Tried"): NVFP4 keeps its norm kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.formats.base import WeightFormat
from engine.formats.fp8 import fp8_linear, fp8_linear_reference, quantize_act_fp8, quantize_rows_fp8
from engine.kernels import nvfp4_triton
from engine.kernels.platform import capability, cute_available, gluon_missing
from engine.kernels.select import Choice, Kernel, Problem, m_bucket, runnable, select

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements along K per e4m3 block scale
TILE_ROWS, TILE_K = 16, 128  # the tiled storage order (module docstring)

# The 8 magnitudes of e2m1, indexed by the low 3 bits of a code (bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

@dataclass
class Nvfp4Tensor:
    """A [N, K] matrix in NVFP4: packed e2m1 [N, K/2] uint8, e4m3 scales [N, K/16], fp32 scalar;
    or the same bytes in tiles (`tiled`: packed [N/16, K/128, 16, 64], scales [N/16, K/128, 16, 8])."""
    packed: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    shape: tuple[int, int]
    blocked_scale: torch.Tensor | None = None  # block_scale in to_blocked's order (sm_100 only)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.block_scale.numel() + 4

    @property
    def tiled(self) -> bool:
        return self.packed.dim() == 4

    def to(self, device) -> "Nvfp4Tensor":
        return Nvfp4Tensor(self.packed.to(device), self.block_scale.to(device),
                           self.tensor_scale.to(device), self.shape)


def e2m1_round(magnitude: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..7) of |x| (already divided by its scale), ties to the even code,
    saturating at 6: the midpoints between code points, '>' where the lower code is even, '>='
    where the upper one is."""
    a = magnitude
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of 4-bit e2m1 codes (uint8, 0..15)."""
    lut = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = lut[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, even K index in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of pack_nibbles)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize(w: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> Nvfp4Tensor:
    """Reference NVFP4 quantisation of a [N, K] matrix (K a multiple of 16), in fp32."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} must be a multiple of {BLOCK}")
    w32 = w.detach().float()
    if tensor_scale is None:
        amax = w32.abs().amax()
        # An all-zero tensor keeps scale 1 so nothing divides by zero; its codes are all 0.
        tensor_scale = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
    tensor_scale = tensor_scale.float().reshape(())
    blocks = w32.reshape(n, k // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    # Elements are divided by the scale as stored (after e4m3 rounding), as a decoder multiplies it.
    scale = block_scale.float().unsqueeze(-1) * tensor_scale
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = torch.where(scale > 0, blocks / safe_scale, torch.zeros_like(blocks))
    codes = e2m1_round(scaled.abs()) | ((scaled < 0).to(torch.uint8) << 3)
    return Nvfp4Tensor(pack_nibbles(codes.reshape(n, k)), block_scale, tensor_scale, (n, k))


def tileable(n: int, k: int) -> bool:
    return n % TILE_ROWS == 0 and k % TILE_K == 0


def to_tiles(t: Nvfp4Tensor) -> Nvfp4Tensor:
    """Row-major -> tiles of 16 rows x 128 K (module docstring); N % 16 == 0 and K % 128 == 0."""
    n, k = t.shape
    if t.tiled:
        return t
    if not tileable(n, k):
        raise ValueError(f"tiled storage needs N % {TILE_ROWS} == 0 and K % {TILE_K} == 0, got {n} x {k}")

    def tile(a, cols):  # [N, K / (128 / cols)] -> [N/16, K/128, 16, cols]
        return a.reshape(n // TILE_ROWS, TILE_ROWS, k // TILE_K, cols).transpose(1, 2).contiguous()
    return Nvfp4Tensor(tile(t.packed, TILE_K // 2), tile(t.block_scale, TILE_K // BLOCK),
                       t.tensor_scale, t.shape)


def to_rows(t: Nvfp4Tensor) -> Nvfp4Tensor:
    """The inverse of to_tiles (row-major tensors come back as they are)."""
    if not t.tiled:
        return t
    n, k = t.shape

    def untile(a):
        return a.transpose(1, 2).reshape(n, -1)
    return Nvfp4Tensor(untile(t.packed), untile(t.block_scale), t.tensor_scale, t.shape)


def dequantize(t: Nvfp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantisation: e2m1 * block_scale * tensor_scale, computed in fp32."""
    t = to_rows(t)
    n, k = t.shape
    values = e2m1_decode(unpack_nibbles(t.packed)).reshape(n, k // BLOCK, BLOCK)
    w = values * (t.block_scale.float().unsqueeze(-1) * t.tensor_scale.float())
    return w.reshape(n, k).to(dtype)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Scale factors [rows, cols] -> the 128x4-tiled order tcgen05 block-scaled MMA reads (flat).

    Rows are padded to 128 and columns to 4 (with zeros). Tiles of 128 rows x 4 columns are laid
    out row-tile-major; inside a tile, row r = 32 * r_hi + r_lo and column c sit at
    r_lo * 16 + r_hi * 4 + c, i.e. 32 rows of 16 bytes, each holding 4 rows' 4 scales.
    """
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = scales.new_zeros(row_tiles * 128, col_tiles * 4)
    padded[:rows, :cols] = scales
    # (row_tile, r_hi, r_lo, col_tile, c) -> (row_tile, col_tile, r_lo, r_hi, c)
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def nvfp4_linear_reference(x: torch.Tensor, w: Nvfp4Tensor,
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x @ dequantize(w)^T in fp32, cast to out_dtype."""
    return (x.float() @ dequantize(w).t()).to(out_dtype)


FP8_SHIFT = nvfp4_triton.FP8_SHIFT.value    # why 8: engine/kernels/nvfp4_triton.py


def to_fp8(t: Nvfp4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as FP8 rows, (q [N, K] float8_e4m3fn, scale [N] fp32): q = e4m3(e2m1 * block_scale
    / 8), rounded to nearest even, and scale = tensor_scale * 8 in every row. The product e2m1 *
    block_scale has up to 5 significant bits, e4m3 keeps 4: the one rounding this adds."""
    t = to_rows(t)
    n, k = t.shape
    values = e2m1_decode(unpack_nibbles(t.packed)).reshape(n, k // BLOCK, BLOCK)
    q = (values * t.block_scale.float().unsqueeze(-1) / FP8_SHIFT).reshape(n, k).to(torch.float8_e4m3fn)
    return q, (t.tensor_scale.float() * FP8_SHIFT).expand(n).contiguous()


def nvfp4_fp8_linear_reference(x: torch.Tensor, w: Nvfp4Tensor,
                               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What the large-M path computes: x quantised per token and `to_fp8(w)`, multiplied in fp32."""
    return fp8_linear_reference(*quantize_rows_fp8(x), *to_fp8(w), out_dtype=out_dtype)


def sm90_reference_kernels() -> list[Kernel]:
    """sm_90's NVFP4 numerics in PyTorch, as a kernel list for any device: W4A16 up to the decode
    kernels' M, past it the FP8 path's (`to_fp8` weights times e4m3 activations, which the norm or
    SwiGLU before writes), and W4A16 again where N % 64 != 0 (what decode to bf16 + cuBLAS
    computes). What bench.py's quality emulation and the GPU tests' references run."""
    def w4a16(x, w, config=None):
        return nvfp4_linear_reference(x, w, x.dtype)

    def w8a8(qx, x_scale, w, out_dtype, config=None):
        return fp8_linear_reference(qx, x_scale, *to_fp8(w), out_dtype=out_dtype)
    return [Kernel("sm90_w4a16_reference", w4a16, max_m=nvfp4_triton.MAX_M, needs_cuda=False),
            Kernel("sm90_fp8_path_reference", w8a8, needs_cuda=False, input_quant="fp8", check=_fp8_gemm_shape),
            Kernel("sm90_dequantize_reference", w4a16, needs_cuda=False)]


# ------------------------------------------------------------------------------------ kernels
def _decodable(p: Problem) -> str | None:
    """What the Triton and Gluon kernels read: K % 64 == 0, bf16 / fp16 activations."""
    dtype, tiled = p.detail
    if p.k % 64:
        return "needs K % 64 == 0"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"takes bf16 / fp16 activations, not {dtype}"
    return None


def _gluon_decodable(p: Problem) -> str | None:
    return (gluon_missing() or _decodable(p)
            or ("a tiled weight needs K % 128 == 0" if p.detail[1] and p.k % 128 else None))


def _gluon(matmul: str, swiglu: bool = False):
    """The run of a Gluon decode kernel, engine/kernels/nvfp4_gluon.py `matmul` (decode_matmul or
    wgmma_matmul): bf16 x, the output in x's dtype; with swiglu, silu(gate) * up [M, N/2] of a
    fused gate/up weight."""
    def run(x, w, config=None):
        from engine.kernels import nvfp4_gluon
        out = torch.empty(x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0], device=x.device, dtype=x.dtype)
        return getattr(nvfp4_gluon, matmul)(x.to(torch.bfloat16), w, out, config, swiglu=swiglu).to(x.dtype)
    return run


def _triton_decode(x, w, config=None):
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    return nvfp4_triton.decode_gemm(x.to(torch.bfloat16), w, out, config)


def _dequant_cublas(x, w, config=None):
    return F.linear(x.to(torch.bfloat16), nvfp4_triton.dequantize_scratch(w)).to(x.dtype)


def _fp8_dequant_wgmma(qx, x_scale, w, out_dtype, config=None):
    return fp8_linear(qx, *nvfp4_triton.dequantize_fp8_scratch(w), out_dtype=out_dtype, x_scale=x_scale)


def _fp8_gemm_shape(p: Problem) -> str | None:
    return "the FP8 GEMM needs N % 64 == 0" if p.n % 64 else None


def _fp8_dequant_fits(p: Problem) -> str | None:
    if not cute_available():
        return "nvidia-cutlass-dsl is not installed"
    return _decodable(p) or _fp8_gemm_shape(p)


def _tcgen05(x, w, config=None):
    from engine.kernels.cute.nvfp4_gemm_sm100 import nvfp4_gemm_sm100
    a = quantize(x)
    alpha = (a.tensor_scale * w.tensor_scale).reshape(1)
    out = nvfp4_gemm_sm100(a.packed, to_blocked(a.block_scale), w.packed, w.blocked_scale, alpha)
    return out.to(x.dtype)


def _tcgen05_fits(p: Problem) -> str | None:
    if not cute_available():
        return "nvidia-cutlass-dsl is not installed"
    if p.detail[1]:
        return "reads row-major storage, the weight is tiled"
    return "needs N % 128 == 0 and K % 256 == 0" if p.n % 128 or p.k % 256 else None


def _reference(x, w, config=None):
    return nvfp4_linear_reference(x, w, x.dtype)


# A kernel with input_quant="fp8" is called as run(qx, x_scale, w, out_dtype, config=); the others
# as run(x, w, config=).
TRITON_DECODE = Kernel("triton_decode", _triton_decode, max_m=nvfp4_triton.MAX_M, check=_decodable)
DEQUANT_CUBLAS = Kernel("dequantize_cublas", _dequant_cublas, check=_decodable)
REFERENCE = Kernel("reference", _reference, reference=True)
NVFP4_GEMM = {
    9: [Kernel("gluon_decode", _gluon("decode_matmul"), max_m=4, check=_gluon_decodable),
        Kernel("gluon_wgmma_decode", _gluon("wgmma_matmul"), max_m=16, check=_gluon_decodable), TRITON_DECODE,
        Kernel("fp8_dequantize_wgmma", _fp8_dequant_wgmma, check=_fp8_dequant_fits, input_quant="fp8"),
        DEQUANT_CUBLAS, REFERENCE],
    10: [Kernel("cute_tcgen05_sm100", _tcgen05, check=_tcgen05_fits), TRITON_DECODE, DEQUANT_CUBLAS, REFERENCE],
    "other": [TRITON_DECODE, DEQUANT_CUBLAS, REFERENCE],
}
# Decode sizes, where the kernels' order differs by shape (BENCHMARKS.md, "NVFP4 weights on Hopper"):
# Nvfp4Weight.tune times them per weight at engine start.
TUNED_MAX_M = 16


def _swiglu_fits(p: Problem) -> str | None:
    return _gluon_decodable(p) or ("needs N % 32 == 0" if p.n % 32 else None)


# silu(gate) * up of a fused gate/up weight in the GEMM's epilogue; "separate": the GEMM, then the
# SwiGLU kernel (Linear.swiglu).
SEPARATE = Kernel("separate", None, needs_cuda=False)
NVFP4_SWIGLU = {9: [Kernel("gluon_decode_swiglu", _gluon("decode_matmul", swiglu=True), max_m=4, check=_swiglu_fits),
                    Kernel("gluon_wgmma_decode_swiglu", _gluon("wgmma_matmul", swiglu=True), max_m=16, check=_swiglu_fits),
                    SEPARATE],
                "other": [SEPARATE]}


def nvfp4_kernel(m: int, w: Nvfp4Tensor, device: torch.device, dtype: torch.dtype,
                 tuned: dict | None = None) -> Choice:
    """The kernel (and config) that multiplies M activation rows of model dtype `dtype` by w
    (tuned: the weight's {M bucket: choice} from Nvfp4Weight.tune)."""
    return select(NVFP4_GEMM, Problem("nvfp4_gemm", m, w.shape[0], w.shape[1], device, (dtype, w.tiled)), tuned)


def nvfp4_linear(x: torch.Tensor, w: Nvfp4Tensor, x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, tuned: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for an NVFP4 W, fp32 accumulation, in x's dtype (out_dtype).

    x: bf16 / fp16 / fp32, or, where the kernel chosen for M takes FP8 activations (its
    input_quant), already e4m3 with its per-token fp32 x_scale; out_dtype is then the model's."""
    if x_scale is None:
        out_dtype = x.dtype
    elif out_dtype is None:
        raise ValueError("out_dtype: an fp8 activation needs the model dtype to write")
    choice = nvfp4_kernel(x.shape[0], w, x.device, out_dtype, tuned)
    kernel = choice.kernel
    if kernel.input_quant == "fp8":
        qx, xs = quantize_act_fp8(x) if x_scale is None else (x, x_scale.reshape(-1).float())
        return kernel.run(qx, xs, w, out_dtype, config=choice.config)
    if x_scale is not None:
        raise ValueError(f"x_scale: {kernel.name}, the NVFP4 kernel for M={x.shape[0]}, takes "
                         f"{out_dtype} activations, not fp8 (ask input_quant(m) first)")
    return kernel.run(x.contiguous(), w, config=choice.config)


@torch.library.custom_op("microengine::nvfp4_linear", mutates_args=())
def nvfp4_linear_op(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                    tensor_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_linear as an opaque op, so torch.compile and graph tracing treat it as one node."""
    return nvfp4_linear(x, Nvfp4Tensor(packed, block_scale, tensor_scale, _shape_of(packed)))


def _shape_of(packed: torch.Tensor) -> tuple[int, int]:
    """[N, K] of a packed tensor, row-major or tiled."""
    if packed.dim() == 4:
        return packed.shape[0] * TILE_ROWS, packed.shape[1] * TILE_K
    return packed.shape[0], packed.shape[1] * 2


@nvfp4_linear_op.register_fake
def _(x, packed, block_scale, tensor_scale):
    return x.new_empty(x.shape[0], _shape_of(packed)[0])


# ------------------------------------------------------------------------------------ backend
class Nvfp4Weight(WeightFormat):
    """`--weights nvfp4`: the weight in NVFP4 (4.5 bits per element); on CUDA stored in tiles where
    the shape allows (what the Hopper kernels read fastest), row-major with blocked scales on sm_100."""
    name = "nvfp4"

    def __init__(self, weight: Nvfp4Tensor, dtype: torch.dtype = torch.bfloat16,
                 global_scale: torch.Tensor | None = None):
        """global_scale: a compressed-tensors checkpoint's divisor (w = e2m1 * block_scale / global);
        weight.tensor_scale is then its fp32 reciprocal, what the kernels multiply by, and
        `dequantize` divides by global_scale as compressed-tensors does (models/compressed.py)."""
        super().__init__(*weight.shape)
        self.register_buffer("packed", weight.packed)
        self.register_buffer("block_scale", weight.block_scale)
        self.register_buffer("tensor_scale", weight.tensor_scale.float().reshape(()))
        self.register_buffer("blocked_scale", weight.blocked_scale)  # None but on sm_100
        self.register_buffer("global_scale", None if global_scale is None else global_scale.float().reshape(()))
        self.dtype = dtype

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Nvfp4Weight":
        return cls(for_device(quantize(weight), weight.device), weight.dtype)

    @property
    def tensor(self) -> Nvfp4Tensor:
        return Nvfp4Tensor(self.packed, self.block_scale, self.tensor_scale,
                           (self.out_features, self.in_features), self.blocked_scale)

    def input_quant(self, m: int) -> str | None:
        """"fp8" where the kernel for M rows multiplies e4m3 activations (sm_90 past the decode
        kernels' M): the norm or SwiGLU before then writes them quantised."""
        if torch.compiler.is_compiling():   # the custom op below takes the model dtype
            return None
        return self._gemm_choice(m).kernel.input_quant

    def _gemm_choice(self, m: int) -> Choice:
        return nvfp4_kernel(m, self.tensor, self.packed.device, self.dtype, self.tuned.get("nvfp4_gemm"))

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return nvfp4_linear_op(x, self.packed, self.block_scale, self.tensor_scale)
        return nvfp4_linear(x, self.tensor, x_scale, self.dtype, self.tuned.get("nvfp4_gemm"))

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        kernel = self._swiglu_choice(x.shape[0], x.dtype).kernel
        return None if kernel.run is None else kernel.run(x.contiguous(), self.tensor)

    def _swiglu_choice(self, m: int, x_dtype: torch.dtype) -> Choice:
        return select(NVFP4_SWIGLU, self._problem("nvfp4_swiglu", m, x_dtype), self.tuned.get("nvfp4_swiglu"))

    def _problem(self, op: str, m: int, x_dtype: torch.dtype) -> Problem:
        return Problem(op, m, self.out_features, self.in_features, self.packed.device,
                       (x_dtype, self.packed.dim() == 4))

    def tune(self, tuner, m_values: list[int], swiglu: bool = False) -> None:
        """For each M up to TUNED_MAX_M, time the decode kernels (those listed with an M limit: W4A16,
        the weight decoded in registers) against each other, then, for a fused gate/up weight,
        their SwiGLU epilogues against the chosen GEMM plus the SwiGLU kernel. Past that M the
        list's order stands. Every choice is made, and logged, now."""
        for m in m_values:
            if m <= TUNED_MAX_M and self.packed.is_cuda:
                self._tune_decode(tuner, m, swiglu)
            self._gemm_choice(m)
            if swiglu:
                self._swiglu_choice(m, self.dtype)

    def _tune_decode(self, tuner, m: int, swiglu: bool) -> None:
        from engine.kernels.swiglu import swiglu as swiglu_kernel
        x = torch.randn(m, self.in_features, device=self.packed.device, dtype=self.dtype) * 0.1
        w = self.tensor
        ops = [("nvfp4_gemm", NVFP4_GEMM)] + ([("nvfp4_swiglu", NVFP4_SWIGLU)] if swiglu else [])
        for op, table in ops:       # the GEMM first: the SwiGLU's "separate" candidate runs its choice
            problem = self._problem(op, m, self.dtype)

            def candidates(table=table, problem=problem, separate=op == "nvfp4_swiglu"):
                listed = [(k.name, c, lambda k=k, c=c: k.run(x, w, config=c))
                          for k, c in runnable(table, problem) if k.max_m is not None]
                if separate and listed:
                    listed.append((SEPARATE.name, None, lambda: swiglu_kernel(self(x))))
                return listed
            pick = tuner.best(problem, candidates)
            if pick is not None:
                self.tuned.setdefault(op, {})[m_bucket(m)] = pick

    def dequantize(self) -> torch.Tensor:
        if self.global_scale is None:
            return dequantize(self.tensor, self.dtype)
        # fp32 e2m1 * (block_scale / global), in compressed-tensors' order of operations.
        t = to_rows(self.tensor)
        n, k = t.shape
        values = e2m1_decode(unpack_nibbles(t.packed)).reshape(n, k // BLOCK, BLOCK)
        scale = t.block_scale.float() / self.global_scale
        return (values * scale.unsqueeze(-1)).reshape(n, k).to(self.dtype)

    def weight_bytes(self) -> int:
        return self.tensor.nbytes

    k_granule = BLOCK

    def shard(self, shard) -> "Nvfp4Weight":
        """Codes and block scales of the shard's rows and 16-element K blocks; the tensor scale (and a
        checkpoint's global scale) of the whole weight. The device storage (tiles) is made per shard."""
        c0, c1 = self._check_cols(shard)
        t = to_rows(self.tensor)
        rows = shard.row_index(t.packed.device)
        part = Nvfp4Tensor(t.packed[rows, c0 // 2:c1 // 2].contiguous(),
                           t.block_scale[rows, c0 // BLOCK:c1 // BLOCK].contiguous(), t.tensor_scale,
                           shard.shape)
        return Nvfp4Weight(for_device(part, t.packed.device), self.dtype, self.global_scale)


def for_device(t: Nvfp4Tensor, device: torch.device) -> Nvfp4Tensor:
    """The storage the kernels of `device` read: blocked scales on sm_100, tiles on other GPUs where
    the shape allows, row-major on the CPU."""
    cap = capability(device)
    if cap is not None and cap[0] == 10:
        t = to_rows(t)
        return Nvfp4Tensor(t.packed, t.block_scale, t.tensor_scale, t.shape, to_blocked(t.block_scale))
    if cap is not None and tileable(*t.shape):
        return to_tiles(t)
    return t
