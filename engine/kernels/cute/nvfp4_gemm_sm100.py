"""NVFP4 x NVFP4 GEMM for Blackwell (sm_100a) in CuTe DSL: tcgen05 block-scaled MMA.

out[M, N] (bf16) = (A @ B^T) * alpha, A = activations [M, K] and B = weights [N, K], both e2m1
(packed two per byte, low nibble = even K) with one e4m3 scale per 16 elements along K in the
128x4 blocked order (engine/formats/nvfp4.py `to_blocked`), alpha = the product of the two fp32
tensor scales, read from device memory so a graph replay can change it. N % 128 == 0, K % 256 == 0.

`tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16`: the MMA multiplies e2m1
operands from shared memory and applies the e4m3 block scales itself, which it reads from tensor
memory (TMEM), so each k-tile's scale factors are staged gmem -> smem (TMA, in the 128x4 blocked
layout `to_blocked` writes) -> TMEM (tcgen05.cp 4x32x128b) before the MMAs that use them. The fp32
accumulator also lives in TMEM; the epilogue reads it with tcgen05.ld, multiplies by alpha (the
tensor scales folded in once, not per k-step), and stores bf16 rows.

Warp roles (192 threads): warps 0-3 epilogue (warp w owns TMEM lanes = output rows 32w..32w+31),
warp 4 TMA producer, warp 5 MMA issuer; one 128 x tile_n output tile per CTA, a 256-deep k-tile
(4 MMAs of k64) per pipeline stage.

`nvfp4_gemm_sm100(...)` is the call the NVFP4 format selects on capability 10.x. Compiled for
sm_100a and its PTX inspected in CI (tests/test_nvfp4.py).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as blockscaled
import torch
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator

from engine.kernels.cute.common import CompileCache, current_stream, gmem_ptr, placeholder_stream

SF_VEC = 16          # elements per block scale
MMA_K = 64           # K of one tcgen05 mxf4nvf4 MMA
K_TILE = 4 * MMA_K   # K per pipeline stage
SMEM_BYTES = 227 * 1024

_compiled = CompileCache()


class Nvfp4GemmSm100:
    """Compile-time configuration: N, K (the weight's shape) and the output tile width."""

    def __init__(self, n: int, k: int, tile_n: int = 128):
        if n % tile_n or k % K_TILE:
            raise ValueError(f"nvfp4 sm100 GEMM needs N % {tile_n} == 0 and K % {K_TILE} == 0, "
                             f"got N={n}, K={k}")
        self.n, self.k, self.tile_n = n, k, tile_n
        self.ab_dtype, self.sf_dtype = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN
        self.acc_dtype, self.out_dtype = cutlass.Float32, cutlass.BFloat16
        self.mma_tiler = (128, tile_n, K_TILE)
        self.epilogue_warps = 4
        self.tma_warp, self.mma_warp = 4, 5
        self.threads = 32 * 6

    def compile(self):
        """Compile for CUTE_DSL_ARCH (or the current GPU) with placeholder pointers."""
        fp4, e4m3, f32, bf16 = self.ab_dtype, self.sf_dtype, cutlass.Float32, cutlass.BFloat16
        return cute.compile(
            self, gmem_ptr(fp4, align=32), gmem_ptr(fp4, align=32), gmem_ptr(e4m3),
            gmem_ptr(e4m3), gmem_ptr(f32, align=4), gmem_ptr(bf16), cutlass.Int32(1),
            placeholder_stream())

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, sfa_ptr: cute.Pointer,
                 sfb_ptr: cute.Pointer, alpha_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 m: cutlass.Int32, stream: cuda.CUstream):
        n, k = self.n, self.k
        # (rows, K, batch=1), K-major; the scale tensors follow the blocked 128x4 atom layout.
        mA = cute.make_tensor(a_ptr, cute.make_layout((m, k, 1), stride=(k, 1, m * k)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((n, k, 1), stride=(k, 1, n * k)))
        mSFA = cute.make_tensor(sfa_ptr, blockscaled.tile_atom_to_shape_SF(mA.shape, SF_VEC))
        mSFB = cute.make_tensor(sfb_ptr, blockscaled.tile_atom_to_shape_SF(mB.shape, SF_VEC))
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))
        mC = cute.make_tensor(out_ptr, cute.make_layout((m, n, 1), stride=(n, 1, m * n)))

        tiled_mma = cute.make_tiled_mma(tcgen05.MmaMXF4NVF4Op(
            self.sf_dtype, (128, self.tile_n, MMA_K), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM))
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

        def layouts(stages):
            mma, tiler = tiled_mma, self.mma_tiler
            return (sm100.make_smem_layout_a(mma, tiler, self.ab_dtype, stages),
                    sm100.make_smem_layout_b(mma, tiler, self.ab_dtype, stages),
                    blockscaled.make_smem_layout_sfa(mma, tiler, SF_VEC, stages),
                    blockscaled.make_smem_layout_sfb(mma, tiler, SF_VEC, stages))

        a_one, b_one, sfa_one, sfb_one = layouts(1)
        stage_bytes = (cute.size_in_bytes(self.ab_dtype, a_one)
                       + cute.size_in_bytes(self.ab_dtype, b_one)
                       + cute.size_in_bytes(self.sf_dtype, sfa_one)
                       + cute.size_in_bytes(self.sf_dtype, sfb_one))
        self.stages = (SMEM_BYTES - 1024) // stage_bytes
        self.tma_bytes = stage_bytes
        a_smem, b_smem, sfa_smem, sfb_smem = layouts(self.stages)

        def stage0(layout):
            return cute.slice_(layout, (None, None, None, 0))

        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mA, stage0(a_smem), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mB, stage0(b_smem), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        # Scale factors travel as 16-bit elements (TMA has no 8-bit float box type).
        tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mSFA, stage0(sfa_smem), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16)
        tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mSFB, stage0(sfb_smem), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16)

        grid = (cute.ceil_div(m, self.mma_tiler[0]), n // self.tile_n, 1)
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
                    mAlpha, mC, a_smem, b_smem, sfa_smem, sfb_smem).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
               tma_b: cute.CopyAtom, mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, mSFB: cute.Tensor, mAlpha: cute.Tensor, mC: cute.Tensor,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, sfa_smem: cute.Layout,
               sfb_smem: cute.Layout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        tile_m, tile_n, _ = cute.arch.block_idx()
        if warp_idx == self.tma_warp:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sA = smem.allocate_tensor(element_type=self.ab_dtype, layout=a_smem.outer,
                                  byte_alignment=128, swizzle=a_smem.inner)
        sB = smem.allocate_tensor(element_type=self.ab_dtype, layout=b_smem.outer,
                                  byte_alignment=128, swizzle=b_smem.inner)
        sSFA = smem.allocate_tensor(element_type=self.sf_dtype, layout=sfa_smem,
                                    byte_alignment=128)
        sSFB = smem.allocate_tensor(element_type=self.sf_dtype, layout=sfb_smem,
                                    byte_alignment=128)

        # TMA fills a stage (A, B and both scale tiles on one barrier); the MMA warp frees it.
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tma_bytes).make_participants()
        # The MMA warp commits "accumulator complete" once; the 128 epilogue threads wait on it.
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * self.epilogue_warps))
        tmem = utils.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=2,
                                                       num_threads=32 * self.epilogue_warps + 32),
            allocator_warp_id=0)

        # Global tiles and their MMA partitions: (MMA, MMA_MN, MMA_K, RestMN, RestK, RestL).
        every_tile = (None, None, None)

        def tile_a(t):
            return cute.local_tile(t, cute.slice_(self.mma_tiler, (None, 0, None)), every_tile)

        def tile_b(t):
            return cute.local_tile(t, cute.slice_(self.mma_tiler, (0, None, None)), every_tile)

        thr_mma = tiled_mma.get_slice(0)
        tCgA, tCgSFA = thr_mma.partition_A(tile_a(mA)), thr_mma.partition_A(tile_a(mSFA))
        tCgB, tCgSFB = thr_mma.partition_B(tile_b(mB)), thr_mma.partition_B(tile_b(mSFB))
        gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape),
                             cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        tCgC, tCcC = thr_mma.partition_C(gC), thr_mma.partition_C(cC)
        k_tiles = cute.size(tCgA, mode=[4])

        def tma_views(atom, s, g, tile):
            ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                           cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))
            ts, tg = cute.filter_zeros(ts), cute.filter_zeros(tg)
            return ts, tg[(None, tile, None, 0)]

        tAsA, tAgA = tma_views(tma_a, sA, tCgA, tile_m)
        tBsB, tBgB = tma_views(tma_b, sB, tCgB, tile_n)
        tAsSFA, tAgSFA = tma_views(tma_sfa, sSFA, tCgSFA, tile_m)
        tBsSFB, tBgSFB = tma_views(tma_sfb, sSFB, tCgSFB, tile_n)

        # MMA operands: smem descriptors for A/B, TMEM for accumulator and scale factors.
        tCrA, tCrB = tiled_mma.make_fragment_A(sA), tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(
            tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
        sfa_tmem_layout = blockscaled.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, (None, None, None, 0)))
        sfb_tmem_layout = blockscaled.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem, (None, None, None, 0)))

        if warp_idx == self.tma_warp:
            # ---------------- TMA producer
            for kt in cutlass.range(k_tiles, unroll=1):
                stage = ab_producer.acquire_and_advance()
                for atom, src, dst in ((tma_a, tAgA, tAsA), (tma_b, tBgB, tBsB),
                                       (tma_sfa, tAgSFA, tAsSFA), (tma_sfb, tBgSFB, tBsSFB)):
                    cute.copy(atom, src[(None, kt)], dst[(None, stage.index)],
                              tma_bar_ptr=stage.barrier)
            ab_producer.tail()

        if warp_idx == self.mma_warp:
            # ---------------- MMA issuer: stage scales smem -> TMEM, then 4 block-scaled MMAs
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(acc_ptr, acc_layout)
            sfa_ptr = cute.recast_ptr(acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc),
                                      dtype=self.sf_dtype)
            tCtSFA = cute.make_tensor(sfa_ptr, sfa_tmem_layout)
            sfb_ptr = cute.recast_ptr(acc_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc)
                                      + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
                                      dtype=self.sf_dtype)
            tCtSFB = cute.make_tensor(sfb_ptr, sfb_tmem_layout)

            s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
                                           self.sf_dtype)

            def s2t_views(s_sf, t_sf):
                t_compact = cute.filter_zeros(t_sf)
                copy = tcgen05.make_s2t_copy(s2t_atom, t_compact)
                thr = copy.get_slice(0)
                src = tcgen05.get_s2t_smem_desc_tensor(
                    copy, thr.partition_S(cute.filter_zeros(s_sf)))
                return copy, src, thr.partition_D(t_compact)

            s2t_sfa, s2t_sSFA, s2t_tSFA = s2t_views(sSFA, tCtSFA)
            s2t_sfb, s2t_sSFB, s2t_tSFB = s2t_views(sSFB, tCtSFB)

            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                stage = ab_consumer.wait_and_advance()
                # The previous k-tile's MMAs read the scale TMEM columns asynchronously, but
                # tcgen05 operations from one thread execute in issue order, so overwriting them
                # here (also tcgen05, same thread) is ordered after those reads.
                cute.copy(s2t_sfa, s2t_sSFA[(None, None, None, None, stage.index)], s2t_tSFA)
                cute.copy(s2t_sfb, s2t_sSFB[(None, None, None, None, stage.index)], s2t_tSFB)
                for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                    tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                    coord = (None, None, kb, stage.index)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                stage.release()
            acc_pipe.producer_commit(acc_state)

        if warp_idx < self.epilogue_warps:
            # ---------------- epilogue: TMEM -> registers, * alpha, bf16, one row per thread
            tmem.allocate(512)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(acc_ptr, acc_layout)
            tmem.relinquish_alloc_permit()

            t2r = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32, tcgen05.Pack.NONE),
                                    self.acc_dtype), tCtAcc)
            thr_t2r = t2r.get_slice(tidx)
            tTR_tAcc = thr_t2r.partition_S(tCtAcc)
            tTR_gC = thr_t2r.partition_D(tCgC)[(None, None, None, None, tile_m, tile_n, 0)]
            tTR_cC = thr_t2r.partition_D(tCcC)[(None, None, None, None, tile_m, tile_n, 0)]
            tTR_rAcc = cute.make_rmem_tensor(tTR_gC.shape, self.acc_dtype)
            tTR_rOut = cute.make_rmem_tensor(tTR_gC.shape, self.out_dtype)
            alpha = mAlpha[0]

            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            acc_pipe.consumer_wait(acc_state)
            cute.copy(t2r, tTR_tAcc, tTR_rAcc)
            tTR_rOut.store((tTR_rAcc.load() * alpha).to(self.out_dtype))
            # Each thread holds one output row: store it if the row exists (M tail).
            row, _, _ = tTR_cC[0]
            if row < cute.size(mC, mode=[0]):
                cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype),
                          tTR_rOut, tTR_gC)
            acc_pipe.consumer_release(acc_state)
            epilogue_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * self.epilogue_warps)
            epilogue_bar.arrive_and_wait()
            tmem.free(acc_ptr)


def compiled_gemm(n: int, k: int, tile_n: int = 128):
    """The compiled kernel for one weight shape (cached; M is a run-time argument)."""
    return _compiled.get((n, k, tile_n), lambda: Nvfp4GemmSm100(n, k, tile_n).compile())


def nvfp4_gemm_sm100(a_packed: torch.Tensor, a_blocked_scale: torch.Tensor, b_packed: torch.Tensor,
                     b_blocked_scale: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = (A @ B^T) * alpha; a_packed [M, K/2], b_packed [N, K/2] uint8 row-major, the
    scales in to_blocked's order, alpha fp32 [1]; CUDA tensors, sm_100."""
    m, n, k = a_packed.shape[0], b_packed.shape[0], b_packed.shape[1] * 2
    fn = compiled_gemm(n, k)
    out = torch.empty(m, n, device=a_packed.device, dtype=torch.bfloat16)
    fp4, e4m3 = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN
    fn(gmem_ptr(fp4, a_packed.data_ptr(), 32), gmem_ptr(fp4, b_packed.data_ptr(), 32),
       gmem_ptr(e4m3, a_blocked_scale.data_ptr()), gmem_ptr(e4m3, b_blocked_scale.data_ptr()),
       gmem_ptr(cutlass.Float32, alpha.data_ptr(), 4), gmem_ptr(cutlass.BFloat16, out.data_ptr()), m,
       current_stream())
    return out
