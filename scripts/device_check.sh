#!/usr/bin/env bash
# One prepared run on a lent GPU machine (its image has torch; nothing is installed):
# the CUDA parity tests, then decode speed of the bench-size K3 on the GPU vs its CPU cores.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/cuda_tests.txt"
python3 -m moeswap init-tiny /tmp/bench-k3 --size bench --seed 0 >/dev/null 2>&1
for dev in cuda cpu; do
  python3 -m moeswap generate /tmp/bench-k3 --prompt "The quick brown fox jumps over the lazy dog" \
    --max-tokens 32 --ignore-eos --json --device $dev --dtype bfloat16 --expert-memory 4GiB \
    2>&1 | tail -1 | tee "$OUT/generate_$dev.json"
done
# The CPU kernel benchmark on the GPU machine's quiet host cores, pinned to 2 of them (the dev/CI
# machines are 2-core and were saturated when it was first measured).
taskset -c 0,1 python3 -m moeswap bench kernels --threads 2 --json "$OUT/kernels_2threads.json" 2>&1 | tee "$OUT/kernels_2threads.txt"
taskset -c 0 python3 -m moeswap bench kernels --threads 1 --fast-only 2>&1 | tee "$OUT/kernels_1thread.txt"
