"""Load generator for serve.py: closed-loop streaming clients at several concurrency levels.

    python serve.py --model llama &                       # on a GPU machine
    python benchmarks/loadgen.py                          # 1, 16, 64, 256 clients
    python benchmarks/loadgen.py --quick                  # CPU smoke run

Each client sends a streaming /v1/completions request (fixed output length: ignore_eos), waits for it to
finish and sends the next, until the level's request count or time budget is spent. Reported per level:
requests/s, output tokens/s, time to first token (TTFT), time per output token (TPOT) and the gaps
between streamed chunks at p50/p99, and tokens per chunk. Clients are spread over several processes so
that a Python client parsing SSE is not what gets measured; each level also reports the busiest client
process's CPU use (near 100% means the numbers are client-bound). Only servers on this machine
(127.0.0.1, localhost, ::1) are accepted: this is a benchmark, not a load test of someone else's service.

Tokens and chunks differ: the server sends an event only for a token that adds text, so a token whose
text is held back (part of a UTF-8 character, the start of a stop string) or empty (a special token, an
id the tokenizer lacks) arrives with the next event. Random weights sample such ids often: the Llama-3
shape presets' 128,256 ids go through the embedded tokenizer's 49,152. TPOT is therefore each request's
(latency - TTFT) / (completion tokens - 1), with the tokens its usage event counts; the chunk gaps are
those between events with text, as a reader of the stream sees them, and tokens per chunk says how far
the two differ. TTFT is to the first event with text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from urllib.parse import urlparse

import httpx

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point number group problem fact river stone light music garden window question answer story "
         "system city market table paper morning evening road letter friend energy").split()


@dataclass
class Record:
    ok: bool
    start: float
    ttft: float = 0.0
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)    # between the events with text
    chunks: int = 0                                     # events with text
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


@dataclass
class Job:
    url: str
    headers: dict
    model: str
    clients: int
    requests: int
    deadline: float             # time.monotonic(): no request starts after it (CLOCK_MONOTONIC is system-wide)
    max_tokens: int
    prompt_words: int
    temperature: float
    seed: int
    timeout: float


def make_prompt(rng: random.Random, index: int, words: int) -> str:
    # A distinct head per request, so the prefix cache cannot turn the benchmark into a cache test.
    return f"Request {index}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one_request(http: httpx.AsyncClient, job: Job, prompt: str) -> Record:
    body = {"model": job.model, "prompt": prompt, "max_tokens": job.max_tokens, "temperature": job.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    rec = Record(ok=False, start=start)
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    rec.ok = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    rec.error = event["error"].get("message", "error event")
                    return rec
                if event.get("usage"):
                    rec.completion_tokens = event["usage"]["completion_tokens"]
                    rec.prompt_tokens = event["usage"]["prompt_tokens"]
                if any(ch.get("text") for ch in event.get("choices", ())):
                    rec.chunks += 1
                    now = time.monotonic()
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.gaps.append(now - last)
                    last = now
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency = time.monotonic() - start
    return rec


async def run_clients(job: Job, first_index: int) -> list[Record]:
    rng = random.Random(job.seed + first_index)
    limits = httpx.Limits(max_connections=job.clients, max_keepalive_connections=job.clients)
    records: list[Record] = []
    issued = 0

    async def client():
        nonlocal issued
        while issued < job.requests and time.monotonic() < job.deadline:
            issued += 1
            records.append(await one_request(http, job, make_prompt(rng, first_index + issued, job.prompt_words)))

    async with httpx.AsyncClient(base_url=job.url, headers=job.headers, limits=limits,
                                 timeout=httpx.Timeout(job.timeout)) as http:
        await asyncio.gather(*(client() for _ in range(job.clients)))
    return records


def worker(job: Job, first_index: int) -> tuple[list[dict], float, float]:
    """One client process: its records, its CPU seconds and its wall seconds."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    cpu0, wall0 = time.process_time(), time.monotonic()
    records = runner(run_clients(job, first_index))
    return [asdict(r) for r in records], time.process_time() - cpu0, time.monotonic() - wall0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def tpot(rec: Record) -> float | None:
    """Time per output token after the first (None for a request of one token)."""
    if rec.completion_tokens < 2:
        return None
    return (rec.latency - rec.ttft) / (rec.completion_tokens - 1)


def run_level(pool, base: Job, clients: int, requests: int, duration: float, procs: int) -> dict:
    procs = max(1, min(procs, clients))
    deadline = time.monotonic() + duration
    futures = []
    for p in range(procs):
        share_clients = clients // procs + (p < clients % procs)
        share_requests = requests // procs + (p < requests % procs)
        job = Job(**{**asdict(base), "clients": share_clients, "requests": share_requests, "deadline": deadline})
        futures.append(pool.submit(worker, job, 1_000_000 * (clients + 1) + p * 100_000))
    t0 = time.monotonic()
    results = [f.result() for f in futures]
    wall = time.monotonic() - t0
    records = [Record(**r) for rs, _, _ in results for r in rs]
    good = [r for r in records if r.ok]
    span = (max(r.start + r.latency for r in records) - min(r.start for r in records)) if records else wall
    gaps = [g for r in good for g in r.gaps]
    tpots = [t for t in map(tpot, good) if t is not None]
    chunks = sum(r.chunks for r in good)
    return {
        "clients": clients, "requests": len(records), "errors": len(records) - len(good),
        "first_error": next((r.error for r in records if not r.ok), ""),
        "seconds": span, "requests_per_s": len(good) / span if span else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in good) / span if span else 0.0,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in good) / len(good) if good else 0.0,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in good], 0.5),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in good], 0.99),
        "tpot_p50_ms": 1e3 * percentile(tpots, 0.5), "tpot_p99_ms": 1e3 * percentile(tpots, 0.99),
        "chunk_gap_p50_ms": 1e3 * percentile(gaps, 0.5), "chunk_gap_p99_ms": 1e3 * percentile(gaps, 0.99),
        "tokens_per_chunk": sum(r.completion_tokens for r in good) / chunks if chunks else float("nan"),
        "client_cpu_max": max(cpu / w for _, cpu, w in results if w > 0),
    }


def check_local(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme != "http" or parsed.hostname not in LOCAL_HOSTS:
        sys.exit(f"loadgen: refusing {url!r}: only http:// servers on this machine "
                 f"({', '.join(sorted(LOCAL_HOSTS))}) are benchmarked")
    return url.rstrip("/")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server (local only)")
    ap.add_argument("--api-key", default=os.environ.get("MICROENGINE_API_KEY"))
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--concurrency", default="1,16,64,256", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level (default: 4 per client, at least 32, at most 1024)")
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds per level after which no new request starts")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument("--prompt-words", type=int, default=96, help="random words per prompt")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="client processes")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured requests first")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: 1 and 4 clients, 4 requests each, 8 tokens, short prompts")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.prompt_words = "1,4", 4, 8, 16
        args.warmup, args.procs = 1, 1
    url = check_local(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    health = httpx.get(url + "/health", timeout=10)
    health.raise_for_status()
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"]
    model = args.model or models[0]["id"]
    levels = [int(c) for c in args.concurrency.split(",")]
    base = Job(url=url, headers=headers, model=model, clients=1, requests=1, deadline=0.0,
               max_tokens=args.max_tokens, prompt_words=args.prompt_words, temperature=args.temperature,
               seed=args.seed, timeout=args.timeout)

    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"loadgen: {url} model={model} max_model_len={models[0].get('max_model_len')} "
          f"max_tokens={args.max_tokens} prompt_words={args.prompt_words} temperature={args.temperature} "
          f"procs={args.procs} ({started})", flush=True)
    results = []
    with ProcessPoolExecutor(max_workers=args.procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        if args.warmup:
            run_level(pool, base, min(args.warmup, 4), args.warmup, args.duration, 1)
        for clients in levels:
            requests = args.requests or min(1024, max(32, 4 * clients))
            res = run_level(pool, base, clients, requests, args.duration, args.procs)
            results.append(res)
            print(f"  {clients:4d} clients: {res['requests']} requests ({res['errors']} errors) in "
                  f"{res['seconds']:.1f}s, {res['output_tokens_per_s']:.0f} output tok/s"
                  + (f"  first error: {res['first_error']}" if res["errors"] else ""), flush=True)

    print()
    print("| clients | requests | errors | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
          "| TPOT p50 (ms) | TPOT p99 (ms) | chunk gap p50 (ms) | chunk gap p99 (ms) | tokens/chunk "
          "| client CPU (max proc) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['requests_per_s']:.2f} "
              f"| {r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
              f"| {r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} "
              f"| {r['chunk_gap_p50_ms']:.2f} | {r['chunk_gap_p99_ms']:.2f} | {r['tokens_per_chunk']:.2f} "
              f"| {100 * r['client_cpu_max']:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": url, "model": model, "date": started, "args": vars(args), "levels": results}, f,
                      indent=1)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
