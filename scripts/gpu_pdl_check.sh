#!/usr/bin/env bash
# Whether programmatic dependent launch can be the CUDA provider's default (NOTES.md): on the
# GPU machine, the captured ReduceSum test that failed once with it on, three times each with
# it off and on; then the CUDA tests and the op tests' cuda cases with it on
# (ONNX_GENRT_PROGRAMMATIC_LAUNCH=1) for six minutes. Carry .gpu_fixtures (the whole-model
# tests read it). Logs and a summary go to $OUT. One 10-minute device call:
#   bash scripts/gpu_pdl_check.sh            (PDL_CHECK_REPEATS, default 3)
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
REPEATS="${PDL_CHECK_REPEATS:-3}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
TEST="tests/providers/cuda/test_cuda_llm_kernels.py::test_reduce_sum_all_axes_long_captured"
for pdl in 0 1; do
  for i in $(seq "$REPEATS"); do
    ONNX_GENRT_REQUIRE_GPU=1 ONNX_GENRT_PROGRAMMATIC_LAUNCH=$pdl "$PY" -m pytest -q \
      -p no:cacheprovider "$TEST" >>"$LOGDIR/pdl_reduce_$pdl.log" 2>&1
    echo "reduce-sum test, PDL=$pdl, run $i: exit $?" | tee -a "$LOGDIR/pdl_check.txt"
  done
done
ONNX_GENRT_REQUIRE_GPU=1 ONNX_GENRT_PROGRAMMATIC_LAUNCH=1 timeout -s INT 360 "$PY" -m pytest -q \
  -p no:cacheprovider -m gpu tests/providers/cuda tests/ops -rf >"$LOGDIR/pdl_all.log" 2>&1
echo "all CUDA tests with PDL on: exit $?" | tee -a "$LOGDIR/pdl_check.txt"
grep -E "^FAILED|^ERROR|passed|failed" "$LOGDIR/pdl_all.log" | tail -20 | tee -a "$LOGDIR/pdl_check.txt"
