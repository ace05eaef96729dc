#!/usr/bin/env bash
# Rebuilds the default model (models/stdlib-k3) from this interpreter's standard library:
#   scripts/train-default-model.sh [WORK_DIR] [OUT_DIR]
# corpus + tokenizer + initial weights, the training run (~1.2 h on 2 quiet cores; resumable: rerun with
# RESUME=1 after an interruption), a check of its first steps, MXFP4 experts, held-out evaluation, model card.
set -euo pipefail
WORK=${1:-runs/stdlib-k3}
OUT=${2:-models/stdlib-k3}
PY=${PY:-python}
# a fixed thread count (the run's sums, and so its loss curve, depend on it; --reproduce restores it) and
# passive waiting: OpenMP's spinning threads slow a busy machine's run tenfold (docs/benchmarks.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ -z "${RESUME:-}" ]; then
  $PY -m moeswap.stdlib_model prepare "$WORK"
  $PY -m moeswap train "$WORK/train.yaml"
else
  $PY -m moeswap train "$WORK/train.yaml" --resume
fi
$PY -m moeswap.stdlib_model check "$WORK"   # the run's first steps again from its manifest (the card quotes it)
$PY -m moeswap quantize "$WORK/trained" "$WORK/mxfp4" --experts mxfp4
$PY -m moeswap.stdlib_model evaluate "$WORK"
$PY -m moeswap.stdlib_model publish "$WORK" "$OUT"
