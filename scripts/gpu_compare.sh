#!/usr/bin/env bash
# Settings side by side in one device call: GPU tests, then the 0.5B builds' decode for each
# setting (greedy at GPU_COMPARE_STREAMS, and sampled with --sampled where
# GPU_COMPARE_SAMPLED=1), and its 1-row step profile. The "same tokens" column must stay yes
# within each run.
#   GPU_COMPARE_TESTS   pytest arguments (shell words: quote a -k expression) run with -m gpu
#                       first (empty: no tests)
#   GPU_COMPARE_SETTINGS  space-separated settings, each "default" or VAR=VALUE[,VAR=VALUE]
#                         (default: "default")
#   GPU_COMPARE_STREAMS   --streams of the bench (default: 1,32)
#   GPU_COMPARE_PROFILE   1 (default): each setting's 1-row step profile too
#   GPU_BENCH_PRECISIONS  builds to time (default: fp16)
# Carry .whl (the builder) and .gpu_fixtures (the GPU test models), for example:
#   GPU_COMPARE_TESTS="tests/providers/cuda/test_cuda_gqa_decode.py -k head_groups" \
#   GPU_COMPARE_SETTINGS="default ONNX_GENRT_ATTENTION_GROUPED_CLUSTER=1" \
#     bash scripts/gpu_compare.sh
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
PRECISIONS="${GPU_BENCH_PRECISIONS:-fp16}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
if [ -n "${GPU_COMPARE_TESTS:-}" ]; then
  eval "tests=($GPU_COMPARE_TESTS)"
  ONNX_GENRT_REQUIRE_GPU=1 timeout "${GPU_COMPARE_TEST_TIMEOUT:-240}" "$PY" -m pytest -q \
    -p no:cacheprovider -m gpu -o faulthandler_timeout=100 "${tests[@]}" \
    >"$LOGDIR/compare_tests.log" 2>&1
  echo "tests: exit $? ($(tail -n 1 "$LOGDIR/compare_tests.log"))"
  grep -E "^(FAILED|ERROR) |^E  " "$LOGDIR/compare_tests.log" | head -n 30
fi
GPU_BENCH_PRECISIONS="$PRECISIONS" GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh \
  >"$LOGDIR/build.log" 2>&1 || { echo "building the 0.5B models failed (see build.log)"; exit 1; }
for setting in ${GPU_COMPARE_SETTINGS:-default}; do
  env_args=()
  [ "$setting" = default ] || IFS=, read -r -a env_args <<<"$setting"
  for prec in $PRECISIONS; do
    echo "== $setting, 0.5B $prec"
    env "${env_args[@]}" timeout 150 "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" \
      --provider cuda --streams "${GPU_COMPARE_STREAMS:-1,32}" --tokens 128 --repeats 3 \
      --no-reference 2>&1 | tail -n 8
    if [ "${GPU_COMPARE_SAMPLED:-0}" = 1 ]; then
      echo "== $setting, 0.5B $prec, sampled"
      env "${env_args[@]}" timeout 150 "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" \
        --provider cuda --streams "${GPU_COMPARE_STREAMS:-1,32}" --sampled --tokens 128 \
        --repeats 3 --no-reference 2>&1 | tail -n 8
    fi
  done
  [ "${GPU_COMPARE_PROFILE:-1}" = 1 ] || continue
  echo "== $setting, 0.5B fp16, a 1-row step"
  env "${env_args[@]}" timeout 90 "$PY" -m onnx_genrt profile --model "$WORK/qwen05b-fp16" \
    --provider cuda --rows 1 --context 96 --steps 30 --top 6 2>&1 | head -n 10
done 2>&1 | tee "$LOGDIR/compare.txt"
