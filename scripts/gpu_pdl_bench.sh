#!/usr/bin/env bash
# Programmatic dependent launch (the CUDA provider's programmatic_launch and pdl_prefetch) by
# measurement, on the GPU machine: builds the lane's 0.5B-shaped fp16 and int4 models when
# absent (gpu_llm_bench.sh with GPU_BENCH_BUILD_ONLY=1; needs the onnxruntime-genai wheel in
# .whl/), then times each with PDL off, on without the L2 weight prefetch, and on (the
# default), every setting in processes of its own and the settings in turn twice (off, no
# prefetch, on, on, no prefetch, off) so drift shows: graphed and eager greedy decode
# (onnx-genrt bench) and the decode and verify steps (onnx-genrt step-cost). Logs go to $OUT.
#   bash scripts/gpu_pdl_bench.sh            # PDL_BENCH_TOKENS (128), PDL_BENCH_PRECISIONS
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
TOKENS="${PDL_BENCH_TOKENS:-128}"
PRECISIONS="${PDL_BENCH_PRECISIONS:-fp16 int4}"
mkdir -p "$LOGDIR"
GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh || exit 1
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

for prec in $PRECISIONS; do
  dst="$WORK/qwen05b-$prec"
  [ -f "$dst/genai_config.json" ] || { echo "no $prec model in $dst"; continue; }
  for setting in "0 0" "1 0" "1 1" "1 1" "1 0" "0 0"; do
    read -r pdl prefetch <<<"$setting"
    log="$LOGDIR/pdl-$prec-$pdl$prefetch.txt"
    echo "== $prec: ONNX_GENRT_PROGRAMMATIC_LAUNCH=$pdl ONNX_GENRT_PDL_PREFETCH=$prefetch" | tee -a "$log"
    export ONNX_GENRT_PROGRAMMATIC_LAUNCH="$pdl" ONNX_GENRT_PDL_PREFETCH="$prefetch"
    "$PY" -m onnx_genrt bench --model "$dst" --provider cuda --compare-eager --no-reference \
      --tokens "$TOKENS" --prompt-tokens 32 --repeats 3 2>>"$log.err" | tee -a "$log" \
      || { echo "bench failed"; tail -n 20 "$log.err"; }
    "$PY" -m onnx_genrt step-cost --model "$dst" --provider cuda -k 4 2>>"$log.err" | tee -a "$log" \
      || { echo "step cost failed"; tail -n 20 "$log.err"; }
  done
done
