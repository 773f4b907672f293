#!/usr/bin/env bash
# The cluster attention kernel launched per KV head (gqa_attn_cluster_group, the CUDA option
# attention_cluster_group_min_rows), on its first GPU: its tests, then the 0.5B fp16 and int4
# builds' batched decode at 1 / 4 / 16 / 32 streams for each R of GROUP_ROWS (default
# "0 2 8 16"; the "same tokens" column must stay yes) and the 32-row step profile of each.
# One device call; carry .whl (the builder) and .gpu_fixtures (the GPU test models):
#   bash scripts/gpu_cluster_group.sh
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
GPU_LANE_TESTS="tests/providers/cuda/test_cuda_gqa_decode.py tests/providers/cuda/test_cuda_batch.py" \
  bash scripts/gpu_lane.sh tests >"$LOGDIR/group_tests.log" 2>&1
echo "tests: exit $? ($(grep -E '^tests: ' "$LOGDIR/group_tests.log" | tail -n 1))"
GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh >"$LOGDIR/build.log" 2>&1 \
  || { echo "building the 0.5B models failed (see build.log)"; exit 1; }
for rows in ${GROUP_ROWS:-0 2 8 16}; do
  export ONNX_GENRT_ATTENTION_CLUSTER_GROUP_MIN_ROWS=$rows
  for prec in ${GPU_BENCH_PRECISIONS:-fp16 int4}; do
    echo "== attention_cluster_group_min_rows=$rows, 0.5B $prec"
    "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" --provider cuda \
      --streams 1,4,16,32 --tokens 128 --repeats 3 --no-reference 2>/dev/null
  done
  echo "== attention_cluster_group_min_rows=$rows, 0.5B fp16, a 32-row step"
  "$PY" -m onnx_genrt profile --model "$WORK/qwen05b-fp16" --provider cuda --rows 32 \
    --context 96 --steps 30 --top 3 | head -n 6
done 2>&1 | tee "$LOGDIR/cluster_group.txt"
