#!/usr/bin/env bash
# Run 47 (nvidia-h200-x2, one call; thirteenth session), two jobs side by side:
#   GPU 0, cores 0-15:  the three probes the twelfth session wrote (NOTES "Next": swap-AB configs on the plain MLP and
#                       at 128-token blocks, cuBLAS's gate and up on two streams, the persistent TMA gate/up);
#   GPU 1, cores 16-31: the 1b prefill pair split by module (--time-modules: where the patched forward's extra host
#                       time goes), the fine-tuning step at this code (last: run 36), the op's host cost per call
#                       (bench_kernels.py overhead; last: run 26).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout 130 python3 benchmarks/probe_swapab_configs.py --shapes 2,0 --ms 1,16,32 --budget-s 100 \
   > $OUT/probe_swapab_configs.log 2>&1
 taskset -c 0-15 timeout 75 python3 benchmarks/probe_swapab_configs.py --shapes 0,2 --ms 128 --block-m 128 --warps 8 \
   --steps 64x3,64x4 --down cublas --budget-s 50 > $OUT/probe_swapab_m128.log 2>&1
 taskset -c 0-15 timeout 120 python3 benchmarks/probe_two_streams.py --budget-s 95 > $OUT/probe_two_streams.log 2>&1
 (cd benchmarks && taskset -c 0-15 timeout $(left 470) python3 probe_gate_up_tma.py --budget-s $(left 430) \
   > $OUT/probe_gate_up_tma.log 2>&1)
 echo "GPU 0 ended at $(( $(date +%s) - S )) s") &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 150 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
   --prefill-paths eager,patch --time-modules 2>&1 | grep -v "$F" > $OUT/prefill.log
 echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
 taskset -c 16-31 timeout 200 python3 benchmarks/bench_train.py --out $OUT/train 2>&1 | grep -v "$F" > $OUT/train.log
 echo "train ended at $(( $(date +%s) - S )) s" >> $OUT/train.log
 taskset -c 16-31 timeout $(left 470) python3 benchmarks/bench_kernels.py overhead > $OUT/overhead.log 2>&1
 echo "GPU 1 ended at $(( $(date +%s) - S )) s") &
wait
date -u; echo "took $(( $(date +%s) - S )) s"
grep "^|\|budget\|rror" $OUT/probe_swapab_configs.log | cut -c1-200 | tail -30
grep "^|\|budget\|rror" $OUT/probe_swapab_m128.log | cut -c1-200 | tail -12
tail -26 $OUT/probe_two_streams.log | cut -c1-200
tail -30 $OUT/probe_gate_up_tma.log | cut -c1-200
grep -i "µs\|host\|module\|ended\|rror\|ms" $OUT/prefill.log | tail -40 | cut -c1-220
grep "^|\|ended\|rror" $OUT/train.log | cut -c1-160 | tail -16
tail -30 $OUT/overhead.log | cut -c1-200
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
