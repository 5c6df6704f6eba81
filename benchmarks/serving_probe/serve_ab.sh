#!/bin/bash
# serve.py + loadgen at TP 1 and 2, the per-token hand-off (HEAD's llm.py) against the mailbox.
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cp engine/llm.py benchmarks/serving_probe/llm_new.py
git show 3cf5859:engine/llm.py > benchmarks/serving_probe/llm_old.py
run() {  # $1 label, $2 tp
  python serve.py --model ${MODEL:-llama-3.1-8b} --max-model-len 4096 --tensor-parallel-size $2 --port 8011 > $OUT/serve_$1.log 2>&1 & SP=$!
  for i in $(seq 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  python benchmarks/loadgen.py --url http://127.0.0.1:8011 --concurrency ${LEVELS:-64,256} --duration ${DUR:-20} --max-tokens 128 > $OUT/load_$1.log 2>&1
  kill $SP; wait $SP
  echo "== $1"; grep "^| [0-9]" $OUT/load_$1.log
}
for v in ${ORDER:-old new}; do
  cp benchmarks/serving_probe/llm_$v.py engine/llm.py
  for tp in ${TPS:-1 2}; do run ${v}_tp$tp $tp; done
done
cp benchmarks/serving_probe/llm_new.py engine/llm.py
