#!/usr/bin/env bash
# Run 87 (one H200; eighteenth session, call 4): run 86's real failures, mended: the shared memory each gate_up_act
# config asks (smem.py), then test_ops whole and test_kernels' gate/up tests on the GPU (xdist carried, 12 workers).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout 200 python3 benchmarks/runs/2026-12-01-run87/smem.py > $OUT/smem.log 2>&1
echo "smem rc $? at $(( $(date +%s) - S )) s" >> $OUT/smem.log
python3 -m pip install -q --no-index --no-deps --target /tmp/x .whl/xdist/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/x TORCHINDUCTOR_COMPILE_THREADS=2
timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_ops.py tests/test_kernels.py \
  -k "test_ops or gate_up" -rfE > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - S )) s" >> $OUT/tests.log
date -u; echo "took $(( $(date +%s) - S )) s"
cat $OUT/smem.log | cut -c1-300
grep -v "^  \|warnings.warn" $OUT/tests.log | tail -15 | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
