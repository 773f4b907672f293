#!/usr/bin/env bash
# Long prompts on the GPU (issue 19): the Qwen2.5-0.5B shape with random fp16 weights built for
# 32768 positions, prefill (time to first token) and decode after P prompt tokens, with the
# prompt attention on the flash-attention kernel (default), as matrix products
# (ONNX_GENRT_ATTENTION_FLASH_MIN_ROWS=0) and as the attention kernels (both options 0), decode
# attention on the grouped kernel instead of the many-split one (ONNX_GENRT_ATTENTION_GROUPED_DECODE=1)
# and on the 8-block cluster (ONNX_GENRT_ATTENTION_CLUSTER_MAX_KEYS=0), then HF transformers
# (sdpa) on the same weights.
#   bash scripts/gpu_long_bench.sh            (GPU_LONG_PROMPTS="256 8192 30000" by default)
#   GPU_LONG_SETTINGS="default VAR=1,VAR2=0"  (the provider settings each prompt runs with)
#   GPU_LONG_BUILD_ONLY=1                     (build the 32768-position model, when absent, and stop)
# Needs the onnxruntime-genai wheel in .whl/ for the builder. Logs go to $OUT when set.
set -uo pipefail
PY="${PYTHON:-python3}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
PROMPTS="${GPU_LONG_PROMPTS:-256 8192 30000}"
TOKENS="${GPU_LONG_TOKENS:-64}"
# Provider settings each prompt length runs with: "default" or comma-separated VAR=value.
SETTINGS="${GPU_LONG_SETTINGS:-default ONNX_GENRT_ATTENTION_FLASH_MIN_ROWS=0 ONNX_GENRT_ATTENTION_FLASH_MIN_ROWS=0,ONNX_GENRT_ATTENTION_GEMM_MIN_ROWS=0 ONNX_GENRT_ATTENTION_GROUPED_DECODE=1 ONNX_GENRT_ATTENTION_CLUSTER_MAX_KEYS=0}"
mkdir -p "$WORK" "$LOGDIR"
whl=$(ls .whl/onnxruntime_genai-*.whl 2>/dev/null | head -n 1)
[ -n "$whl" ] || { echo "no onnxruntime-genai wheel in .whl/"; exit 1; }
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$whl" || exit 1
"$PY" - "$WORK/hf-0.5b-32k" <<'EOF2' || exit 1
import os, sys, torch, transformers
out = sys.argv[1]
if not os.path.exists(out + "/config.json"):
    cfg = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.float16).save_pretrained(out)
EOF2
dst="$WORK/qwen05b-32k-fp16"
if [ ! -f "$dst/genai_config.json" ]; then
  PYTHONPATH="$WORK/site" "$PY" -m onnxruntime_genai.models.builder -i "$WORK/hf-0.5b-32k" -o "$dst" \
    -p fp16 -e cuda -c "$WORK/cache-32k" >"$LOGDIR/builder-32k.log" 2>&1 \
    || { echo "builder failed"; tail -n 20 "$LOGDIR/builder-32k.log"; exit 1; }
fi
[ "${GPU_LONG_BUILD_ONLY:-0}" = 1 ] && exit 0
for p in $PROMPTS; do
  for setting in $SETTINGS; do
    echo "== $p prompt tokens, $TOKENS new, $setting" | tee -a "$LOGDIR/long.txt"
    envs=()
    [ "$setting" = default ] || IFS=, read -r -a envs <<<"$setting"
    env "${envs[@]}" "$PY" -m onnx_genrt bench --model "$dst" --provider cuda --no-reference \
      --prompt-tokens "$p" --tokens "$TOKENS" --repeats 3 2>>"$LOGDIR/long.err" \
      | grep -E "^onnx-genrt|^runtime" | tee -a "$LOGDIR/long.txt"
  done
  echo "== HF transformers (sdpa), $p prompt tokens" | tee -a "$LOGDIR/long.txt"
  timeout "${HF_BENCH_TIMEOUT:-120}" "$PY" scripts/hf_bench.py --model "$WORK/hf-0.5b-32k" --device cuda \
    --dtype float16 --tokens "$TOKENS" --prompt-tokens "$p" --repeats 3 2>>"$LOGDIR/long.err" \
    | tee -a "$LOGDIR/long.txt" || echo "HF bench failed"
done
"$PY" -m onnx_genrt lane-targets "$LOGDIR" || echo "target table failed"
