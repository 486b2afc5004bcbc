#!/usr/bin/env bash
# Run 58 (one H200; fourteenth session): run 57's machine, still warm with quack installed (/tmp/q/site-packages), a
# second set of quack configs; typed straight into the call (first without the patterns link, which failed at import
# in 4 s, then as below). Its log is out/quack2.log.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; Q=/tmp/q/site-packages
PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD timeout 300 python3 benchmarks/probe_quack_gated.py --budget-s 240 \
  --configs 128x192-1x2-pingpong,128x128-1x1-pingpong,128x192-1x1-pingpong,128x256-1x2-coop,128x224-1x2-coop,\
128x128-2x1-pingpong,128x96-1x2-pingpong,128x64-1x2-pingpong > $OUT/quack2.log 2>&1
grep -v "^\s*$" $OUT/quack2.log | tail -24 | cut -c1-400
