#!/usr/bin/env bash
# A decoder layer's MLP half as one cooperative grid (NormGatedMLP, the CUDA option
# fused_mlp, providers/cuda/kernels/_gated_mlp.py) against the three kernels it replaces, in
# one device call: its GPU tests, then the 0.5B fp16 build's greedy decode at 1 and 32 streams
# and its 1-row step profile, alternating fused_mlp 0 / 1 / 0 / 1 (the "same tokens" column
# must stay yes within each run).
# Carry .whl (the builder) and .gpu_fixtures (the GPU test models):
#   bash scripts/gpu_fused_mlp.sh
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
ONNX_GENRT_REQUIRE_GPU=1 timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -x \
  -o faulthandler_timeout=100 tests/providers/cuda/test_cuda_gated_mlp.py \
  >"$LOGDIR/fused_mlp_tests.log" 2>&1
echo "fused MLP tests: exit $? ($(tail -n 1 "$LOGDIR/fused_mlp_tests.log"))"
grep -E "^(FAILED|ERROR|E  )" "$LOGDIR/fused_mlp_tests.log" | head -n 30
GPU_BENCH_PRECISIONS="${GPU_BENCH_PRECISIONS:-fp16}" GPU_BENCH_BUILD_ONLY=1 \
  bash scripts/gpu_llm_bench.sh >"$LOGDIR/build.log" 2>&1 \
  || { echo "building the 0.5B model failed (see build.log)"; exit 1; }
for prec in ${GPU_BENCH_PRECISIONS:-fp16}; do
  for fused in ${FUSED_SETTINGS:-0 1 0 1}; do
    echo "== fused_mlp=$fused, 0.5B $prec"
    ONNX_GENRT_FUSED_MLP=$fused timeout 150 "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" \
      --provider cuda --streams 1,32 --tokens 128 --repeats 3 --no-reference 2>&1 | tail -n 12
  done
  for fused in 0 1; do
    echo "== fused_mlp=$fused, 0.5B $prec, a 1-row step"
    ONNX_GENRT_FUSED_MLP=$fused timeout 90 "$PY" -m onnx_genrt profile --model "$WORK/qwen05b-$prec" \
      --provider cuda --rows 1 --context 96 --steps 30 --top 6 2>&1 | head -n 10
  done
done 2>&1 | tee "$LOGDIR/fused_mlp.txt"
