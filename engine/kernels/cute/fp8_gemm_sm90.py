"""FP8 GEMM for Hopper (sm_90a) in CuTe DSL: out = (qx @ qw^T) * x_scale[:, None] * w_scale[None, :] (+ residual).

qx [M, K] and qw [N, K] are float8_e4m3fn, both K-major; x_scale [M] (per token) and w_scale [N]
(per output channel) are fp32; out [M, N] is bf16. The product is accumulated in fp32 registers by
WGMMA and both scales (and the optional bf16 residual) are applied in the epilogue, in fp32, before
the single rounding to bf16.

Structure (persistent, warp-specialised):
- warpgroup 0 is the producer: one warp issues TMA loads of A and B k-tiles into a ring of
  shared-memory stages, each stage guarded by a full/empty mbarrier pair;
- warpgroups 1..2 are consumers: each owns 64 rows of the CTA tile, waits for a stage, issues
  WGMMA on it (one batch in flight), releases the stage, and at the end of the tile runs the
  epilogue (scale, residual, bf16, stmatrix to shared memory, TMA store).
The producer runs ahead into the next tile while the consumers are in the epilogue.

Accumulation precision: Hopper's FP8 WGMMA adds its products into the fp32 accumulator with a
reduced-precision internal sum (as cuBLAS with use_fast_accum=True; BENCHMARKS.md measures it). The
default ("precise") mode therefore runs each 256-deep slice of
K (two 128-deep k-tiles, `promote_every`) into a fresh WGMMA accumulator and adds it into the true
fp32 accumulator with ordinary FADDs (the promotion that cuBLAS does unless use_fast_accum=True).
Each promotion waits for its WGMMAs to drain, so promoting every second k-tile halves those stalls;
BENCHMARKS.md has the intervals' speed and accuracy. Two
accumulators in registers cap the tile at 128 x 128; fast_accum=True keeps one and allows 128 x 256.

Tile order (L2 reuse): the persistent CTAs walk the output tiles in column groups of `swizzle` N
tiles, row by row within a group, so one wave of 132 tiles touches 132/swizzle row-blocks of A and `swizzle`
column-blocks of B (e.g. 8 MB + 4 MB at 128 x 128 tiles, swizzle 8, K = 4096) instead of a whole
column of A tiles (32 MB at M = 8192), which L2 cannot hold beside the B stream.

M is a run-time argument: the stores stop at row M, so any M >= 1 works with one compiled kernel.
A is described to TMA with its rows rounded up to whole tiles where its storage holds them (FP8
activations are allocated so: engine/kernels/platform.py `activation_empty`). A box that crosses
A's last row, which TMA zero-fills, is slow to load (BENCHMARKS.md, "FP8 GEMMs", has the times). N
and K are compile-time constants (multiples of 64).
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
import torch
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from engine.kernels.cute.common import (CompileCache, compile_scaled_gemm, current_stream, scaled_gemm_tensors,
                                        tensor_ptr, tma_rows)
from engine.kernels.platform import sm_count
from engine.kernels.cute.epilogue import scale_accumulators

# Tiles the dispatcher chooses from, largest first: (tile_m, tile_n). tile_k is 128 (four k32 WGMMAs).
TILES = ((128, 256), (128, 128), (64, 128), (64, 64))
PRECISE_TILES = TILES[1:]  # two 64 x tile_n fp32 accumulators per thread must fit in registers
TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.9, (64, 128): 0.6, (64, 64): 0.45}
TILE_K = 128
# k-tiles per fp32 promotion in the precise mode (see the module docstring).
PROMOTE_EVERY = 2
SMEM_BYTES = 227 * 1024


def choose_promote_every(k: int) -> int:
    """The largest promotion interval (in 128-deep k-tiles, <= PROMOTE_EVERY) that divides K's k-tiles."""
    k_tiles = math.ceil(k / TILE_K)
    return next(p for p in range(PROMOTE_EVERY, 0, -1) if k_tiles % p == 0)


def choose_swizzle(n_tiles: int) -> int:
    """The largest group of N tiles (<= 8) that divides the N tiles: a group that does not divide
    them would round N up and schedule tiles past the matrix."""
    return next(s for s in (8, 4, 2, 1) if n_tiles % s == 0)


def check_shapes(n: int, k: int) -> None:
    if n % 64 or k % 64:
        raise ValueError(f"fp8 sm90 GEMM needs N and K to be multiples of 64, got N={n}, K={k}")


def choose_tile(m: int, n: int, num_sms: int, fast_accum: bool = False) -> tuple[int, int]:
    """The tile with the least modelled time: waves of tiles over the SMs x time per tile.

    Time per tile is its area over a relative efficiency (smaller tiles re-read more operand bytes
    per FLOP and issue narrower WGMMAs), so a smaller tile wins only by filling waves better. The
    64-row tiles' efficiencies are fitted to the time of a wave of each tile at Llama-3.1-8B's
    shapes, M = 136 to 512 (BENCHMARKS.md, "FP8 GEMMs").
    """
    def cost(tile):
        tiles = math.ceil(m / tile[0]) * (n // tile[1])
        return math.ceil(tiles / num_sms) * tile[0] * tile[1] / TILE_EFFICIENCY[tile]
    return min((t for t in (TILES if fast_accum else PRECISE_TILES) if n % t[1] == 0), key=cost)


class Fp8GemmSm90:
    """Compile-time configuration: tile shape, N, K, residual or not, accumulation mode, SM count,
    tile-order group (swizzle)."""

    def __init__(self, tile_mn: tuple[int, int], n: int, k: int, has_residual: bool, num_sms: int,
                 fast_accum: bool = False, swizzle: int | None = None, promote_every: int = PROMOTE_EVERY):
        check_shapes(n, k)
        self.tile_m, self.tile_n = tile_mn
        if tuple(tile_mn) not in (TILES if fast_accum else PRECISE_TILES) or n % self.tile_n:
            raise ValueError(f"tile {tile_mn} is not available for N={n}, fast_accum={fast_accum}")
        self.fast_accum = fast_accum
        self.n, self.k = n, k
        self.swizzle = swizzle or choose_swizzle(n // self.tile_n)
        if (n // self.tile_n) % self.swizzle:
            raise ValueError(f"swizzle {self.swizzle} does not divide the {n // self.tile_n} N tiles")
        self.has_residual = has_residual
        self.num_sms = num_sms
        self.tile_mnk = (self.tile_m, self.tile_n, TILE_K)
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.Float8E4M3FN
        self.out_dtype = cutlass.BFloat16
        # One consumer warpgroup per 64 rows: a 64 x tile_n fp32 accumulator is tile_n/2 registers
        # per thread, which leaves room for the epilogue at tile_n = 256.
        self.num_consumer_wg = self.tile_m // 64
        self.threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        self.producer_regs, self.consumer_regs = 40, 232
        self.epi_tile = (self.tile_m, 32)
        self.epi_stages = 2
        ab_bytes = (self.tile_m + self.tile_n) * TILE_K
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stages
        self.ab_stages = min(8, (SMEM_BYTES - epi_bytes - 1024) // ab_bytes)
        # The consumers hold `promote_every` stages until their batch of WGMMAs drains: fewer than
        # the ring's stages, or the producer could never fill the next one. K's k-tiles must split
        # into whole batches (K is compile-time, so this is checked once).
        self.promote_every = 1 if fast_accum else promote_every
        k_tiles = math.ceil(k / TILE_K)
        if self.promote_every >= self.ab_stages or k_tiles % self.promote_every:
            raise ValueError(f"promote_every={promote_every} needs fewer than {self.ab_stages} stages and to "
                             f"divide the {k_tiles} k-tiles of K={k}")

    def compile(self, stream=None):
        """Compile for the current target with placeholder pointers (M stays a run-time argument)."""
        return compile_scaled_gemm(self, stream)

    # ---------------------------------------------------------------- host side (traced once)
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, xs_ptr: cute.Pointer,
                 ws_ptr: cute.Pointer, out_ptr: cute.Pointer, res_ptr: cute.Pointer,
                 m: cutlass.Int32, a_rows: cutlass.Int32, stream: cuda.CUstream):
        n, k = self.n, self.k
        mA, mB, mXs, mWs, mC, mR = scaled_gemm_tensors(a_ptr, b_ptr, xs_ptr, ws_ptr, out_ptr, res_ptr, m, a_rows,
                                                       n, k)

        row = LayoutEnum.ROW_MAJOR  # A [M,K], B [N,K] are K-major; C [M,N] is N-major
        tiled_mma = sm90.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, row.sm90_mma_major_mode(), row.sm90_mma_major_mode(),
            self.acc_dtype, (self.num_consumer_wg, 1, 1), tiler_mn=(64, self.tile_n))
        a_smem = sm90.make_smem_layout_a(row, self.tile_mnk, self.ab_dtype, self.ab_stages)
        b_smem = sm90.make_smem_layout_b(row, self.tile_mnk, self.ab_dtype, self.ab_stages)
        epi_smem = sm90.make_smem_layout_epi(self.out_dtype, row, self.epi_tile, self.epi_stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            load_op, mA, cute.slice_(a_smem, (None, None, 0)), (self.tile_m, TILE_K))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(
            load_op, mB, cute.slice_(b_smem, (None, None, 0)), (self.tile_n, TILE_K))
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(epi_smem, (None, None, 0)),
            self.epi_tile)

        tiles_mnl = (cute.ceil_div(m, self.tile_m), n // self.tile_n, 1)
        sched_params = utils.PersistentTileSchedulerParams(tiles_mnl, (1, 1, 1), swizzle_size=self.swizzle,
                                                           raster_along_m=True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(epi_smem)], 1024]
        self.shared_storage = SharedStorage

        self.kernel(tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, mXs, mWs, mR, tiled_mma,
                    a_smem, b_smem, epi_smem, sched_params).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1,
            stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, mXs: cute.Tensor, mWs: cute.Tensor,
               mR: cute.Tensor, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, epi_smem: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        storage = SmemAllocator().allocate(self.shared_storage)
        stage_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0)))
                       + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem, (None, None, 0))))
        # The producer's TMA completes a stage by transaction count; consumers release it once per
        # warp (4 warps per consumer warpgroup).
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)

        # Every tile of each operand: (bM, bK, RestM, RestK), (bN, bK, RestN, RestK), (bM, bN, RestM, RestN).
        gA = cute.local_tile(mA, (self.tile_m, TILE_K), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, TILE_K), (None, None))
        gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), (self.tile_m, self.tile_n),
                             (None, None))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        k_tiles = cute.size(gA, mode=[3])
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            # ---------------- producer warpgroup: one warp streams A/B k-tiles with TMA
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = sched.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.ab_stages)
                while work.is_valid_tile:
                    tile = work.tile_idx
                    tAgA_t = tAgA[(None, tile[0], None)]
                    tBgB_t = tBgB[(None, tile[1], None)]
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(state)
                        state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(state)
        else:
            # ---------------- consumer warpgroups: WGMMA main loop, then the epilogue
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctidx = tidx - 128
            # WGMMA operands are per warpgroup (slice at its first thread); C coordinates per thread.
            thr_mma_wg = tiled_mma.get_slice((wg_idx - 1) * 128)
            thr_mma = tiled_mma.get_slice(ctidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma_wg.partition_C(gC[(None, None, 0, 0)]).shape,
                                        self.acc_dtype)
            acc_kt = cute.make_rmem_tensor(acc.shape, self.acc_dtype)  # per k-tile, unless fast_accum
            k_blocks = cute.size(tCrA, mode=[2])

            # Epilogue copies: registers -> shared memory (stmatrix) -> global memory (TMA store).
            st_tiled = cute.make_tiled_copy_S(
                sm90.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, self.acc_dtype),
                cute.make_tiled_copy_C_atom(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.out_dtype),
                    tiled_mma))
            thr_st = st_tiled.get_slice(ctidx)
            tRS_sC = thr_st.partition_D(sC)
            tRS_acc = st_tiled.retile(acc)
            rD_shape = cute.shape(thr_st.partition_S(sC))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            tRS_rOut = cute.make_rmem_tensor(rD_shape, self.out_dtype)
            per_epi = cute.size(tRS_rD)
            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_consumer_threads))

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                      self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                         self.ab_stages)
            while work.is_valid_tile:
                tile = work.tile_idx
                acc.fill(0.0)
                if cutlass.const_expr(self.fast_accum):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.consumer_wait(read_state)
                        for kb in cutlass.range_constexpr(k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        warpgroup.commit_group()
                        # One WGMMA batch stays in flight; the batch before it has finished
                        # reading its stage, which goes back to the producer.
                        warpgroup.wait_group(1)
                        if kt > 0:
                            ab_pipe.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                    warpgroup.wait_group(0)
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                else:
                    for _ in cutlass.range(k_tiles // self.promote_every, unroll=1):
                        # A fresh WGMMA accumulator per `promote_every` k-tiles (the first k-block
                        # overwrites it), issued back to back as one batch...
                        warpgroup.fence()
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        for _j in cutlass.range_constexpr(self.promote_every):
                            ab_pipe.consumer_wait(read_state)
                            for kb in cutlass.range_constexpr(k_blocks):
                                coord = (None, None, kb, read_state.index)
                                cute.gemm(tiled_mma, acc_kt, tCrA[coord], tCrB[coord], acc_kt)
                                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                            read_state.advance()
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        for _j in cutlass.range_constexpr(self.promote_every):
                            ab_pipe.consumer_release(release_state)
                            release_state.advance()
                        # ...promoted into the fp32 accumulator with full-precision adds. Overlapping
                        # this with the next batch's WGMMAs (a second temporary) is not attempted:
                        # ptxas serialises WGMMAs while accumulator registers are read (C7514).
                        acc.store(acc.load() + acc_kt.load())

                # Scales (and residual) in fp32; the TMA store drops rows past M.
                scale_accumulators(acc, thr_mma.partition_C(cC[(None, None, tile[0], tile[1])]), mXs, mWs,
                                   mR, self.has_residual, self.acc_dtype)

                gC_t = cute.zipped_divide(gC[(None, None, tile[0], tile[1])], self.epi_tile)
                bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                       cute.group_modes(sC, 0, 2), gC_t)
                epi_n = cute.size(gC_t, mode=[1])
                epi_layout = cute.make_layout(gC_t.shape[1], stride=(gC_t.shape[1][1], 1))
                epi_base = sched.num_tiles_executed * epi_n
                for e in cutlass.range_constexpr(epi_n):
                    for v in cutlass.range_constexpr(per_epi):
                        tRS_rD[v] = tRS_acc[e * per_epi + v]
                    tRS_rOut.store(tRS_rD.load().to(self.out_dtype))
                    buf = (epi_base + e) % self.epi_stages
                    cute.copy(st_tiled, tRS_rOut, tRS_sC[(None, None, None, buf)])
                    # stmatrix writes through the generic proxy; the TMA store reads through the async one.
                    cute.arch.fence_proxy("async.shared", space="cta")
                    epi_bar.arrive_and_wait()
                    if warp_idx == 4:
                        cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
                        store_pipe.producer_commit()
                        store_pipe.producer_acquire()
                    epi_bar.arrive_and_wait()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()


_cache = CompileCache()


def compiled_kernel(tile_mn, n: int, k: int, has_residual: bool, fast_accum: bool, num_sms: int,
                    swizzle: int | None = None, promote_every: int | None = None):
    swizzle = swizzle or choose_swizzle(n // tile_mn[1])
    promote_every = 1 if fast_accum else promote_every or choose_promote_every(k)
    return _cache.get((tile_mn, n, k, has_residual, fast_accum, num_sms, swizzle, promote_every),
                      lambda: Fp8GemmSm90(tile_mn, n, k, has_residual, num_sms, fast_accum, swizzle,
                                          promote_every).compile(current_stream()))


def fp8_gemm_sm90(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                  residual: torch.Tensor | None = None, tile_mn: tuple[int, int] | None = None,
                  out: torch.Tensor | None = None, fast_accum: bool = False,
                  swizzle: int | None = None, promote_every: int | None = None) -> torch.Tensor:
    """bf16 [M, N] = (qx @ qw^T) * x_scale[:, None] * w_scale (+ residual). CUDA tensors, Hopper.

    tile_mn, swizzle and promote_every override the tile, tile-order and promotion-interval choices
    (tests cover every tile, the benchmark's sweeps every order and interval); out is written in
    place if given;
    fast_accum skips the promotion (faster, less accurate: see the module docstring).
    """
    m, k = qx.shape
    n = qw.shape[0]
    check_shapes(n, k)
    if qw.shape[1] != k or x_scale.shape != (m,) or w_scale.shape != (n,):
        raise ValueError(f"shape mismatch: qx {tuple(qx.shape)}, qw {tuple(qw.shape)}, "
                         f"x_scale {tuple(x_scale.shape)}, w_scale {tuple(w_scale.shape)}")
    if qx.dtype != torch.float8_e4m3fn or qw.dtype != torch.float8_e4m3fn:
        raise TypeError("qx and qw must be float8_e4m3fn")
    qx, qw = qx.contiguous(), qw.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    if out is None:
        out = torch.empty(m, n, device=qx.device, dtype=torch.bfloat16)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError("out must be a contiguous bf16 [M, N] tensor")
    if residual is not None:
        residual = residual.to(torch.bfloat16).contiguous()
        if residual.shape != (m, n):
            raise ValueError(f"residual must be [{m}, {n}], got {tuple(residual.shape)}")
    num_sms = sm_count(qx.device)    # the tile choice and the persistent grid plan for one count
    tile_mn = tile_mn or choose_tile(m, n, num_sms, fast_accum)
    fn = compiled_kernel(tuple(tile_mn), n, k, residual is not None, fast_accum, num_sms, swizzle, promote_every)
    fn(tensor_ptr(qx), tensor_ptr(qw), tensor_ptr(x_scale, 4), tensor_ptr(w_scale, 4),
       tensor_ptr(out), tensor_ptr(residual if residual is not None else out), m, tma_rows(qx, tile_mn[0]),
       current_stream())
    return out


# A torch custom op, so that torch.compile sees one opaque node instead of tracing CuTe DSL host code.
@torch.library.custom_op("microengine::fp8_gemm_sm90", mutates_args=(), device_types="cuda")
def fp8_gemm_sm90_op(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                     residual: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    return fp8_gemm_sm90(qx, x_scale, qw, w_scale, residual, fast_accum=fast_accum)


@fp8_gemm_sm90_op.register_fake
def _(qx, x_scale, qw, w_scale, residual=None, fast_accum=False):
    return qx.new_empty((qx.shape[0], qw.shape[0]), dtype=torch.bfloat16)
