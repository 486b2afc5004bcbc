#!/usr/bin/env bash
# Run 51 (one H200; thirteenth session): the two GPU tests refactored after runs 48-49 into one helper (the op's first
# calls inside Inductor's CUDA-graph trees, M = 1 / 8 / 100 and, dispatch and cublas_two_streams forced, 32 / 128 / 256).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout -s INT 240 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py -k "graph_trees or batched_sizes" \
  > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
grep -E "PASSED|FAILED|ERROR|passed|failed|ended|Interrupt" $OUT/tests.log | sed 's/tests\/test_//' | cut -c1-140
grep -E "^E " $OUT/tests.log | head -10 | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
