#!/usr/bin/env bash
# Tokens drawn on the device (onnx_genrt::SampleTokens, BatchGenerator.device_sampling) on a
# GPU, in one device call: its GPU tests (the kernel against core.token_sampling's rule, the
# batch test), then the 0.5B fp16 build's batched decode at 1 / 8 / 32 streams, greedy and
# sampled (temperature 1, top_k 50) with the draws on the host and on the device.
# Carry .whl (the builder) and .gpu_fixtures (the GPU test models):
#   bash scripts/gpu_device_sampling.sh
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
ONNX_GENRT_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/providers/cuda/test_cuda_provider.py tests/providers/cuda/test_cuda_batch.py \
  -k "sample or sampled" >"$LOGDIR/sampling_tests.log" 2>&1
echo "tests: exit $? ($(tail -n 1 "$LOGDIR/sampling_tests.log"))"
GPU_BENCH_PRECISIONS="${GPU_BENCH_PRECISIONS:-fp16}" GPU_BENCH_BUILD_ONLY=1 \
  bash scripts/gpu_llm_bench.sh >"$LOGDIR/build.log" 2>&1 \
  || { echo "building the 0.5B model failed (see build.log)"; exit 1; }
for prec in ${GPU_BENCH_PRECISIONS:-fp16}; do
  echo "== 0.5B $prec, greedy and sampled streams"
  "$PY" -m onnx_genrt bench --model "$WORK/qwen05b-$prec" --provider cuda \
    --streams 1,8,32 --sampled --tokens 128 --repeats 3 --no-reference 2>/dev/null
done 2>&1 | tee "$LOGDIR/device_sampling.txt"
