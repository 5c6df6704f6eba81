"""FP8 GEMM for Blackwell (sm_100a) in CuTe DSL: the sm90 kernel's contract on tcgen05 MMA.

out[M, N] (bf16) = (qx @ qw^T) * x_scale[:, None] * w_scale[None, :] (+ residual), qx/qw e4m3 K-major.

tcgen05 differs from Hopper's WGMMA in where things live: one thread issues the MMA for the whole
CTA (or CTA pair), operands come from shared memory through descriptors, and the fp32 accumulator
sits in tensor memory (TMEM), not registers; the epilogue warps copy it out with tcgen05.ld.

Warp roles (192 threads): warps 0-3 run the epilogue (warp w reads TMEM lanes 32w..32w+31, the
rows it owns), warp 4 is the TMA producer, warp 5 issues tcgen05.mma. One output tile per CTA.

Variants: cta_group=1 is a 128 x tile_n MMA per SM; cta_group=2 is the 2-SM MMA
(tcgen05.mma.cta_group::2): a cluster of two CTAs computes a 256 x tile_n tile, each CTA holding
half of A and half of B in its shared memory, and the leader CTA issues the MMA for both.

`fp8_gemm_sm100(qx, x_scale, qw, w_scale, residual)` is the call the FP8 format selects on
capability 10.x (N % 256 == 0, K % 64 == 0): the 2-SM MMA from 256 rows, one SM below. Compiled
for sm_100a and its PTX inspected in CI (tests/test_fp8.py); its numerics are those of the Hopper
kernel of the same contract.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100
import torch
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from engine.kernels.cute.common import (CompileCache, compile_scaled_gemm, current_stream, scaled_gemm_tensors,
                                        tensor_ptr, tma_rows)
from engine.kernels.cute.epilogue import scale_accumulators

SMEM_BYTES = 227 * 1024


class Fp8GemmSm100:
    """Compile-time configuration: CTA group (1 or 2 SMs per MMA), N, K, residual or not."""

    def __init__(self, cta_group: int, n: int, k: int, has_residual: bool, tile_n: int = 256):
        if cta_group not in (1, 2):
            raise ValueError("cta_group is 1 (one SM per MMA) or 2 (an SM pair)")
        if n % tile_n or k % 64:
            raise ValueError(f"fp8 sm100 GEMM needs N % {tile_n} == 0 and K % 64 == 0, got N={n}, K={k}")
        self.cta_group, self.n, self.k, self.has_residual = cta_group, n, k, has_residual
        self.mma_tiler_mn = (128 * cta_group, tile_n)
        self.ab_dtype, self.acc_dtype, self.out_dtype = (cutlass.Float8E4M3FN, cutlass.Float32,
                                                         cutlass.BFloat16)
        self.epilogue_warps = (0, 1, 2, 3)
        self.tma_warp, self.mma_warp = 4, 5
        self.threads = 32 * 6
        self.out_layout = LayoutEnum.ROW_MAJOR
        self.c_stages = 2

    def compile(self):
        return compile_scaled_gemm(self)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, xs_ptr: cute.Pointer,
                 ws_ptr: cute.Pointer, out_ptr: cute.Pointer, res_ptr: cute.Pointer,
                 m: cutlass.Int32, a_rows: cutlass.Int32, stream: cuda.CUstream):
        n, k = self.n, self.k
        mA, mB, mXs, mWs, mC, mR = scaled_gemm_tensors(a_ptr, b_ptr, xs_ptr, ws_ptr, out_ptr, res_ptr, m, a_rows,
                                                       n, k)

        k_major = LayoutEnum.ROW_MAJOR.mma_major_mode()
        cta_group = tcgen05.CtaGroup.TWO if self.cta_group == 2 else tcgen05.CtaGroup.ONE
        tiled_mma = sm100.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, k_major, k_major,
                                                 self.acc_dtype, cta_group, self.mma_tiler_mn)
        # Four MMA instructions (k32 each for fp8) per k-tile.
        self.mma_tiler = (*self.mma_tiler_mn, cute.size(tiled_mma.shape_mnk, mode=[2]) * 4)
        self.cta_tile = (self.mma_tiler[0] // self.cta_group, self.mma_tiler[1], self.mma_tiler[2])
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)),
                                                (tiled_mma.thr_id.shape,))
        self.epi_tile = sm100.compute_epilogue_tile_shape(self.cta_tile, self.cta_group == 2,
                                                          self.out_layout, self.out_dtype)

        one_a = sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        one_b = sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        one_c = sm100.make_smem_layout_epi(self.out_dtype, self.out_layout, self.epi_tile, 1)
        ab_stage_bytes = (cute.size_in_bytes(self.ab_dtype, one_a)
                          + cute.size_in_bytes(self.ab_dtype, one_b))
        c_bytes = cute.size_in_bytes(self.out_dtype, one_c) * self.c_stages
        self.ab_stages = (SMEM_BYTES - 1024 - c_bytes) // ab_stage_bytes
        a_smem = sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)
        b_smem = sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)
        c_smem = sm100.make_smem_layout_epi(self.out_dtype, self.out_layout, self.epi_tile,
                                            self.c_stages)

        a_one = cute.slice_(a_smem, (None, None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, None, 0))
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100.cluster_shape_to_tma_atom_A((self.cta_group, 1), tiled_mma.thr_id), mA, a_one,
            self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100.cluster_shape_to_tma_atom_B((self.cta_group, 1), tiled_mma.thr_id), mB, b_one,
            self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape)
        # Both CTAs of a pair land their halves on the leader's barrier: count both.
        self.tma_bytes = (cute.size_in_bytes(self.ab_dtype, a_one)
                          + cute.size_in_bytes(self.ab_dtype, b_one)) * self.cta_group
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(c_smem, (None, None, 0)), self.epi_tile)
        self.tmem_cols = utils.get_num_tmem_alloc_cols(
            tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])))

        grid = (cute.round_up(cute.ceil_div(m, self.cta_tile[0]), self.cta_group), n // self.mma_tiler[1], 1)
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, mXs, mWs, mR,
                    cluster_layout_vmnk, a_smem, b_smem, c_smem, self.epi_tile).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(self.cta_group, 1, 1), stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
               tma_b: cute.CopyAtom, mB: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor,
               mXs: cute.Tensor, mWs: cute.Tensor, mR: cute.Tensor, cluster_layout_vmnk: cute.Layout,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout,
               epi_tile: cute.Tile):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        two_cta = self.cta_group == 2
        if warp_idx == self.tma_warp:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        bidx, bidy, _ = cute.arch.block_idx()
        mma_coord_v = bidx % self.cta_group
        is_leader = mma_coord_v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank)
        tile_m, tile_n = bidx // self.cta_group, bidy

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_dealloc_barrier: cutlass.Int64
            tmem_base: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tma_bytes, cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True,
        ).make_participants()
        # The MMA warp signals "accumulator ready" once; the 128 epilogue threads wait on it.
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        # TMEM is allocated by epilogue warp 0; the MMA warp and the epilogue warps read its address.
        tmem = utils.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=2, num_threads=128 + 32),
            allocator_warp_id=0, is_two_cta=two_cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_barrier.ptr)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        sA = smem.allocate_tensor(element_type=self.ab_dtype, layout=a_smem.outer,
                                  byte_alignment=128, swizzle=a_smem.inner)
        sB = smem.allocate_tensor(element_type=self.ab_dtype, layout=b_smem.outer,
                                  byte_alignment=128, swizzle=b_smem.inner)
        sC = smem.allocate_tensor(element_type=self.out_dtype, layout=c_smem.outer,
                                  byte_alignment=128, swizzle=c_smem.inner)

        # Global tiles (bM, bK, RestM, RestK) etc., partitioned by this CTA's half of the MMA.
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None))
        gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape),
                             cute.slice_(self.mma_tiler, (None, None, 0)), (None, None))
        thr_mma = tiled_mma.get_slice(mma_coord_v)
        tCgA, tCgB = thr_mma.partition_A(gA), thr_mma.partition_B(gB)
        tCgC, tCcC = thr_mma.partition_C(gC), thr_mma.partition_C(cC)
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cpasync.tma_partition(
            tma_a, cluster_coord_vmnk[2], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, cluster_coord_vmnk[1], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        tAgA = tAgA[(None, tile_m, None)]
        tBgB = tBgB[(None, tile_n, None)]
        a_mcast = b_mcast = None
        if cutlass.const_expr(two_cta):
            # The pair's TMA loads signal the leader CTA's barrier.
            a_mcast = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord_vmnk, mcast_mode=2)
            b_mcast = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord_vmnk, mcast_mode=1)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        if warp_idx == self.tma_warp:
            # ---------------- TMA producer
            for kt in cutlass.range(k_tiles, unroll=1):
                handle = ab_producer.acquire_and_advance()
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, handle.index)],
                          tma_bar_ptr=handle.barrier, mcast_mask=a_mcast)
                cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, handle.index)],
                          tma_bar_ptr=handle.barrier, mcast_mask=b_mcast)
            ab_producer.tail()

        if warp_idx == self.mma_warp:
            # ---------------- MMA issuer (the leader CTA's MMA covers the pair)
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
            if is_leader:
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kt in cutlass.range(k_tiles, unroll=1):
                    handle = ab_consumer.wait_and_advance()
                    for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                        coord = (None, None, kb, handle.index)
                        cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    handle.release()
                acc_pipe.producer_commit(acc_state)

        if warp_idx < 4:
            # ---------------- epilogue: TMEM -> registers, scale (+residual), bf16, TMA store
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(tmem_ptr, acc_layout)
            tmem.relinquish_alloc_permit()
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            acc_pipe.consumer_wait(acc_state)
            self.epilogue(tidx, warp_idx, tCtAcc, tCgC, tCcC, sC, tma_c, mXs, mWs, mR, tile_m, tile_n,
                          epi_tile)
            pipeline.NamedBarrier(barrier_id=1, num_threads=128).arrive_and_wait()
            tmem.free(tmem_ptr)

    @cute.jit
    def epilogue(self, tidx, warp_idx, tCtAcc, tCgC, tCcC, sC, tma_c, mXs, mWs, mR, tile_m, tile_n,
                 epi_tile):
        t2r_atom = sm100.get_tmem_load_op(self.cta_tile, self.out_layout, self.out_dtype,
                                          self.acc_dtype, epi_tile, self.cta_group == 2)
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0)], epi_tile)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
        tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
        # Output coordinates in the same per-thread layout as the accumulator registers.
        cC_epi = cute.flat_divide(tCcC[((None, None), 0, 0, None, None)], epi_tile)
        tTR_cC = thr_t2r.partition_D(cC_epi)[(None, None, None, None, None, tile_m, tile_n)]
        tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))
        tTR_rAcc = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0)].shape, self.acc_dtype)
        tTR_rOut = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)

        r2s = cute.make_tiled_copy_D(
            sm100.get_smem_store_op(self.out_layout, self.out_dtype, self.acc_dtype, t2r), t2r)
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_rOut = r2s.retile(tTR_rOut)
        gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None)], epi_tile)
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                               cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2))
        bSG_gC = cute.group_modes(bSG_gC[(None, None, None, tile_m, tile_n)], 1, 3)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.c_stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128))
        epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=128)

        for sub in cutlass.range(cute.size(tTR_tAcc.shape, mode=[3])):
            cute.copy(t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
            scale_accumulators(tTR_rAcc, tTR_cC[(None, None, None, sub)], mXs, mWs, mR,
                               self.has_residual, self.acc_dtype)
            tRS_rOut.store(r2s.retile(tTR_rAcc).load().to(self.out_dtype))
            buf = sub % self.c_stages
            cute.copy(r2s, tRS_rOut, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if warp_idx == 0:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, sub)])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_bar.arrive_and_wait()
        store_pipe.producer_tail()


_cache = CompileCache()
TILE_N = 256


def fp8_gemm_sm100(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = (qx @ qw^T) * x_scale[:, None] * w_scale (+ residual); CUDA tensors, sm_100."""
    m, k = qx.shape
    n = qw.shape[0]
    cta_group = 2 if m >= 256 else 1
    fn = _cache.get((cta_group, n, k, residual is not None),
                    lambda: Fp8GemmSm100(cta_group, n, k, residual is not None, TILE_N).compile())
    qx, qw = qx.contiguous(), qw.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    out = torch.empty(m, n, device=qx.device, dtype=torch.bfloat16)
    res = residual.to(torch.bfloat16).contiguous() if residual is not None else out
    fn(tensor_ptr(qx), tensor_ptr(qw), tensor_ptr(x_scale, 4), tensor_ptr(w_scale, 4), tensor_ptr(out),
       tensor_ptr(res), m, tma_rows(qx, 128 * cta_group), current_stream())
    return out
