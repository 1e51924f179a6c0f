#!/usr/bin/env bash
# The GPU checks in one run, from a checkout on a machine with a CUDA GPU,
# torch, triton, Cython and pytest (at most BUDGET=540 seconds): the core
# built in place, the CUDA tests (the tests' CUDA parameters and the GPU
# tests of the Triton kernel), `lmmetrics bench --device cuda` for plain
# and lazy logits, then the span kernel's layouts (benchmarks/gpu_sweep.py).
# Logs go to $OUT (default gpu-check/); docs/speed.md holds what it
# measured.
set -u
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi -L
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
# each step's limit, within what is left of BUDGET seconds (default 540:
# room for one rerun in a 15-minute device allowance); the most telling first
limit() { local l=$(( t0 + ${BUDGET:-540} - $(date +%s) )); if (( l < $1 )); then echo $(( l > 5 ? l : 5 )); else echo "$1"; fi; }
timeout "$(limit 150)" python3 setup.py build_ext --inplace -j 16 >"$out/build.log" 2>&1 \
    || { echo "build failed"; tail -30 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=src
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 90"
# shellcheck disable=SC2086
timeout "$(limit 170)" python3 -m pytest -q -p no:cacheprovider $per_test -k "not routed" tests/cuda/test_cuda_path.py \
    tests/cuda/test_triton.py::test_gpu_kernel_against_the_torch_path_and_the_core \
    tests/cuda/test_triton.py::test_gpu_rows_past_2_31_elements tests/cuda/test_triton.py::test_gpu_path_edges_on_a_gpu \
    tests/cuda/test_triton.py::test_gpu_cached_launch_gives_triton_launchers_bits \
    tests/cuda/test_triton.py::test_compiles_for_sm90_without_spills 2>&1 | tee "$out/tests.log" | tail -5
timeout "$(limit 60)" python3 -m lmmetrics bench --device cuda --dtype bfloat16 --tokens 8192 2>&1 | tee "$out/bench.log"
timeout "$(limit 150)" python3 benchmarks/gpu_sweep.py 2>&1 | tee "$out/sweep.log"
timeout "$(limit 60)" python3 -m lmmetrics bench --device cuda 2>&1 | tee -a "$out/bench.log"
timeout "$(limit 45)" python3 -m lmmetrics bench --lazy --device cuda --tokens 8192 2>&1 | tee "$out/lazy.log"
timeout "$(limit 45)" python3 -m lmmetrics bench --lazy --device cuda --tokens 8192 --dtype float32 2>&1 | tee -a "$out/lazy.log"
echo "done in $(( $(date +%s) - t0 )) s"
