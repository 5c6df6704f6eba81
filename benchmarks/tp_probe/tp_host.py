"""Probe: where rank 0's host time per step goes, one GPU against two. Wraps the step's sections
(wall time each, summed over the steps of a phase) and prints them per step.
    python benchmarks/tp_probe/tp_host.py TP [MODEL]"""
import collections
import sys
import time

import torch

sys.path.insert(0, ".")
import engine.engine as E  # noqa: E402
from bench import run_to_completion  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

ACC = collections.defaultdict(float)
CNT = collections.Counter()


def wrap(obj, name, label=None):
    fn = getattr(obj, name)
    label = label or name

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[label] += time.perf_counter() - t
            CNT[label] += 1
    setattr(obj, name, timed)


def main():
    tp = int(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"
    eng = E.Engine(EngineConfig(model=model, kv_cache_tokens=65536, max_model_len=8192,
                                max_num_batched_tokens=8192, tensor_parallel_size=tp))
    try:
        wrap(E, "plan_batch")
        for o, names in [(eng.scheduler, ["schedule", "advance"]), (eng.ring, ["acquire", "upload", "release"]),
                         (eng, ["_forward", "_finish"]), (eng.sampler, ["sample"]), (eng.readback, ["send"])]:
            for n in names:
                wrap(o, n, f"{type(o).__name__}.{n}")
        for o, n in [(eng.step_graphs, "run"), (eng.graphs, "run"), (eng.model, "compute_logits")]:
            if o is not None:
                wrap(o, n, f"{type(o).__name__}.{n}")
        if eng.step_graphs is not None:
            for t, fns in eng.step_graphs.pieces.items():
                for i in range(len(fns)):
                    holder = type("H", (), {})()
                    holder.f = fns[i]
                    wrap(holder, "f", "  piece replay")
                    fns[i] = holder.f
            for layer in eng.model.layers:
                wrap(layer.self_attn, "attend", "  attend (eager)")
        if eng.tp is not None:
            wrap(eng.tp, "send", "tp.send")
            wrap(eng.tp, "broadcast", "tp.broadcast(nccl)")
        g = torch.Generator().manual_seed(0)

        def reqs(tag, n, length, out):
            return [(f"{tag}{i}", torch.randint(100, 30000, (length,), generator=g).tolist(),
                     SamplingParams(max_tokens=out, temperature=0, ignore_eos=True, detokenize=False)) for i in range(n)]
        for phase, todo in [("prefill 4x2048 (1 token out)", lambda t: reqs(t, 4, 2048, 1)),
                            ("mixed: 256 x 107-token prompts, 32 out", lambda t: reqs(t, 256, 107, 32))]:
            run_to_completion(eng, todo("w"))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ACC.clear(); CNT.clear()
            s0, h0 = eng.stats["steps"], eng.stats["host_s"]
            t0 = time.perf_counter()
            run_to_completion(eng, todo("t"))
            wall = time.perf_counter() - t0
            steps = eng.stats["steps"] - s0
            print(f"## TP{tp} {phase}: {steps} steps, wall {wall / steps * 1e3:.2f} ms/step, "
                  f"host (stats) {(eng.stats['host_s'] - h0) / steps * 1e3:.2f} ms/step", flush=True)
            for k, v in sorted(ACC.items(), key=lambda kv: -kv[1]):
                print(f"   {k:28s} {v / steps * 1e3:8.3f} ms/step  ({CNT[k]} calls)", flush=True)
    finally:
        eng.close()


if __name__ == "__main__":
    main()
