"""Probe, committed and reverted at once so that the history keeps it for a GPU session: paged decode attention whose context splits are the CTAs of one thread-block
cluster and merge through distributed shared memory, instead of a second (merge) kernel.

bf16 cache [blocks, 16, n_kv, 128], q [B, nh, 128], block tables int32 [B, W], context lens int32 [B],
out [B, nh, 128] bf16. One cluster of S CTAs per (KV head, sequence); CTA s takes split s of the
context (page-aligned, as the Triton kernel splits it); its 4 warps take its pages round robin, lane l
holds dims 4l..4l+3 of q, k, v and the output; per page, all 16 rows are loaded, then scored
(butterfly shuffles), then one online-softmax update. The warps merge in shared memory, then the
CTAs of the cluster merge: CTA s reads every peer's partial through ld.shared::cluster for its share
of the G x 128 outputs and stores them.

State: compiles for sm_90a on the CPU (`CUTE_DSL_ARCH=sm_90a python benchmarks/cluster_attention_probe.py`;
the PTX has ld.global.v4.b16 for the cache rows, barrier.cluster, mapa and ld.shared::cluster); not
yet run on a GPU. On one: `python benchmarks/cluster_attention_probe.py` checks it against
attention.decode_attention_ref and times 2 / 4 / 8 splits against the engine's Triton kernel and its
merge (ROPE off on both) in CUDA graphs, batch x context 1 x 512 .. 16 x 512. The question it asks:
does a cluster merge cost less than the 2.2-us merge kernel (BENCHMARKS, "Where a decode step's GPU
time goes")?
"""
import math
import os
import sys
import time

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

D = 128
PAGE = 16
WARPS = 4


@cute.jit
def remote_f32(ptr: cute.Pointer, rank: cutlass.Constexpr) -> Float32:
    """An fp32 of cluster CTA `rank`'s shared memory, at the address ptr has in this CTA's."""
    addr = Int32(cute.arch.map_dsmem_ptr(ptr, Int32(rank)).toint())
    return cute.arch.inline_ptx("ld.shared::cluster.f32 {$w0}, [{$r0}];", write_only_types=[Float32],
                                read_only_args=[addr])


class ClusterDecodeAttention:
    def __init__(self, splits: int, group: int):
        self.S, self.G = splits, group

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 ctx_ptr: cute.Pointer, out_ptr: cute.Pointer, batch: Int32, n_kv: Int32, bt_stride: Int32,
                 cache_rows: Int32, scale_log2e: Float32, stream):
        nh = n_kv * self.G
        mQ = cute.make_tensor(q_ptr, cute.make_layout((batch * nh, 32, 4), stride=(D, 4, 1)))
        mO = cute.make_tensor(out_ptr, cute.make_layout((batch * nh, 32, 4), stride=(D, 4, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((cache_rows, 32, 4), stride=(D, 4, 1)))
        mV = cute.make_tensor(v_ptr, cute.make_layout((cache_rows, 32, 4), stride=(D, 4, 1)))
        mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, bt_stride), stride=(bt_stride, 1)))
        mCtx = cute.make_tensor(ctx_ptr, cute.make_layout(batch))

        @cute.struct
        class Shared:
            wm: cute.struct.MemRange[Float32, WARPS * 8]
            wl: cute.struct.MemRange[Float32, WARPS * 8]
            wacc: cute.struct.MemRange[Float32, WARPS * 8 * D]
            pm: cute.struct.MemRange[Float32, 8]
            pl: cute.struct.MemRange[Float32, 8]
            pacc: cute.struct.MemRange[Float32, 8 * D]
        self.shared = Shared
        self.kernel(mQ, mK, mV, mBT, mCtx, mO, n_kv, scale_log2e).launch(
            grid=[self.S, n_kv, batch], block=[32 * WARPS, 1, 1], cluster=(self.S, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBT: cute.Tensor, mCtx: cute.Tensor,
               mO: cute.Tensor, n_kv: Int32, scale_log2e: Float32):
        G, S = self.G, self.S
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        split, kv_head, seq = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.shared)
        sWm = storage.wm.get_tensor(cute.make_layout((WARPS, 8), stride=(8, 1)))
        sWl = storage.wl.get_tensor(cute.make_layout((WARPS, 8), stride=(8, 1)))
        sWacc = storage.wacc.get_tensor(cute.make_layout((WARPS, 8, D), stride=(8 * D, D, 1)))
        sPm = storage.pm.get_tensor(cute.make_layout(8))
        sPl = storage.pl.get_tensor(cute.make_layout(8))
        sPacc = storage.pacc.get_tensor(cute.make_layout((8, D), stride=(D, 1)))

        ctx = mCtx[seq]
        per = (ctx + S - 1) // S
        split_len = (per + PAGE - 1) // PAGE * PAGE
        start = split * split_len
        end = cutlass.min(ctx, start + split_len)
        first_page = start // PAGE
        last_page = (end + PAGE - 1) // PAGE

        q = cute.make_rmem_tensor((G, 4), Float32)
        for g in cutlass.range_constexpr(G):
            qv = mQ[(seq * n_kv + kv_head) * G + g, lane, None].load().to(Float32)
            for i in cutlass.range_constexpr(4):
                q[g, i] = qv[i] * scale_log2e
        m = cute.make_rmem_tensor(G, Float32)
        l = cute.make_rmem_tensor(G, Float32)
        acc = cute.make_rmem_tensor((G, 4), Float32)
        for g in cutlass.range_constexpr(G):
            m[g] = -Float32.inf
            l[g] = Float32(0.0)
            for i in cutlass.range_constexpr(4):
                acc[g, i] = Float32(0.0)

        kr = cute.make_rmem_tensor((PAGE, 4), Float32)
        vr = cute.make_rmem_tensor((PAGE, 4), Float32)
        s = cute.make_rmem_tensor((G, PAGE), Float32)
        for p in cutlass.range(first_page + warp, last_page, WARPS):
            page = Int64(mBT[seq, p])
            row0 = (page * PAGE) * n_kv + kv_head
            for r in cutlass.range_constexpr(PAGE):
                kv = mK[row0 + r * n_kv, lane, None].load().to(Float32)
                vv = mV[row0 + r * n_kv, lane, None].load().to(Float32)
                for i in cutlass.range_constexpr(4):
                    kr[r, i] = kv[i]
                    vr[r, i] = vv[i]
            for r in cutlass.range_constexpr(PAGE):
                for g in cutlass.range_constexpr(G):
                    part = q[g, 0] * kr[r, 0] + q[g, 1] * kr[r, 1] + q[g, 2] * kr[r, 2] + q[g, 3] * kr[r, 3]
                    for b in cutlass.range_constexpr(5):
                        part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << b)
                    s[g, r] = part if p * PAGE + r < end else -Float32.inf
            for g in cutlass.range_constexpr(G):
                mx = m[g]
                for r in cutlass.range_constexpr(PAGE):
                    mx = cute.arch.fmax(mx, s[g, r])
                alpha = cute.arch.exp2(m[g] - mx)     # the page's first key is valid: mx is finite
                l[g] = l[g] * alpha
                for i in cutlass.range_constexpr(4):
                    acc[g, i] = acc[g, i] * alpha
                for r in cutlass.range_constexpr(PAGE):
                    pr = cute.arch.exp2(s[g, r] - mx)
                    l[g] = l[g] + pr
                    for i in cutlass.range_constexpr(4):
                        acc[g, i] = acc[g, i] + pr * vr[r, i]
                m[g] = mx

        # the warps' partials -> this CTA's, in shared memory
        for g in cutlass.range_constexpr(G):
            if lane == 0:
                sWm[warp, g] = m[g]
                sWl[warp, g] = l[g]
            for i in cutlass.range_constexpr(4):
                sWacc[warp, g, lane * 4 + i] = acc[g, i]
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(G * D // (32 * WARPS)):
            o = tidx + j * 32 * WARPS
            g, d = o // D, o % D
            mx = -Float32.inf
            for w in cutlass.range_constexpr(WARPS):
                mx = cute.arch.fmax(mx, sWm[w, g])
            tot_l = Float32(0.0)
            tot_a = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                wt = cute.arch.exp2(sWm[w, g] - mx) if sWl[w, g] > Float32(0.0) else Float32(0.0)
                tot_l = tot_l + wt * sWl[w, g]
                tot_a = tot_a + wt * sWacc[w, g, d]
            sPacc[g, d] = tot_a
            if d == 0:
                sPm[g] = mx
                sPl[g] = tot_l
        # every CTA's partial in its shared memory, visible to the cluster
        cute.arch.cluster_arrive(aligned=True)
        cute.arch.cluster_wait()
        SHARE = G * D // S
        for j in cutlass.range_constexpr((SHARE + 32 * WARPS - 1) // (32 * WARPS)):
            if tidx + j * 32 * WARPS < SHARE:
                o = split * SHARE + tidx + j * 32 * WARPS
                g, d = o // D, o % D
                mx = -Float32.inf
                for r in cutlass.range_constexpr(S):
                    mx = cute.arch.fmax(mx, remote_f32(sPm.iterator + g, r))
                tot_l = Float32(0.0)
                tot_a = Float32(0.0)
                for r in cutlass.range_constexpr(S):
                    lr = remote_f32(sPl.iterator + g, r)
                    wt = cute.arch.exp2(remote_f32(sPm.iterator + g, r) - mx) if lr > Float32(0.0) else Float32(0.0)
                    tot_l = tot_l + wt * lr
                    tot_a = tot_a + wt * remote_f32(sPacc.iterator + (g * D + d), r)
                res = tot_a / tot_l
                mO[(seq * n_kv + kv_head) * G + g, d // 4, d % 4] = res.to(cutlass.BFloat16)
        # peers may still read this CTA's shared memory
        cute.arch.cluster_arrive(aligned=True)
        cute.arch.cluster_wait()


_compiled = {}


def gptr(dtype, t=None, align=16):
    return make_ptr(dtype, t.data_ptr() if t is not None else 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_kernel(splits, group, stream=None):
    from cutlass.cute.runtime import make_fake_stream
    import cuda.bindings.driver as cuda
    key = (splits, group)
    if key not in _compiled:
        k = ClusterDecodeAttention(splits, group)
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        _compiled[key] = cute.compile(
            k, gptr(bf16), gptr(bf16), gptr(bf16), gptr(i32, align=4), gptr(i32, align=4), gptr(bf16),
            Int32(1), Int32(8), Int32(1), Int32(1), Float32(1.0), stream or make_fake_stream())
    return _compiled[key]


def cluster_attention(q, k_cache, v_cache, block_tables, context_lens, scale, splits, out):
    import cuda.bindings.driver as cuda
    b, nh, _ = q.shape
    n_kv = k_cache.shape[2]
    fn = compile_kernel(splits, nh // n_kv)
    fn(gptr(cutlass.BFloat16, q), gptr(cutlass.BFloat16, k_cache), gptr(cutlass.BFloat16, v_cache),
       gptr(cutlass.Int32, block_tables, 4), gptr(cutlass.Int32, context_lens, 4), gptr(cutlass.BFloat16, out),
       Int32(b), Int32(n_kv), Int32(block_tables.stride(0)), Int32(k_cache.shape[0] * PAGE * n_kv),
       Float32(scale * 1.4426950408889634), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    return out


def main():
    if not torch.cuda.is_available():
        for s in (1, 2, 8):
            compile_kernel(s, 4)
            print("compiled", s)
        return
    sys.path.insert(0, ".")
    from engine.kernels import attention
    from benchmarks.timing import time_graph
    torch.manual_seed(0)
    nkv, g = 8, 4
    nh = nkv * g
    scale = 1 / math.sqrt(D)
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print("| batch x context | splits | cluster µs | err | Triton kernel + merge µs (its splits) | err |")
    for b, ctx in ((1, 512), (1, 1024), (1, 4096), (4, 512), (16, 512)):
        blocks_per = ctx // PAGE + 1
        n_blocks = b * blocks_per + 8
        sets = []
        for _ in range(8):   # rotating operand sets: about 8 x (b x 2 MB) per replay
            kc = torch.randn(n_blocks, PAGE, nkv, D, device="cuda").bfloat16()
            vc = torch.randn(n_blocks, PAGE, nkv, D, device="cuda").bfloat16()
            perm = torch.randperm(n_blocks - 8, device="cuda")[: b * blocks_per].int().view(b, blocks_per)
            q = torch.randn(b, nh, D, device="cuda").bfloat16()
            lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            sets.append((q, kc, vc, perm, lens))
        q, kc, vc, bt, lens = sets[0]
        ref = attention.decode_attention_ref(q.float(), kc.float(), vc.float(), bt, lens, scale).double()
        row = []
        for splits in (2, 4, 8):
            out = torch.full_like(q, float("nan"))
            cluster_attention(q, kc, vc, bt, lens, scale, splits, out)
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            t = time_graph(lambda i: cluster_attention(*sets[i][:4], sets[i][4], scale, splits, out), range(8))
            row.append(f"{splits}: {t * 1e6:.2f} ({err:.1e})")
        out2 = torch.full_like(q, float("nan"))
        attention.decode_attention(q, kc, vc, bt, lens, scale, out=out2)
        err2 = ((out2.double() - ref).norm() / ref.norm()).item()
        t2 = time_graph(lambda i: attention.decode_attention(*sets[i][:3], sets[i][3], sets[i][4], scale, out=out2),
                        range(8))
        splits_t = attention.decode_splits(b, nkv, q.device)
        print(f"| {b} x {ctx} | " + " / ".join(row) + f" | Triton {t2 * 1e6:.2f} ({splits_t} splits, {err2:.1e}) |",
              flush=True)


if __name__ == "__main__":
    main()
