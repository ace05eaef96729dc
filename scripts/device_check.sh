#!/usr/bin/env bash
# One prepared run on a lent GPU machine (its image has torch; nothing is downloaded), meant to take under 8
# minutes (not yet run as it stands; its steps' timeouts bound it at ~20: give the run timeout_s=600 and read
# what $OUT holds if it is cut):
# the CUDA parity tests (the model on CUDA, graphed decode steps and hybrid experts included, then the Triton
# MXFP4 kernels of ops/triton_mxfp4.py, then KDA in flash-linear-attention's kernels where its wheels were
# carried), the Triton kernels' benchmark (`moeswap bench gpu-kernels`), decode of the bench-size K3 on CUDA
# graphs vs eager vs the CPU cores, `bench decode` at batch 1 and 64 (graphs vs eager side by side) and
# against transformers on a bench-size Kimi Linear, and a quarter of the experts in HBM per --expert-compute.
# Everything lands under $OUT (JSON where it is data, .txt logs beside it). Steps carry timeouts so that a
# hang cannot eat the steps after them. To run fla's kernels too, first fetch their wheels here (`pip download
# --no-deps -d wheels fla-core==0.6.0 einops`, into the ignored wheels/) and give the run carry=["wheels"].
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must compile for the GPU here
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
# wheels the image lacks, carried in the ignored wheels/ folder (run's `carry`): fla-core and einops for
# KDA in flash-linear-attention's kernels; nothing is downloaded
if compgen -G "wheels/*.whl" >/dev/null; then python3 -m pip install -q --no-deps --no-index wheels/*.whl 2>&1 | tail -2; fi

# pytest's JUnit XML -> {passed, failed, skipped, failures: [{test, message}]} as JSON
junit_json() {
  python3 - "$1" "$2" <<'PY'
import json, sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
out = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
for c in cases:
    bad = c.find("failure") if c.find("failure") is not None else c.find("error")
    if bad is not None:
        out["failed"] += 1
        out["failures"].append({"test": c.get("name"), "message": (bad.get("message") or "")[:500]})
    elif c.find("skipped") is not None:
        out["skipped"] += 1
    else:
        out["passed"] += 1
json.dump(out, open(sys.argv[2], "w"), indent=2)
PY
}

timeout 240 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" \
  --junitxml="$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.txt"
junit_json "$OUT/cuda_tests.xml" "$OUT/cuda_tests.json"
timeout 120 python3 -m pytest tests/ops/test_triton_mxfp4.py -q -m cuda -p no:cacheprovider \
  -o addopts="--import-mode=importlib" -o pythonpath=tests --junitxml="$OUT/triton_tests.xml" 2>&1 \
  | tee "$OUT/triton_tests.txt"
junit_json "$OUT/triton_tests.xml" "$OUT/triton_tests.json"
# KDA in flash-linear-attention's kernels (ops/kda.py kda_fla) against the torch path; skips where fla-core
# (and its one dependency, einops) is not installed in the image
timeout 120 python3 -m pytest tests/ops/test_kda_fla.py -q -m cuda -p no:cacheprovider \
  -o addopts="--import-mode=importlib" -o pythonpath=tests --junitxml="$OUT/fla_tests.xml" 2>&1 \
  | tee "$OUT/fla_tests.txt"
junit_json "$OUT/fla_tests.xml" "$OUT/fla_tests.json"
timeout 90 python3 -m moeswap bench gpu-kernels --json "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/gpu_kernels.txt"

python3 -m moeswap init-tiny /tmp/bench-k3 --size bench --seed 0 >/dev/null 2>&1
# decode on CUDA graphs (engine/cuda_graph.py, the default), eagerly (--reference-step), and on the CPU cores;
# each JSON has decode_tokens_per_s, native_decode_steps (graphed steps) and the tokens
for run in "cuda" "cuda --reference-step" "cpu"; do
  name=$(echo "$run" | tr -d ' -' | sed 's/referencestep/_eager/')
  timeout 120 python3 -m moeswap generate /tmp/bench-k3 --prompt "The quick brown fox jumps over the lazy dog" \
    --max-tokens 32 --ignore-eos --json --device $run --dtype bfloat16 --expert-memory 4GiB \
    2>&1 | tail -1 | tee "$OUT/generate_$name.json"
done
# Issue 21's goals: batch-1 ms per token and batch-64 tokens/s of graphed steps, side by side with the eager
# step (the moeswap-reference peer) in one run
timeout 180 python3 -m moeswap bench decode /tmp/bench-k3 --device cuda --dtype bfloat16 --batch 1,64 \
  --tokens 32 --prompt-tokens 64 --reps 2 --peers moeswap-reference --out-dir "" --json "$OUT/bench_decode_k3.json" \
  2>&1 | tail -20 | tee "$OUT/bench_decode_k3.txt"
# the same with the attention sublayers compiled (torch.compile) inside the graphs: fewer, fused kernels
timeout 150 python3 -m moeswap bench decode /tmp/bench-k3 --device cuda --dtype bfloat16 --batch 1,64 \
  --tokens 32 --prompt-tokens 64 --reps 2 --peers "" --compile --out-dir "" --json "$OUT/bench_decode_k3_compiled.json" \
  2>&1 | tail -12 | tee "$OUT/bench_decode_k3_compiled.txt"
# against transformers' KimiLinearForCausalLM on the same GPU in bf16, on a bench-size Kimi Linear
python3 -m moeswap init-tiny /tmp/bench-linear --arch kimi_linear --size bench --seed 0 >/dev/null 2>&1
timeout 180 python3 -m moeswap bench decode /tmp/bench-linear --device cuda --dtype bfloat16 --batch 1,16 \
  --tokens 32 --prompt-tokens 64 --reps 2 --peers transformers --out-dir "" --json "$OUT/bench_decode_linear.json" \
  2>&1 | tail -20 | tee "$OUT/bench_decode_linear.txt"
# Issue 21's hybrid experts: the fast tier in HBM at 25 % of bench-k3's 0.44 GB of MXFP4 experts (105 MiB), a
# 1 GiB pinned host tier: swap into HBM (gpu) vs misses computed by the CPU kernels (cpu) vs auto; each JSON
# has decode_tokens_per_s, the tokens (to compare with generate_cuda.json) and expert_store.hybrid.
for mode in gpu cpu auto; do
  timeout 90 python3 -m moeswap generate /tmp/bench-k3 --prompt "The quick brown fox jumps over the lazy dog" \
    --max-tokens 32 --ignore-eos --json --device cuda --dtype bfloat16 --expert-memory 105MiB --host-memory 1GiB \
    --expert-compute $mode 2>&1 | tail -1 | tee "$OUT/generate_hybrid_$mode.json"
done
# (last: if time runs out, this is what goes) The CPU kernel benchmark on the GPU machine's quiet host cores, pinned to 2 of them (the dev/CI
# machines are 2-core and were saturated when it was first measured).
taskset -c 0,1 python3 -m moeswap bench kernels --threads 2 --json "$OUT/kernels_2threads.json" 2>&1 | tee "$OUT/kernels_2threads.txt"
taskset -c 0 python3 -m moeswap bench kernels --threads 1 --fast-only 2>&1 | tee "$OUT/kernels_1thread.txt"
