#!/usr/bin/env bash
# Run 21 (nvidia-h200-x2, one call): issue 9 part 5 — the whole 8b table (every decode path at B=1 and 8, the
# prefill pairs) in one command, its units spread over the two GPUs (one worker each, 16 pinned cores each).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
nvidia-smi -L; nproc
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
date -u; S=$(date +%s)
timeout 590 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --gpus 2 --budget-s 470 --deadline-s 570 \
  2>&1 | grep -v "INFO:torch\|\] W1\|\] I1\|^W1\|^I1" > $OUT/gen8b.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|chose" $OUT/gen8b.log | cut -c1-300
cat $OUT/8b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
