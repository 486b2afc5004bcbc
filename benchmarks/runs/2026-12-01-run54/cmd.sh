#!/usr/bin/env bash
# Run 54 (one H200; fourteenth session, call 1 of 2 back to back: carry [".wq/a"], stages quack's first half in /tmp/wq
# for run 55). Host cost part 4 at this code (plans call Triton's C launch function; _plain_call's cheaper checks):
#   the GPU tests of planned, repeated, captured and patched calls (the plans must take the C launch on triton 3.6);
#   bench_kernels.py overhead for SmolLM2 and 1B (with the A/B of the C launch against Triton's Python launcher);
#   the 1b prefill pair split by module (issue 9's missed 1b prefill, patch vs eager; last: run 48);
#   the fine-tuning step after the dispatch change of the thirteenth session (bench_train.py; last: run 47).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
bash benchmarks/quack_wheels.sh stage > $OUT/stage.log 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k "planned or repeated or capture or patched or synchronisation or trees or two_streams" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
timeout 130 python3 benchmarks/bench_kernels.py overhead:SmolLM2 overhead:1B > $OUT/overhead.log 2>&1
echo "overhead ended at $(( $(date +%s) - S )) s" >> $OUT/overhead.log
timeout 100 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
  --prefill-paths eager,patch --time-modules 2>&1 | grep -v "$F" > $OUT/prefill.log
echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
timeout $(left 560) python3 benchmarks/bench_train.py --out $OUT/train 2>&1 | grep -v "$F" > $OUT/train.log
echo "train ended at $(( $(date +%s) - S )) s" >> $OUT/train.log
date -u; echo "took $(( $(date +%s) - S )) s"
cat $OUT/stage.log; tail -8 $OUT/tests.log | cut -c1-250
grep "µs\|ended\|rror" $OUT/overhead.log | cut -c1-160 | head -60
grep -i "µs\|host\|module\|ended\|rror\|ms" $OUT/prefill.log | tail -30 | cut -c1-220
grep "^|\|ended\|rror" $OUT/train.log | cut -c1-160 | tail -16
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
