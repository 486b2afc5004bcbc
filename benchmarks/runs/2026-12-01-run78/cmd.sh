#!/usr/bin/env bash
# Run 78 (one H200; seventeenth session, call 1; carry [".wq/a"]): quack's wheels, first half, staged for run 79,
# which must follow at once on the warm machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT
bash benchmarks/quack_wheels.sh stage 2>&1 | tee $OUT/stage.log
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tee -a $OUT/stage.log
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
