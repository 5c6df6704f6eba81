"""NVFP4 weights on Hopper (sm_90a) in CuTe DSL: decoded in registers to bf16, fed to WGMMA.

out[M, N] (bf16) = (x @ W^T) * tensor_scale, x bf16 [M, K], W NVFP4 [N, K] (engine/kernels/
nvfp4.py: packed e2m1 [N, K/2], e4m3 block scales [N, K/16], fp32 tensor scale).

Hopper has no FP4 tensor cores, so per 256-deep k-tile:
- warp 0 (producer warpgroup) TMA-loads the activation tile (bf16, swizzled for WGMMA), the packed
  weight tile (uint8) and its block scales (uint8) into a ring of shared-memory stages;
- the consumer warpgroups decode the weight tile: each thread reads 16 packed bytes (32 values),
  turns every 4 bytes into 8 bf16 with `prmt` table lookups and multiplies by the block scale in
  bf16x2 (exact: e2m1 * e4m3 has at most 5 significant bits), and writes them into a bf16 B tile
  in WGMMA's swizzled K-major layout (double-buffered, so one k-tile is decoded while the other is
  read); after a proxy fence and a barrier the warpgroups run bf16 WGMMA (m64 n64 k16) on it;
- the fp32 tensor scale is applied once, in the epilogue, before the single rounding to bf16.
The decode writes shared memory instead of feeding WGMMA's A operand from registers: that would
need the weight as the M operand (out^T = W x^T) and a weight layout pre-permuted to the register
fragment; this is the simpler data flow.

M is a run-time argument (TMA zero-fills rows past M, the epilogue skips them); N % 64 == 0 and
K % 256 == 0 are compile-time constants.

Status: correct on an H200 at Llama-3.1-8B shapes, M = 1..4000 (tests/test_nvfp4.py), but not
dispatched: measured there it is slower than the Triton kernel (engine/kernels/nvfp4_decode.py)
at M <= 16 (one 64-row tile per CTA, decode and WGMMA serialised within a warpgroup: 9-16% of
copy bandwidth), 10% faster on two of three shapes and 50% slower on the third at M = 128, and
like it ~2x slower than dequantise + cuBLAS from M = 1024 (m64n64 WGMMAs, no persistent
schedule, scalar epilogue stores).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
import torch
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from engine.kernels.cute.common import CompileCache, current_stream, gmem_ptr, placeholder_stream
from engine.kernels.nvfp4 import E2M1_BF16_LUT_PTX

TILE_N, TILE_K = 64, 256
SMEM_BYTES = 227 * 1024

# 4 packed bytes ($4: 8 e2m1 codes, K = 0..7, low nibble first) times a bf16x2 block scale ($5)
# -> 4 bf16x2 words in K order ($0 = K 0,1 ... $3 = K 6,7). After the table lookups of
# E2M1_BF16_LUT_PTX (engine/kernels/nvfp4.py), a second `prmt` pairs the bytes into bf16x2, a
# third copies each code's sign bit (bit 3 of the nibble = the top bit of a byte of the
# word or of the word shifted left by 4) over a byte with sign-replicate mode, `lop3` ORs it in.
_DECODE_PTX = """{
.reg .b32 hi_a, hi_b, lo_a, lo_b, sel0, sel1, h0, l0, h1, l1, shifted, sgn, v;
""" + E2M1_BF16_LUT_PTX + """prmt.b32 v, l0, h0, 0x5140;
prmt.b32 sgn, shifted, $4, 0xC080;
lop3.b32 v, v, sgn, 0x80008000, 0xF8;
mul.rn.bf16x2 $0, v, $5;
prmt.b32 v, l0, h0, 0x7362;
prmt.b32 sgn, shifted, $4, 0xD090;
lop3.b32 v, v, sgn, 0x80008000, 0xF8;
mul.rn.bf16x2 $1, v, $5;
prmt.b32 v, l1, h1, 0x5140;
prmt.b32 sgn, shifted, $4, 0xE0A0;
lop3.b32 v, v, sgn, 0x80008000, 0xF8;
mul.rn.bf16x2 $2, v, $5;
prmt.b32 v, l1, h1, 0x7362;
prmt.b32 sgn, shifted, $4, 0xF0B0;
lop3.b32 v, v, sgn, 0x80008000, 0xF8;
mul.rn.bf16x2 $3, v, $5;
}"""

# One e4m3 block scale (the low byte of $1) -> the same value in both halves of a bf16x2 word.
_SCALE_PTX = """{
.reg .b16 byte, half_lo, half_hi;
.reg .b32 halves;
.reg .f32 value;
cvt.u16.u32 byte, $1;
cvt.rn.f16x2.e4m3x2 halves, byte;
mov.b32 {half_lo, half_hi}, halves;
cvt.f32.f16 value, half_lo;
cvt.rn.bf16x2.f32 $0, value, value;
}"""


@dsl_user_op
def scale_to_bf16x2(scale_byte: cutlass.Uint32, *, loc=None, ip=None) -> cutlass.Uint32:
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [scale_byte.ir_value(loc=loc, ip=ip)], _SCALE_PTX, "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def decode_e2m1x8(word: cutlass.Uint32, scale_x2: cutlass.Uint32, *, loc=None,
                  ip=None) -> cute.TensorSSA:
    """8 packed e2m1 codes times their block scale -> 8 bf16 values, in K order."""
    result = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [word.ir_value(loc=loc, ip=ip), scale_x2.ir_value(loc=loc, ip=ip)], _DECODE_PTX,
        "=r,=r,=r,=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    words = [llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip) for i in range(4)]
    packed = vector.from_elements(ir.VectorType.get([4], T.i32()), words, loc=loc, ip=ip)
    values = llvm.bitcast(ir.VectorType.get([8], cutlass.BFloat16.mlir_type), packed,
                          loc=loc, ip=ip)
    return cute.TensorSSA(values, (8,), cutlass.BFloat16)


class Nvfp4GemmSm90:
    """Compile-time configuration: tile_m (64 or 128 = consumer warpgroups x 64), N, K."""

    def __init__(self, tile_m: int, n: int, k: int):
        if tile_m not in (64, 128):
            raise ValueError("tile_m is 64 or 128")
        if n % TILE_N or k % TILE_K:
            raise ValueError(f"nvfp4 sm90 GEMM needs N % {TILE_N} == 0 and K % {TILE_K} == 0, "
                             f"got N={n}, K={k}")
        self.tile_m, self.n, self.k = tile_m, n, k
        self.tile_mnk = (tile_m, TILE_N, TILE_K)
        self.num_consumer_wg = tile_m // 64
        self.consumer_threads = 128 * self.num_consumer_wg
        self.threads = 128 + self.consumer_threads
        self.x_dtype = self.b_dtype = cutlass.BFloat16
        self.acc_dtype, self.out_dtype = cutlass.Float32, cutlass.BFloat16
        # Per stage: the bf16 activation tile, the packed weight tile, its scales.
        stage_bytes = tile_m * TILE_K * 2 + TILE_N * TILE_K // 2 + TILE_N * TILE_K // 16
        decoded_bytes = 2 * TILE_N * TILE_K * 2  # two decoded bf16 B tiles
        self.stages = min(4, (SMEM_BYTES - decoded_bytes - 1024) // stage_bytes)
        # 16-byte chunks of packed weight per k-tile, split over the consumer threads.
        self.chunks_per_thread = TILE_N * TILE_K // 2 // 16 // self.consumer_threads

    def compile(self, stream=None):
        bf16, u8, f32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32
        return cute.compile(
            self, gmem_ptr(bf16), gmem_ptr(u8), gmem_ptr(u8), gmem_ptr(f32, align=4),
            gmem_ptr(bf16), cutlass.Int32(1),
            stream if stream is not None else placeholder_stream(), options="--keep-ptx")

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, packed_ptr: cute.Pointer, scale_ptr: cute.Pointer,
                 tensor_scale_ptr: cute.Pointer, out_ptr: cute.Pointer, m: cutlass.Int32,
                 stream: cuda.CUstream):
        n, k = self.n, self.k
        mX = cute.make_tensor(x_ptr, cute.make_layout((m, k), stride=(k, 1)))
        mP = cute.make_tensor(packed_ptr, cute.make_layout((n, k // 2), stride=(k // 2, 1)))
        mS = cute.make_tensor(scale_ptr, cute.make_layout((n, k // 16), stride=(k // 16, 1)))
        mTs = cute.make_tensor(tensor_scale_ptr, cute.make_layout(1))
        mC = cute.make_tensor(out_ptr, cute.make_layout((m, n), stride=(n, 1)))

        row = LayoutEnum.ROW_MAJOR  # x [M,K] and the decoded W [N,K] are K-major
        tiled_mma = sm90.make_trivial_tiled_mma(
            self.x_dtype, self.b_dtype, row.sm90_mma_major_mode(), row.sm90_mma_major_mode(),
            self.acc_dtype, (self.num_consumer_wg, 1, 1), tiler_mn=(64, TILE_N))
        x_smem = sm90.make_smem_layout_a(row, self.tile_mnk, self.x_dtype, self.stages)
        b_smem = sm90.make_smem_layout_b(row, self.tile_mnk, self.b_dtype, 2)
        p_smem = cute.make_layout((TILE_N, TILE_K // 2, self.stages),
                                  stride=(TILE_K // 2, 1, TILE_N * TILE_K // 2))
        s_smem = cute.make_layout((TILE_N, TILE_K // 16, self.stages),
                                  stride=(TILE_K // 16, 1, TILE_N * TILE_K // 16))

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, tma_mX = cpasync.make_tiled_tma_atom(
            load, mX, cute.slice_(x_smem, (None, None, 0)), (self.tile_m, TILE_K))
        tma_p, tma_mP = cpasync.make_tiled_tma_atom(
            load, mP, cute.slice_(p_smem, (None, None, 0)), (TILE_N, TILE_K // 2))
        tma_s, tma_mS = cpasync.make_tiled_tma_atom(
            load, mS, cute.slice_(s_smem, (None, None, 0)), (TILE_N, TILE_K // 16))

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sX: cute.struct.Align[cute.struct.MemRange[self.x_dtype, cute.cosize(x_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(p_smem)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(s_smem)], 128]
        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(m, self.tile_m), n // TILE_N, 1)
        self.kernel(tma_x, tma_mX, tma_p, tma_mP, tma_s, tma_mS, mTs, mC, tiled_mma,
                    x_smem, b_smem, p_smem, s_smem).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_p: cute.CopyAtom, mP: cute.Tensor,
               tma_s: cute.CopyAtom, mS: cute.Tensor, mTs: cute.Tensor, mC: cute.Tensor,
               tiled_mma: cute.TiledMma, x_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               p_smem: cute.Layout, s_smem: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        tile_m, tile_n, _ = cute.arch.block_idx()
        if warp_idx == 0:
            for atom in (tma_x, tma_p, tma_s):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        stage_bytes = (cute.size_in_bytes(self.x_dtype, cute.slice_(x_smem, (None, None, 0)))
                       + cute.size_in_bytes(cutlass.Uint8, cute.slice_(p_smem, (None, None, 0)))
                       + cute.size_in_bytes(cutlass.Uint8, cute.slice_(s_smem, (None, None, 0))))
        # TMA completes a stage by transaction count; each consumer warp releases it once.
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     4 * self.num_consumer_wg),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sX = storage.sX.get_tensor(x_smem.outer, swizzle=x_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sP = storage.sP.get_tensor(p_smem)
        sS = storage.sS.get_tensor(s_smem)

        gX = cute.local_tile(mX, (self.tile_m, TILE_K), (None, None))
        gP = cute.local_tile(mP, (TILE_N, TILE_K // 2), (None, None))
        gS = cute.local_tile(mS, (TILE_N, TILE_K // 16), (None, None))
        tXsX, tXgX = cpasync.tma_partition(tma_x, 0, cute.make_layout(1),
                                           cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tPsP, tPgP = cpasync.tma_partition(tma_p, 0, cute.make_layout(1),
                                           cute.group_modes(sP, 0, 2), cute.group_modes(gP, 0, 2))
        tSsS, tSgS = cpasync.tma_partition(tma_s, 0, cute.make_layout(1),
                                           cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
        k_tiles = self.k // TILE_K

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            # ---------------- producer: one warp streams the three tiles of each k-tile
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.stages)
                for kt in cutlass.range(k_tiles, unroll=1):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(tma_x, tXgX[(None, tile_m, kt)], tXsX[(None, state.index)],
                              tma_bar_ptr=bar)
                    cute.copy(tma_p, tPgP[(None, tile_n, kt)], tPsP[(None, state.index)],
                              tma_bar_ptr=bar)
                    cute.copy(tma_s, tSgS[(None, tile_n, kt)], tSsS[(None, state.index)],
                              tma_bar_ptr=bar)
                    pipe.producer_commit(state)
                    state.advance()
                pipe.producer_tail(state)
        else:
            # ---------------- consumers: decode into sB, WGMMA, epilogue
            ctidx = tidx - 128
            thr_mma_wg = tiled_mma.get_slice((wg_idx - 1) * 128)
            thr_mma = tiled_mma.get_slice(ctidx)
            tCrX = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sX))
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
            gC = cute.local_tile(mC, (self.tile_m, TILE_N), (tile_m, tile_n))
            cC = cute.local_tile(cute.make_identity_tensor(mC.shape), (self.tile_m, TILE_N),
                                 (tile_m, tile_n))
            acc = cute.make_rmem_tensor(thr_mma_wg.partition_C(gC).shape, self.acc_dtype)
            acc.fill(0.0)
            k_blocks = cute.size(tCrX, mode=[2])
            decoded_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.consumer_threads)
            # Decoded values go out 8 at a time (16 bytes, contiguous under the 128B swizzle).
            sB_chunks = cute.zipped_divide(sB, (1, 8))
            words = cute.make_rmem_tensor((4,), cutlass.Uint32)
            values = cute.make_rmem_tensor((8,), self.b_dtype)

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.consumer_wait(state)
                buf = kt % 2
                sP32 = cute.recast_tensor(sP[(None, None, state.index)], cutlass.Uint32)
                for c in cutlass.range_constexpr(self.chunks_per_thread):
                    chunk = ctidx + c * self.consumer_threads
                    row = chunk // 8          # 8 chunks of 16 bytes per 128-byte packed row
                    col16 = chunk % 8         # 32 K values per chunk, 2 block scales
                    for j in cutlass.range_constexpr(4):
                        words[j] = sP32[(row, col16 * 4 + j)]
                    for half in cutlass.range_constexpr(2):
                        scale_byte = sS[(row, col16 * 2 + half, state.index)]
                        scale = scale_to_bf16x2(cutlass.Uint32(scale_byte))
                        for j in cutlass.range_constexpr(2):
                            values.store(decode_e2m1x8(words[half * 2 + j], scale))
                            k8 = col16 * 4 + half * 2 + j   # which 8-value group along K
                            cute.autovec_copy(values, sB_chunks[(None, (row, k8, buf))])
                # Generic-proxy stores, read next by WGMMA through the async proxy.
                cute.arch.fence_proxy("async.shared", space="cta")
                decoded_bar.arrive_and_wait()

                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, tCrX[(None, None, kb, state.index)],
                              tCrB[(None, None, kb, buf)], acc)
                warpgroup.commit_group()
                # The stage's activations and this buffer are free once the WGMMAs are done; the
                # other buffer is decoded next, and the barrier after it orders the reuse.
                warpgroup.wait_group(0)
                pipe.consumer_release(state)
                state.advance()

            # ---------------- epilogue: tensor scale, bf16, rows past M skipped
            tensor_scale = mTs[0]
            tCgC = thr_mma.partition_C(gC)
            tCcC = thr_mma.partition_C(cC)
            m_total = mC.shape[0]
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, _ = tCcC[i]
                if row < m_total:
                    tCgC[i] = (acc[i] * tensor_scale).to(self.out_dtype)


_cache = CompileCache()


def compiled_kernel(tile_m: int, n: int, k: int):
    return _cache.get((tile_m, n, k),
                      lambda: Nvfp4GemmSm90(tile_m, n, k).compile(current_stream()))


def supported(n: int, k: int) -> bool:
    return n % TILE_N == 0 and k % TILE_K == 0


def nvfp4_gemm_sm90(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                    tensor_scale: torch.Tensor, out: torch.Tensor | None = None,
                    tile_m: int | None = None) -> torch.Tensor:
    """bf16 [M, N] = x @ W^T for bf16 x [M, K] and W = (packed, block_scale, tensor_scale)."""
    m, k = x.shape
    n = packed.shape[0]
    if not supported(n, k) or packed.shape[1] * 2 != k or block_scale.shape != (n, k // 16):
        raise ValueError(f"unsupported shapes: x {tuple(x.shape)}, packed {tuple(packed.shape)}")
    x = x.to(torch.bfloat16).contiguous()
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    tile_m = tile_m or (64 if m <= 64 else 128)
    fn = compiled_kernel(tile_m, n, k)
    fn(gmem_ptr(cutlass.BFloat16, x.data_ptr()), gmem_ptr(cutlass.Uint8, packed.data_ptr()),
       gmem_ptr(cutlass.Uint8, block_scale.data_ptr()),
       gmem_ptr(cutlass.Float32, tensor_scale.data_ptr(), align=4),
       gmem_ptr(cutlass.BFloat16, out.data_ptr()), m, current_stream())
    return out
