#!/usr/bin/env bash
# Run 48 (nvidia-h200-x2, one call; thirteenth session), two jobs side by side:
#   GPU 0, cores 0-15:  the GPU tests of this session's changes (cublas_two_streams: float64 checks, its side stream
#                       held back, CUDA graphs, reduce-overhead; the swap-AB config for plain MLPs), then issue 10's
#                       harness, bf16, SwiGLU 4096x11008, GELU+bias, the 70B shard;
#   GPU 1, cores 16-31: the 1b prefill pair by module with the MLP's parts (the unfused module's children, the
#                       patched MLP's plan callees), then the harness, bf16 4096x14336 and 3584x18944, then fp16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout -s INT 200 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_backend.py \
   -k "two_streams or batched_sizes or matches_float64 or planned_calls or repeated_calls or first_calls_inside or capture or no_host_sync or static_cache or reduce_overhead_replays" \
   > $OUT/tests.log 2>&1
 echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
 taskset -c 0-15 timeout $(left 470) python3 -m mlp_fuser bench --units 0:bf16,2:bf16,4:bf16 --max-autotune-ms '' \
   --budget-s $(left 455) --out $OUT/bench0 > $OUT/bench0.log 2>&1
 echo "GPU 0 ended at $(( $(date +%s) - S )) s") &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 120 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
   --prefill-paths eager,patch --time-modules 2>&1 | grep -v "$F" > $OUT/prefill.log
 echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
 taskset -c 16-31 timeout $(left 470) python3 -m mlp_fuser bench --units 1:bf16,3:bf16,0:fp16,2:fp16 \
   --max-autotune-ms '' --budget-s $(left 455) --out $OUT/bench1 > $OUT/bench1.log 2>&1
 echo "GPU 1 ended at $(( $(date +%s) - S )) s") &
wait
date -u; echo "took $(( $(date +%s) - S )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|ended" $OUT/tests.log | sed 's/tests\/test_//' | cut -c1-130 | tail -60
grep -i "host ms in all\|prefill eager:\|prefill patch:\|ended" $OUT/prefill.log | cut -c1-900
for b in bench0 bench1; do grep "^| " $OUT/$b/results.md | cut -d'|' -f2-7,9-10,13-14 | head -40; grep "^Skipped" $OUT/$b/results.md | cut -c1-300; done
grep -h "chose cublas_two_streams" $OUT/bench*.log | cut -c1-300 | head -12
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
