"""Probe: the all-reduce a two-GPU decode step runs 65 times, [M, 4096] bf16, as NCCL
does it and as torch's symmetric memory does it, each captured in one CUDA graph of 65 calls and
replayed; µs each, and the result checked against the sum of both ranks' inputs.

  for v in nccl nccl-ll one-shot one-shot-copy two-shot; do timeout 90 python tp_allreduce.py $v; done

nccl: dist.all_reduce after a copy, as the engine runs it (each all-reduce follows the kernel that
  writes its input).
nccl-ll: the same with NCCL_PROTO=LL (NCCL's low-latency protocol forced).
one-shot: torch.ops.symm_mem.one_shot_all_reduce_out on a symmetric buffer (each rank reads the
  other's buffer over NVLink and sums; the input is copied into the buffer first, as a layer's
  output would be).
one-shot-copy: torch.ops.symm_mem.one_shot_all_reduce_copy_out: the copy into one shared workspace
  and the reduction in one kernel (it ends with a barrier, so the next call may reuse the buffer).
two-shot: torch.ops.symm_mem.two_shot_all_reduce_ (reduce-scatter then all-gather, in place).
Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the machine needs it,
and one-shot / two-shot use peer loads, not multicast."""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H = 4096
CALLS = 65


def timed(fn, reps=21):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[reps // 2]


def main(rank, variant):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29617", NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if variant == "nccl-ll":
        os.environ["NCCL_PROTO"] = "LL"
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    for m in (1, 16, 64):
        torch.manual_seed(rank * 100 + m)
        xs = [torch.randn(m, H, device=dev, dtype=torch.bfloat16) for _ in range(CALLS)]
        # the reference: both ranks' inputs, summed in fp32
        got = [torch.empty(2 * m, H, device=dev, dtype=torch.bfloat16) for _ in range(CALLS)]
        for x, g in zip(xs, got):
            dist.all_gather_into_tensor(g, x)
        want = [g.view(2, m, H).float().sum(0) for g in got]
        outs = [torch.empty_like(x) for x in xs]
        if variant in ("nccl", "nccl-ll"):
            def step():
                for x, o in zip(xs, outs):
                    o.copy_(x)
                    dist.all_reduce(o)
            s = torch.cuda.Stream()       # NCCL's first call outside capture (communicator set-up)
            with torch.cuda.stream(s):
                step()
            torch.cuda.synchronize()
        else:
            import torch.distributed._symmetric_memory as symm_mem
            try:    # older releases want the group registered first; newer ones deprecate the call
                symm_mem.enable_symm_mem_for_group(group.group_name)
            except Exception:  # noqa: BLE001
                pass
            bufs = [symm_mem.empty(m * H, device=dev, dtype=torch.bfloat16) for _ in range(CALLS)]
            for b in bufs:
                symm_mem.rendezvous(b, group.group_name)
            work = symm_mem.empty(64 * H, device=dev, dtype=torch.bfloat16)
            symm_mem.rendezvous(work, group.group_name)
            if variant == "one-shot-copy":     # one kernel: copy in, barrier, sum the peers, barrier; one workspace
                def step():
                    for x, o in zip(xs, outs):
                        torch.ops.symm_mem.one_shot_all_reduce_copy_out(work[:m * H].view(m, H), x, "sum",
                                                                        group.group_name, o)
            elif variant == "one-shot":
                def step():
                    for x, b, o in zip(xs, bufs, outs):
                        b.copy_(x.view(-1))
                        torch.ops.symm_mem.one_shot_all_reduce_out(b, "sum", group.group_name, o.view(-1))
            else:
                def step():
                    for x, b, o in zip(xs, bufs, outs):
                        b.copy_(x.view(-1))
                        torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", group.group_name)
                        o.copy_(b.view(m, H))
            step()
            torch.cuda.synchronize()
        for o in outs:
            o.fill_(float("nan"))
        t = timed(step)
        err = max(((o.float() - w).norm() / w.norm()).item() for o, w in zip(outs, want))
        copies = [torch.empty_like(x) for x in xs]
        t_copy = timed(lambda: [c.copy_(x) for c, x in zip(copies, xs)])
        if rank == 0:
            print(f"{variant:9s} M={m:2d}: {CALLS} calls in a graph {t:7.1f} µs ({t / CALLS:5.2f} each; "
                  f"{CALLS} plain copies {t_copy:5.1f} µs); worst rel err {err:.1e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
