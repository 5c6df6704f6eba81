"""Probe: what a tensor-parallel decode step pays for its collectives on two GPUs.
(a) 65 NCCL all-reduces of [M, 4096] bf16 (a decode step's o_proj, down_proj and embedding), captured
in one CUDA graph and replayed, µs each; (b) the step message: gloo broadcast_object_list of a
batch-1-sized step message, µs from rank 0's call to its return, median of 300."""
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613", NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2, device_id=dev if cuda else None)
    host = dist.new_group(backend="gloo")
    if cuda:
        for m in (1, 16, 64):
            xs = [torch.randn(m, 4096, device=dev, dtype=torch.bfloat16) for _ in range(65)]
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for x in xs:
                    dist.all_reduce(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for x in xs:
                    dist.all_reduce(x)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            dist.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(21):
                e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3)
            ts.sort()
            # one rank alone in a graph of 65 local copies of the same size: the floor of a kernel a layer
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2):
                for x in xs:
                    x.mul_(1.0)
            g2.replay(); torch.cuda.synchronize()
            t2 = []
            for _ in range(21):
                e0.record(); g2.replay(); e1.record(); torch.cuda.synchronize()
                t2.append(e0.elapsed_time(e1) * 1e3)
            t2.sort()
            if rank == 0:
                print(f"M={m:2d}: 65 all-reduces in a graph {ts[10]:7.1f} us ({ts[10] / 65:5.2f} each); "
                      f"65 elementwise kernels {t2[10]:6.1f} us ({t2[10] / 65:4.2f} each)", flush=True)
    msg = ("step", (1, 1, 0, 1), {"input_ids": (0, 8, "int64"), "positions": (8, 16, "int64"),
                                  "slots": (16, 24, "int64")}, bytes(512))
    for n in range(2):
        ts = []
        for _ in range(300):
            box = [msg] if rank == 0 else [None]
            t = time.perf_counter()
            dist.broadcast_object_list(box, src=0, group=host)
            ts.append(time.perf_counter() - t)
        ts.sort()
        if rank == 0 and n:
            print(f"gloo broadcast_object_list of a step message, rank 0: median {ts[150] * 1e6:.0f} us, "
                  f"p90 {ts[270] * 1e6:.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, nprocs=2)
