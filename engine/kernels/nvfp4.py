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
row block follow each other (the Gluon decode kernel ran 2-14% faster on it in two sessions'
runs: BENCHMARKS.md). The shape of `packed` says which; every kernel of
engine/kernels/nvfp4_decode*.py reads both, the references and the CuTe DSL kernels read
row-major (`to_rows`).

`to_blocked` gives the block-scale arrangement tcgen05 block-scaled MMA reads from memory (the
"128x4" layout; engine/kernels/cute/nvfp4_gemm_sm100.py). `nvfp4_linear` dispatches: on CUDA the
kernels of engine/kernels/nvfp4_decode.py (weights decoded in registers, fed to the tensor cores:
the Gluon decode kernel for M <= 4 on sm_90, Triton kernels otherwise) or, for large M,
dequantise + cuBLAS; the reference elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.linear import LinearBackend

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements along K per e4m3 block scale
TILE_ROWS, TILE_K = 16, 128  # the tiled storage order (module docstring)

# The 8 magnitudes of e2m1, indexed by the low 3 bits of a code (bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# The start of both Hopper decoders' inline PTX (engine/kernels/nvfp4_decode.py and
# engine/kernels/cute/nvfp4_sm90.py): $4 holds 4 packed bytes = 8 codes. `prmt` looks 4 bytes up in
# an 8-byte table indexed by 3-bit codes (the sign masked off): hi_a:hi_b hold the high bytes of the
# bf16 encodings of the 8 magnitudes above (0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0), lo_a:lo_b
# the low bytes; h0/l0 serve codes 0..3 of the word, h1/l1 codes 4..7. `shifted` (the word shifted
# left by 4) puts the even-K codes' sign bits at the top of a byte for the sign step that follows.
# The caller declares the registers (.b32 hi_a, hi_b, lo_a, lo_b, sel0, sel1, h0, l0, h1, l1,
# shifted) and pairs the bytes into bf16x2 words in its own order.
E2M1_BF16_LUT_PTX = """mov.b32 hi_a, 0x3F3F3F00;
mov.b32 hi_b, 0x40404040;
mov.b32 lo_a, 0xC0800000;
mov.b32 lo_b, 0xC0804000;
and.b32 sel0, $4, 0x7777;
shr.b32 sel1, $4, 16;
and.b32 sel1, sel1, 0x7777;
prmt.b32 h0, hi_a, hi_b, sel0;
prmt.b32 l0, lo_a, lo_b, sel0;
prmt.b32 h1, hi_a, hi_b, sel1;
prmt.b32 l1, lo_a, lo_b, sel1;
shl.b32 shifted, $4, 4;
"""


@dataclass
class Nvfp4Tensor:
    """A [N, K] matrix in NVFP4: packed e2m1 [N, K/2] uint8, e4m3 scales [N, K/16], fp32 scalar;
    or the same bytes in tiles (`tiled`: packed [N/16, K/128, 16, 64], scales [N/16, K/128, 16, 8])."""
    packed: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    shape: tuple[int, int]

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


# Up to this many rows the fused Triton kernel beats dequantise + cuBLAS on an H200 (M = 128:
# 33/121/63 us vs 38/160/86 us at the three Llama-3.1-8B shapes); at M = 1024 it is ~2x slower
# (183/777/398 vs 85/390/188 us: cuBLAS's bf16 GEMM outruns it by more than the dequantisation
# costs). Between 128 and 1024 the crossover was not measured.
FUSED_MAX_M = 128


def nvfp4_linear(x: torch.Tensor, w: Nvfp4Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W^T for an NVFP4 W. On CUDA, M <= FUSED_MAX_M: the Triton kernel
    (weights decoded in registers to bf16, tensor-core dot, tensor scale in the epilogue); larger
    M: the weight decoded to bf16 on the device, then cuBLAS; elsewhere: the reference."""
    if x.is_cuda:
        from engine.kernels import nvfp4_decode
        x = x.contiguous()
        if x.shape[0] <= FUSED_MAX_M:
            return nvfp4_decode.nvfp4_matmul(x, w, out_dtype)
        return F.linear(x.to(torch.bfloat16), nvfp4_decode.dequantize_scratch(w)).to(out_dtype)
    return nvfp4_linear_reference(x, w, out_dtype)


@torch.library.custom_op("microengine::nvfp4_linear", mutates_args=())
def nvfp4_linear_op(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                    tensor_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """nvfp4_linear as an opaque op, so torch.compile and graph tracing treat it as one node."""
    return nvfp4_linear(x, Nvfp4Tensor(packed, block_scale, tensor_scale, _shape_of(packed)), out_dtype)


def _shape_of(packed: torch.Tensor) -> tuple[int, int]:
    """[N, K] of a packed tensor, row-major or tiled."""
    if packed.dim() == 4:
        return packed.shape[0] * TILE_ROWS, packed.shape[1] * TILE_K
    return packed.shape[0], packed.shape[1] * 2


@nvfp4_linear_op.register_fake
def _(x, packed, block_scale, tensor_scale, out_dtype):
    return x.new_empty(x.shape[0], _shape_of(packed)[0], dtype=out_dtype)


class Nvfp4Weight(LinearBackend):
    """`--weights nvfp4`: the weight stored as NVFP4 (4.5 bits per element), activations bf16."""
    name = "nvfp4"

    def __init__(self, weight: Nvfp4Tensor, dtype: torch.dtype = torch.bfloat16):
        self.weight = weight
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Nvfp4Weight":
        """Quantised; on CUDA stored in tiles where the shape allows (what the kernels read fastest)."""
        w = quantize(weight)
        if weight.is_cuda and tileable(*w.shape):
            w = to_tiles(w)
        return cls(w, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return nvfp4_linear_op(x, w.packed, w.block_scale, w.tensor_scale, x.dtype)

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in the Gluon decode kernel's epilogue (M <= 4 on sm_90), else None."""
        from engine.kernels import nvfp4_decode
        w = self.weight
        m, n = x.shape[0], w.shape[0]
        if not (x.is_cuda and m <= nvfp4_decode.GLUON_MAX_M and nvfp4_decode._gluon_device(x.device)
                and n % 32 == 0 and nvfp4_decode.supported(x, w)):
            return None
        out = torch.empty(m, n // 2, device=x.device, dtype=x.dtype)
        return nvfp4_decode.decode_matmul(x.to(torch.bfloat16), w, out, swiglu=True)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight, self.dtype)

    def weight_bytes(self) -> int:
        return self.weight.nbytes


