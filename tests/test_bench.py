"""bench.py --quick runs the whole harness on the CPU: every configuration, the HF baseline, the
quality column and the output files."""
import argparse
import json
import os

import pytest


def test_bench_quick_runs_every_configuration(tmp_path, monkeypatch, capsys):
    """In this process, so that the quality column's engines share the session's read of the
    embedded model (tests/conftest.py). The quality column runs for dense and one lossy format:
    its loop is the same for each, and tests/test_formats.py measures every format's perplexity."""
    import bench
    from engine.memory import allocator
    out = tmp_path / "bench"
    monkeypatch.setattr(bench, "QUALITY", {k: bench.QUALITY[k] for k in ("dense", "fp8")})
    monkeypatch.setenv(allocator.ENV, os.environ.get(allocator.ENV, ""))   # bench.main sets them:
    monkeypatch.setattr(allocator, "_release", allocator._release)        # restored afterwards
    bench.main(["--quick", "--out", str(out)])
    assert "wrote" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in results["configs"]}
    CONFIGS = bench.CONFIGS
    assert set(rows) == set(CONFIGS) | {"HF transformers"}
    assert CONFIGS["overlap-off"] == ({"overlap": False}, True)
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["prefill_tok_s"] > 0 and row["decode_b1_tok_s"] > 0
    assert rows["dense"]["agreement"] == 1.0
    quality = results["quality"]
    assert set(quality) == {"dense", "fp8", "dense, fp8 head", "fp8, fp8 head", *bench.QUALITY_KV,  # --quick: fp8 head
                            *bench.QUALITY_EMULATED}
    assert all(v["perplexity"] > 1 and 0 < v["top1_agreement"] <= 1 for v in quality.values()), quality
    assert quality["dense"]["top1_agreement"] == 1.0
    from engine.formats import nvfp4    # the emulated row's kernel list is given back
    assert [k.name for k in nvfp4.NVFP4_GEMM["other"]] == ["triton_decode", "dequantize_cublas", "reference"]
    assert all(0 < quality[k]["top1_vs_bf16_head"] <= 1 for k in ("dense, fp8 head", "fp8, fp8 head"))
    assert (out / "results.md").read_text().count("|") > 20
    assert (out / "tokens_per_sec.png").stat().st_size > 1000
    assert (out / "roofline.png").stat().st_size > 1000
    assert {p["config"] for p in results["gemm_points"]} == set(CONFIGS) - {"fused-off", "overlap-off", "kv-fp8"}
    # HF ran the engine's throughput requests, statically batched, and says how it counted
    hf = rows["HF transformers"]
    assert hf["throughput_tok_s"] > 0 and hf["throughput_requests"] == results["args"]["requests"]
    assert hf["throughput_useful_tokens"] <= hf["throughput_generated_tokens"]
    assert "useful of" in (out / "results.md").read_text()


def test_bench_keeps_what_it_measured_when_cut_short(tmp_path, monkeypatch):
    """A run stopped part way (a crash, a time limit) leaves its finished configurations in
    results.json."""
    import bench
    from engine.memory import allocator
    real = bench.bench_config

    def stopped_after_dense(name, *a, **k):
        if name != "dense":
            raise KeyboardInterrupt        # not an error bench.py records: the run ends here
        return real(name, *a, **k)

    monkeypatch.setattr(bench, "bench_config", stopped_after_dense)
    monkeypatch.setenv(allocator.ENV, os.environ.get(allocator.ENV, ""))
    monkeypatch.setattr(allocator, "_release", allocator._release)
    out = tmp_path / "bench"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--quick", "--no-hf", "--no-quality", "--configs", "dense,fp8", "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["configs"]
    assert [r["config"] for r in rows] == ["dense"] and rows[0]["decode_b1_tok_s"] > 0


def test_bench_engine_wide_options(monkeypatch, capsys):
    import torch

    import bench
    from engine.memory import allocator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # no restart on a GPU box
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator, "_release", "dedicated")
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--gpu-memory-limit", type=float)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--tune", default="on")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--lm-head", default=None)
    allocator.add_arguments(ap)
    args = ap.parse_args(["--allocator", "cudaMallocAsync", "--offload", "--gpu-memory-limit", "12"])
    assert bench.engine_overrides(args, ap) == {"offload": True, "gpu_memory_limit": 12.0}   # graphs stay on
    assert bench.engine_overrides(ap.parse_args(["--no-cuda-graphs"]), ap) == {"cuda_graphs": False}
    assert bench.engine_overrides(ap.parse_args([]), ap) == {}
    assert bench.engine_overrides(ap.parse_args(["--tune", "off"]), ap) == {"tune": "off"}
    assert bench.engine_overrides(ap.parse_args(["--tensor-parallel-size", "2"]), ap) == {"tensor_parallel_size": 2}
    assert bench.engine_overrides(ap.parse_args(["--lm-head", "nvfp4"]), ap) == {"lm_head": "nvfp4"}
    with pytest.raises(SystemExit) as e:      # checked before anything is loaded or measured
        bench.main(["--memory-release", "shared", "--out", "unused"])
    assert e.value.code == 2 and "needs the cudaMallocAsync backend" in capsys.readouterr().err


def test_throughput_requests_are_the_same_draws_for_engine_and_hf():
    import bench
    args = argparse.Namespace(requests=256, min_len=100, max_len=1024)
    a, b = bench.throughput_requests(args, 49152), bench.throughput_requests(args, 49152)
    assert a == b and len(a) == 256
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 for p, n in a)


def test_prefill_host_time_is_the_median_step_of_the_timed_passes():
    """bench_prefill's host figure: the median over the timed passes' steps that queued work; the
    warm-up pass and the last call of each pass (which only hands out tokens) do not count."""
    import random

    import torch

    import bench

    class Engine:
        device = torch.device("cpu")

        def __init__(self):
            self.stats = {"host_s": 0.0}
            self.pending, self.step_hosts = 0, iter([9.0, 9.0, 0.5,      # warm-up: 2 steps, finishing
                                                     0.010, 0.030, 0.5,  # timed passes
                                                     0.012, 0.020, 0.5,
                                                     0.011, 0.040, 0.5])

        def add_request(self, rid, ids, params, sink):
            self.pending += 1

        def has_work(self):
            return self.pending > 0 or self.finishing

        def step(self):
            self.stats["host_s"] += next(self.step_hosts)
            if self.pending:            # two requests a step
                self.pending -= 2
                self.finishing = True
                return 2
            self.finishing = False
            return 0

    engine = Engine()
    engine.finishing = False
    _, host = bench.bench_prefill(engine, random.Random(0), 1000, num=4, length=3)
    assert host == pytest.approx(0.016)     # the median of 0.010, 0.030, 0.012, 0.020, 0.011, 0.040
    assert next(engine.step_hosts, None) is None


def test_compiled_peer_runs_on_the_cpu(capsys):
    """benchmarks/compiled_peer.py (the torch.compile reference peer) end to end on tiny shapes,
    eager: the GPU run compiles the same model."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "compiled_peer.py"
    spec = importlib.util.spec_from_file_location("compiled_peer", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    results = peer.main(["--preset", "llama-tiny", "--steps", "3", "--device", "cpu", "--no-compile",
                         "--batches", "1,4", "--warmup", "1"])
    assert set(results) == {1, 4} and all(tok_s > 0 and ms > 0 for tok_s, ms in results.values())
    out = capsys.readouterr().out
    assert "llama-tiny" in out and "tok/s" in out and "ms/step" in out


def test_loadgen_counts_tokens_not_events(monkeypatch):
    """benchmarks/loadgen.py on a canned stream, on a clock the stream moves: 5 tokens in 3 events
    with text (tokens 2 and 3 add none, so the server sends no event for them). TTFT and the gaps are
    per event; the time per output token is per token, from the usage event's count."""
    import asyncio
    import importlib.util
    import json
    import pathlib
    import sys
    import types

    import httpx
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "loadgen.py"
    spec = importlib.util.spec_from_file_location("loadgen", path)
    loadgen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "loadgen", loadgen)
    spec.loader.exec_module(loadgen)
    now = [0.0]
    monkeypatch.setattr(loadgen, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def event(at, text, finish=None, usage=None):
        payload = {"choices": [{"text": text, "finish_reason": finish}], "usage": usage}
        return at, f"data: {json.dumps(payload)}\n\n"

    events = [event(0.10, "a"), event(0.13, "b"), event(0.14, "c"), event(0.14, "", "length"),
              event(0.14, "", usage={"prompt_tokens": 7, "completion_tokens": 5}), (0.14, "data: [DONE]\n\n")]

    async def body():
        for at, text in events:
            now[0] = at
            yield text.encode()

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            job = loadgen.Job(url="", headers={}, model="m", clients=1, requests=1, deadline=0.0, max_tokens=5,
                              prompt_words=4, temperature=0.0, seed=0, timeout=10.0)
            return await loadgen.one_request(http, job, "prompt")

    rec = asyncio.run(run())
    assert rec.ok and (rec.chunks, rec.completion_tokens) == (3, 5)
    assert rec.ttft == pytest.approx(0.10) and rec.gaps == pytest.approx([0.03, 0.01])
    assert loadgen.tpot(rec) == pytest.approx(0.01)     # (0.14 - 0.10) / (5 - 1)
