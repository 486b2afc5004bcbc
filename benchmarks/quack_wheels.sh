#!/usr/bin/env bash
# quack and the CuTe DSL for benchmarks/probe_quack_gated.py on the device machine, which downloads nothing and takes at
# most 64 MiB per call (device README). One wheel, nvidia-cutlass-dsl-libs-cu13, is 92 MB, so it travels in two halves
# over two calls while the machine stays warm (it is handed back after 30 s idle: call 2 must follow at once).
#   here:            bash benchmarks/quack_wheels.sh fetch     -> .wq/a (small wheels, first half), .wq/b (second half)
#   device, call 1:  carry [".wq/a"]; bash benchmarks/quack_wheels.sh stage   (copies .wq/a to /tmp/wq)
#   device, call 2:  carry [".wq/b"]; bash benchmarks/quack_wheels.sh install &&
#                    S=/tmp/q/site-packages; PYTHONPATH=$S:$S/nvidia_cutlass_dsl/dsl_packages:$PWD \
#                    python3 benchmarks/probe_quack_gated.py
# The device already has cuda-bindings and cuda-pathfinder (run 52's package list); the DSL's own packages live in
# nvidia_cutlass_dsl/dsl_packages, which its .pth file would add to sys.path in a site directory but not on PYTHONPATH.
# The target's path holds "/site-packages/": quack keys its compile cache on the source of the functions an epilogue
# reaches and counts only those under such a path as installed code; under /tmp/site it walked into the DSL's own
# globals and refused a ContextVar there (run 55: "TypeError: epilogue fn depends on <ContextVar ...>").
set -u
V=4.8.1
case "${1:-}" in
  fetch)
    grep -qx "/.wq/" .git/info/exclude 2>/dev/null || echo "/.wq/" >> .git/info/exclude
    rm -rf .wq && mkdir -p .wq/a .wq/b .wq/big
    P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
    P="$P --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
    python3 -m pip download $P -d .wq/a quack-kernels==0.6.5 nvidia-cutlass-dsl==$V nvidia-cutlass-dsl-libs-core==$V \
      nvidia-cutlass-dsl-libs-base==$V apache-tvm-ffi torch-c-dlpack-ext einops protobuf || exit 1
    python3 -m pip download $P -d .wq/big nvidia-cutlass-dsl-libs-cu13==$V || exit 1
    big=$(ls .wq/big/*.whl) && split -n 2 -d "$big" ".wq/part" && mv .wq/part00 .wq/a/ && mv .wq/part01 .wq/b/
    basename "$big" > .wq/a/big_name && rm -rf .wq/big
    du -sh .wq/a .wq/b ;;
  stage)  # device, call 1: the first half, out of the tree's copy (which the next call's carry may replace)
    [ -f .wq/a/part00 ] || { echo "quack_wheels: .wq/a missing (carry it)" >&2; exit 1; }
    mkdir -p /tmp/wq && cp .wq/a/* /tmp/wq/ && du -sh /tmp/wq ;;
  install)  # device, call 2, in the tree's root: /tmp/wq from call 1, .wq/b carried now
    [ -f /tmp/wq/part00 ] || { echo "quack_wheels: /tmp/wq/part00 missing (a fresh machine: stage again)" >&2; exit 1; }
    [ -f .wq/b/part01 ] || { echo "quack_wheels: .wq/b missing (carry it)" >&2; exit 1; }
    cat /tmp/wq/part00 .wq/b/part01 > "/tmp/wq/$(cat /tmp/wq/big_name)" && rm /tmp/wq/part00
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/q/site-packages /tmp/wq/*.whl ;;
  *) echo "usage: bash benchmarks/quack_wheels.sh fetch | stage | install" >&2; exit 2 ;;
esac
