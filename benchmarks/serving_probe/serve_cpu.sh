#!/bin/bash
# serve.py under loadgen, each thread's CPU seconds over the load. MODEL, TP, LEVELS, REQ.
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python serve.py --model ${MODEL:-llama-3.1-8b} --max-model-len 4096 --tensor-parallel-size ${TP:-1} --port 8012 > $OUT/serve_cpu_$TP.log 2>&1 & SP=$!
for i in $(seq 240); do curl -sf http://127.0.0.1:8012/health >/dev/null && break; sleep 1; done
for c in ${LEVELS:-256}; do
  python benchmarks/loadgen.py --url http://127.0.0.1:8012 --concurrency $c --requests ${REQ:-1024} --max-tokens 128 --warmup 8 > $OUT/load_cpu_${TP}_$c.log 2>&1 &
  LP=$!; sleep ${SETTLE:-5}; python benchmarks/serving_probe/thread_cpu.py $SP /tmp/snap.json; T0=$(date +%s.%N); sleep ${WIN:-10}
  python benchmarks/serving_probe/thread_cpu.py $SP /tmp/snap.json --diff > /tmp/diff.txt; T1=$(date +%s.%N); wait $LP
  echo "== TP$TP $c clients, window $(python -c "print(round($T1-$T0,2))") s"; grep "^| [0-9]" $OUT/load_cpu_${TP}_$c.log; cat /tmp/diff.txt
done
kill $SP; wait $SP
