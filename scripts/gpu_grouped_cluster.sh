#!/usr/bin/env bash
# Decode / verify attention as the grouped kernel's cluster launch (gqa_decode_cluster, the
# CUDA option attention_grouped_cluster) against the per-head cluster kernel, in one device
# call: the attention, batch, kernel and speculation GPU tests (the whole lane is a call of its
# own: gpu_lane.sh tests), then the 0.5B fp16 and int4 builds' batched decode at
# 1 / 4 / 16 / 32 streams for each setting (the "same tokens" column must stay yes), the 1-
# and 32-row step profiles, and the embedded model's MTP against greedy.
# Carry .whl (the builder) and .gpu_fixtures (the GPU test models):
#   bash scripts/gpu_grouped_cluster.sh
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
GPU_LANE_TESTS="tests/providers/cuda/test_cuda_gqa_decode.py tests/providers/cuda/test_cuda_batch.py \
tests/providers/cuda/test_cuda_llm_kernels.py tests/providers/cuda/test_cuda_speculative.py" \
  bash scripts/gpu_lane.sh tests >"$LOGDIR/lane_tests.log" 2>&1
echo "tests: exit $? ($(grep -E '^tests: ' "$LOGDIR/lane_tests.log" | tail -n 1))"
grep -E "^(FAILED|ERROR) " "$LOGDIR/lane_tests.log" | head -n 20
GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh >"$LOGDIR/build.log" 2>&1 \
  || { echo "building the 0.5B models failed (see build.log)"; exit 1; }
for grouped in ${GROUPED_SETTINGS:-1 0}; do
  export ONNX_GENRT_ATTENTION_GROUPED_CLUSTER=$grouped
  for prec in ${GPU_BENCH_PRECISIONS:-fp16 int4}; do
    echo "== attention_grouped_cluster=$grouped, 0.5B $prec"
    "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" --provider cuda \
      --streams 1,4,16,32 --tokens 128 --repeats 3 --no-reference 2>/dev/null
  done
  for rows in 1 32; do
    echo "== attention_grouped_cluster=$grouped, 0.5B fp16, a $rows-row step"
    "$PY" -m onnx_genrt profile --model "$WORK/qwen05b-fp16" --provider cuda --rows "$rows" \
      --context 96 --steps 30 --top 3 | head -n 6
  done
  echo "== attention_grouped_cluster=$grouped, embedded model, MTP against greedy"
  "$PY" -m onnx_genrt bench --provider cuda --spec mtp --spec mtp:4 --tokens 256 \
    --prompt "    def __init__(self" --repeats 5 --no-reference 2>/dev/null
done 2>&1 | tee "$LOGDIR/grouped_cluster.txt"
