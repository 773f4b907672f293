#!/usr/bin/env bash
# LLM benchmark on the GPU machine (called by gpu_lane.sh; needs the onnxruntime-genai wheel
# carried in .whl/ because that machine has no network). Builds a Qwen2.5-0.5B-shaped Qwen2
# with random weights (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
# vocab 151936, tied embeddings) through onnxruntime-genai's builder, then times greedy
# decode on CUDA with graphs on and off. Random weights: fixed token count, eos ruled out.
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
TOKENS="${GPU_BENCH_TOKENS:-128}"
# GPU_BENCH_COMPARE: extra rows of the 0.5B bench (default eager and serial);
# GPU_BENCH_PROFILE=0 skips the per-op step profiles (a shorter lane when device time is short).
COMPARE="${GPU_BENCH_COMPARE---compare-eager --compare-serial}"
PROFILE="${GPU_BENCH_PROFILE:-1}"
# GPU_BENCH_STREAMS: batched-decode rows of the 0.5B bench (aggregate tok/s; empty: none), and
# the same batch sizes on HF transformers (static cache; HF_BATCH_TIMEOUT, default 240 s).
STREAMS="${GPU_BENCH_STREAMS-1,4,16,32}"
# GPU_BENCH_DRAFT_VOCAB: the verify + MTP chain step cost again with the chain drafting over
# the first N token ids (speculative.json's mtp.draft_vocab; default 32768, 0: not measured).
DRAFT_VOCAB="${GPU_BENCH_DRAFT_VOCAB:-32768}"
# GPU_BENCH_PRECISIONS: the 0.5B builds benched (default "fp16 int4").
# GPU_BENCH_BUILD_ONLY=1: build the 0.5B fp16 and int4 models (when absent) and stop there.
BUILD_ONLY="${GPU_BENCH_BUILD_ONLY:-0}"
# GPU_BENCH_EMBEDDED=0: skip the embedded model's rows (speculation, its step cost), for a
# shorter call that keeps the 0.5B and HF rows.
EMBEDDED="${GPU_BENCH_EMBEDDED:-1}"
mkdir -p "$WORK" "$LOGDIR"
whl=$(ls .whl/onnxruntime_genai-*.whl 2>/dev/null | head -n 1)
if [ -z "$whl" ]; then
  echo "no onnxruntime-genai wheel in .whl/: LLM bench skipped"
  exit 0
fi
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$whl" || exit 1
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - "$WORK" <<'EOF2' || exit 1
import sys, torch, transformers
out = sys.argv[1] + "/hf-0.5b"
import os
if not os.path.exists(out + "/config.json"):
    cfg = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.float16).save_pretrained(out)
print("hf checkpoint:", out)
EOF2

for prec in ${GPU_BENCH_PRECISIONS:-fp16 int4}; do
  dst="$WORK/qwen05b-$prec"
  if [ ! -f "$dst/genai_config.json" ]; then
    echo "== building $prec"
    "$PY" -m onnxruntime_genai.models.builder -i "$WORK/hf-0.5b" -o "$dst" -p "$prec" -e cuda \
      -c "$WORK/cache" --extra_options include_hidden_states=true >"$LOGDIR/builder-$prec.log" 2>&1 \
      || { echo "builder $prec failed"; tail -n 20 "$LOGDIR/builder-$prec.log"; continue; }
    # a random MTP head (timing only): verify + MTP chain cost on this shape
    "$PY" scripts/random_mtp_head.py "$dst" --intermediate 4864 || echo "random MTP head failed"
  fi
  [ "$BUILD_ONLY" = 1 ] && continue
  echo "== bench $prec ($TOKENS tokens, eager vs graphed)"
  # shellcheck disable=SC2086
  "$PY" -m onnx_genrt bench --model "$dst" --provider cuda $COMPARE --no-reference \
    ${STREAMS:+--streams "$STREAMS"} --tokens "$TOKENS" --prompt-tokens 32 --repeats 3 2>"$LOGDIR/bench-$prec.err" | tee "$LOGDIR/bench-$prec.txt" \
    || { echo "bench $prec failed"; tail -n 30 "$LOGDIR/bench-$prec.err"; }
  if [ "$prec" = fp16 ]; then
    echo "== prefill of a 512-token prompt ($prec)"
    "$PY" -m onnx_genrt bench --model "$dst" --provider cuda --no-reference --tokens 16 \
      --prompt-tokens 512 --repeats 3 2>>"$LOGDIR/bench-$prec.err" | tee "$LOGDIR/prompts-512-$prec.txt" \
      || echo "512-token prompt bench $prec failed"
  fi
  if [ "$PROFILE" != 0 ]; then
    echo "== step profile ($prec, decode M=1, 256 cached positions)"
    "$PY" -m onnx_genrt profile --model "$dst" --provider cuda --top 10 | tee "$LOGDIR/profile-$prec.txt" \
      || echo "step profile $prec failed"
    echo "== step profile ($prec, verify M=5, 256 cached positions)"
    "$PY" -m onnx_genrt profile --model "$dst" --provider cuda --width 5 --top 10 \
      | tee "$LOGDIR/profile-verify-$prec.txt" || echo "step profile (verify) $prec failed"
  fi
  echo "== verify vs decode step cost ($prec, k=4, 256 cached positions)"
  "$PY" -m onnx_genrt step-cost --model "$dst" --provider cuda -k 4 | tee "$LOGDIR/step-$prec.txt" \
    || echo "step cost $prec failed"
  if [ "$DRAFT_VOCAB" != 0 ]; then
    echo "== the same with the MTP chain drafting over the first $DRAFT_VOCAB ids ($prec)"
    cp "$dst/speculative.json" "$WORK/speculative-$prec.json"
    "$PY" - "$dst/speculative.json" "$DRAFT_VOCAB" <<'EOF3'
import json, sys
path, ids = sys.argv[1], int(sys.argv[2])
spec = json.load(open(path))
spec["mtp"]["draft_vocab"] = ids
json.dump(spec, open(path, "w"), indent=4)
EOF3
    { echo "draft vocab $DRAFT_VOCAB"
      "$PY" -m onnx_genrt step-cost --model "$dst" --provider cuda -k 4; } | tee "$LOGDIR/step-$prec-draft.txt" \
      || echo "step cost $prec (draft vocab) failed"
    cp "$WORK/speculative-$prec.json" "$dst/speculative.json"
  fi
done

[ "$BUILD_ONLY" = 1 ] && exit 0

if [ "$EMBEDDED" != 0 ]; then
  echo "== embedded trained model on CUDA: greedy vs speculative (256 tokens, a Python prompt; mtp = the model's k=3); 1 / 4 / 16 streams plain and speculating per row (ngram)"
  # the 0.5B rows' comparisons, less --compare-eager (whole words only)
  DEFAULT_COMPARE=$(for w in $COMPARE; do [ "$w" = --compare-eager ] || printf '%s ' "$w"; done)
  # shellcheck disable=SC2086
  "$PY" -m onnx_genrt bench --provider cuda --spec mtp --spec mtp:4 --spec draft --spec ngram --streams 1,4,16 $DEFAULT_COMPARE --no-reference \
    --tokens 256 --prompt "    def __init__(self" --repeats 3 2>"$LOGDIR/bench-default.err" | tee "$LOGDIR/bench-default.txt" \
    || { echo "default-model bench failed"; tail -n 30 "$LOGDIR/bench-default.err"; }

  echo "== embedded model: verify + MTP chain step, per op (k=4)"
  "$PY" -m onnx_genrt step-cost --provider cuda -k 4 | tee "$LOGDIR/step-default.txt" || echo "step cost failed"
  if [ "$PROFILE" != 0 ]; then
    "$PY" -m onnx_genrt profile --provider cuda --width 5 --mtp --top 8 | tee "$LOGDIR/profile-default.txt" \
      || echo "step profile (mtp) failed"
  fi
fi

echo "== HF transformers on the same fp16 weights ($TOKENS tokens)"
timeout "${HF_BENCH_TIMEOUT:-180}" "$PY" scripts/hf_bench.py --model "$WORK/hf-0.5b" --device cuda --dtype float16 \
  --tokens "$TOKENS" --prompt-tokens 32 --repeats 3 --json "$LOGDIR/hf_bench.json" \
  2>"$LOGDIR/hf_bench.err" | tee "$LOGDIR/hf_bench.txt" \
  || { echo "HF bench failed"; tail -n 30 "$LOGDIR/hf_bench.err"; }

if [ -n "$STREAMS" ]; then
  echo "== HF transformers batched, same fp16 weights, static cache (batch $STREAMS, $TOKENS tokens)"
  timeout "${HF_BATCH_TIMEOUT:-240}" "$PY" scripts/hf_batch_bench.py --model "$WORK/hf-0.5b" --device cuda \
    --dtype float16 --batch "$STREAMS" --tokens "$TOKENS" --prompt-tokens 32 --repeats 3 \
    --json "$LOGDIR/hf_batch.json" 2>"$LOGDIR/hf_batch.err" | tee "$LOGDIR/hf_batch.txt" \
    || { echo "HF batched bench failed"; tail -n 30 "$LOGDIR/hf_batch.err"; }
fi
