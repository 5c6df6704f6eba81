"""Probe (kept for the record, then reverted): loadgen's 256-client load through the library (no HTTP), with rank 0's step sections
timed, under variants of the hand-off from the engine thread to the event loop.
    python benchmarks/serving_probe/serve_sections.py TP CLIENTS SECONDS VARIANTS [MODEL]
VARIANTS: comma-separated of pertoken|mailbox, each optionally '@' a GIL switch interval in ms."""
import asyncio
import collections
import random
import sys
import time

sys.path.insert(0, ".")
import engine.engine as E  # noqa: E402
import engine.llm as L  # noqa: E402
from engine import LLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

ACC = collections.defaultdict(float)
CNT = collections.Counter()
NEW_PUT = L.RequestStream._put


def old_put(self, item):
    with self._lock:
        if self.done:
            return
        self.done = isinstance(item, L._Failure) or item.finish_reason is not None
        if self._aqueue is not None:
            self._mailbox.loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
        else:
            self._buffer.append(item)
            self._ready.notify()


def wrap(obj, name, label):
    fn = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[label] += time.perf_counter() - t
            CNT[label] += 1
    setattr(obj, name, timed)


async def client(llm, rng, deadline, out_tokens, counts):
    while time.monotonic() < deadline:
        ids = [rng.randrange(100, 30000) for _ in range(107)]
        s = llm.stream(ids, SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True, detokenize=False))
        async for chunk in s:
            counts[0] += len(chunk.token_ids)


async def load(llm, clients, seconds, out_tokens):
    rng, counts = random.Random(0), [0]
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client(llm, rng, deadline, out_tokens, counts) for _ in range(clients)))
    return counts[0]


def main():
    tp, levels, seconds = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(',')], float(sys.argv[3])
    variants = sys.argv[4].split(",")
    llm = LLM(sys.argv[5] if len(sys.argv) > 5 else "llama-3.1-8b", tensor_parallel_size=tp, max_model_len=4096)
    eng = llm.engine
    try:
        asyncio.run(load(llm, max(levels), 5.0, 128))       # warm-up
        wrap(E, "plan_batch", "plan_batch")
        for o, names in [(eng.scheduler, ["schedule"]), (eng, ["_forward", "_finish", "_emit", "step"]),
                         (eng.sampler, ["sample"])]:
            for n in names:
                wrap(o, n, f"{type(o).__name__}.{n}")
        for o in (eng.step_graphs, eng.graphs):
            if o is not None:
                wrap(o, "run", f"{type(o).__name__}.run")
        if eng.tp is not None:
            wrap(eng.tp, "send", "tp.send")
        for clients, v in [(c, v) for c in levels for v in variants]:
            kind, _, ms = v.partition("@")
            L.RequestStream._put = old_put if kind == "pertoken" else NEW_PUT
            sys.setswitchinterval(float(ms) / 1e3 if ms else 0.005)
            ACC.clear()
            CNT.clear()
            s0, h0 = eng.stats["steps"], eng.stats["host_s"]
            t0 = time.perf_counter()
            tokens = asyncio.run(load(llm, clients, seconds, 128))
            wall = time.perf_counter() - t0
            steps = eng.stats["steps"] - s0
            print(f"## TP{tp} {v}, {clients} clients, {seconds:.0f} s: {tokens / wall:.0f} output tok/s, {steps} steps "
                  f"({wall / steps * 1e3:.2f} ms a step), host (stats) {(eng.stats['host_s'] - h0) / steps * 1e3:.2f} "
                  f"ms a step; "
                  f"mixed steps {CNT['StepGraphs.run']}, decode graphs {CNT['DecodeGraphs.run']}")
            for k, val in sorted(ACC.items(), key=lambda kv: -kv[1]):
                print(f"   {k:24s} {val / steps * 1e3:8.3f} ms a step ({CNT[k]} calls)", flush=True)
    finally:
        for o in (eng.scheduler, eng, eng.sampler, eng.step_graphs, eng.graphs, eng.tp):
            for n in list(vars(o)) if o is not None else []:
                if getattr(getattr(o, n), "__name__", "") == "timed":
                    delattr(o, n)       # the wrappers hold the CUDA graphs, which must go before the group
        llm.shutdown()


if __name__ == "__main__":
    main()
