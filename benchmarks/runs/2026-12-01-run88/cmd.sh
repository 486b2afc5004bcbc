#!/usr/bin/env bash
# Run 88 (one H200; eighteenth session, call 5): the whole test suite on the GPU again, at the final code (kernels on CUDA,
# bf16 included, the GPU-only tests among them), after run 86's mends; pytest-xdist carried as wheels
# (.whl/xdist), 14 workers. test_packaging (builds a wheel; CPU CI runs it) left out. quack not installed: its
# tests skip here (run 81 ran them).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/x .whl/xdist/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/x TORCHINDUCTOR_COMPILE_THREADS=2
timeout -s INT 520 python3 -m pytest -q -p no:cacheprovider -n 14 tests --ignore=tests/test_packaging.py \
  --durations=15 -rfEs > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - S )) s" >> $OUT/tests.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep -v "^SKIPPED\|^  \|warnings.warn" $OUT/tests.log | tail -40 | cut -c1-300
grep -c "^SKIPPED" $OUT/tests.log
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
