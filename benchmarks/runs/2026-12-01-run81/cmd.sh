#!/usr/bin/env bash
# Run 81 (one H200; seventeenth session, call 4, right after run 80; carry [".wq/b"]). quack installed, then:
# 1. the op's host time per call (bench_kernels.py overhead:SmolLM2), first, nothing else running: after the
#    sixteenth session's dispatch change (the Problem's activation and one_weight keys);
# 2. the CUDA-graph-trees test with gate and up stored as one, mended after run 79 (its weights now nn.Parameters, as a
#    model holds them: Inductor's trees copied plain tensors into buffers of their own, so the forced quack config
#    met separate weights), and the rest of -k stored_as_one;
# 3. benchmarks/probe_read_ceiling.py (new): a streaming read of the MLP's weight bytes against the copy floor, and
#    the two halves of the op at M = 1, 16, on the five shapes;
# 4. issue 9's 1b table (decode eager/patch and static cache, prefill pairs) after the dispatch change.
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 60 python3 benchmarks/bench_kernels.py overhead:SmolLM2 > $OUT/overhead.log 2>&1
echo "overhead ended at $(( $(date +%s) - S )) s" >> $OUT/overhead.log
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "stored_as_one" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
timeout 100 python3 benchmarks/probe_read_ceiling.py --budget-s 80 > $OUT/read.log 2>&1
echo "read ended at $(( $(date +%s) - S )) s" >> $OUT/read.log
timeout $(left 585) python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --units d0:1,d0:8,d1:1,d1:8,p0,p1 \
  --budget-s $(left 520) 2>&1 | grep -v "$F" > $OUT/gen1b.log
echo "1b ended at $(( $(date +%s) - S )) s" >> $OUT/gen1b.log
date -u; echo "took $(( $(date +%s) - S )) s"
tail -4 $OUT/tests.log | cut -c1-250
grep "^|\|ended\|rror" $OUT/overhead.log | cut -c1-160 | head -20
grep "^|\|budget\|WRONG\|rror" $OUT/read.log | cut -c1-300
grep "^|\|ended\|skip\|rror" $OUT/gen1b.log | cut -c1-250 | tail -20
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
