#!/usr/bin/env bash
# Run 69 (one H200; sixteenth session, call 1; carry [".wq/a"]). The GPU tests of the changes made after run 68 (the
# plain_tensors check, patch's sample dtype for int8 weights, _one_gemm_act_mul shared by the two cuBLAS paths), and
# the first half of quack's wheels staged in /tmp for call 2 (run 70), which must follow at once on the warm machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh stage > $OUT/stage.log 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "stored_as_one or patched_module or \
planned_calls" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
date -u; echo "took $(( $(date +%s) - S )) s"
cat $OUT/stage.log
tail -8 $OUT/tests.log | cut -c1-250
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
