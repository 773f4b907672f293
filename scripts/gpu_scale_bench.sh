#!/usr/bin/env bash
# Issue 19's scale rows on the GPU machine: how decode cost grows with model size. For each
# shape named (default: 1.5b), builds a Qwen2 of that shape with random fp16 weights (made on
# the GPU), converts it with onnxruntime-genai's builder (the wheel carried in .whl/), times
# graphed greedy decode on CUDA (128 tokens after 32, median of 3) and prints tok/s beside the
# weight-bandwidth floor (`onnx-genrt bench`'s roofline line) as a percentage.
#   bash scripts/gpu_scale_bench.sh [1.5b] [7b]
# Shapes: 1.5b = Qwen2.5-1.5B (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
# 8960, vocab 151936, tied), fp16 and int4; 7b = Qwen2.5-7B (hidden 3584, 28 layers, 28 heads,
# 4 KV heads, intermediate 18944, vocab 152064, untied), int4 only (its fp16 build and
# checkpoint take most of a 10-minute call: run it alone). SCALE_PRECISIONS overrides the
# precisions. Logs go to $OUT (or /tmp/gpu_lane); models to GPU_BENCH_DIR.
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
TOKENS="${GPU_BENCH_TOKENS:-128}"
SHAPES="${*:-1.5b}"
mkdir -p "$WORK" "$LOGDIR"
whl=$(ls .whl/onnxruntime_genai-*.whl 2>/dev/null | head -n 1)
if [ -z "$whl" ]; then
  echo "no onnxruntime-genai wheel in .whl/: the scale bench needs its builder" >&2
  exit 2
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$whl" || exit 1
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

checkpoint() {  # SHAPE -> an HF checkpoint folder with random fp16 weights
  local shape=$1 out="$WORK/hf-$1"
  [ -f "$out/config.json" ] && { echo "$out"; return 0; }
  "$PY" - "$shape" "$out" >&2 <<'EOF' || return 1
import sys, time, torch, transformers
shape, out = sys.argv[1], sys.argv[2]
dims = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
               tie_word_embeddings=False),
}[shape]
cfg = transformers.Qwen2Config(max_position_embeddings=4096, rope_theta=1000000.0, **dims)
t0 = time.time()
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float16)
model.save_pretrained(out)
print(f"checkpoint {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
      f"in {time.time() - t0:.0f} s -> {out}")
EOF
  echo "$out"
}

for shape in $SHAPES; do
  case "$shape" in
    1.5b) precs="${SCALE_PRECISIONS:-fp16 int4}" ;;
    7b) precs="${SCALE_PRECISIONS:-int4}" ;;
    *) echo "gpu_scale_bench.sh: unknown shape '$shape' (expected 1.5b or 7b)" >&2; exit 2 ;;
  esac
  hf=$(checkpoint "$shape") || { echo "checkpoint $shape failed"; continue; }
  for prec in $precs; do
    dst="$WORK/qwen-$shape-$prec"
    if [ ! -f "$dst/genai_config.json" ]; then
      echo "== building $shape $prec"
      start=$SECONDS
      "$PY" -m onnxruntime_genai.models.builder -i "$hf" -o "$dst" -p "$prec" -e cuda \
        -c "$WORK/cache-$shape" >"$LOGDIR/builder-$shape-$prec.log" 2>&1 \
        || { echo "builder $shape $prec failed"; tail -n 20 "$LOGDIR/builder-$shape-$prec.log"; continue; }
      echo "built in $((SECONDS - start)) s"
    fi
    echo "== bench $shape $prec ($TOKENS tokens after 32, graphed greedy)"
    "$PY" -m onnx_genrt bench --model "$dst" --provider cuda --no-reference --tokens "$TOKENS" \
      --prompt-tokens 32 --repeats 3 2>"$LOGDIR/bench-$shape-$prec.err" \
      | tee "$LOGDIR/bench-$shape-$prec.txt" \
      || { echo "bench $shape $prec failed"; tail -n 30 "$LOGDIR/bench-$shape-$prec.err"; }
  done
done

echo "== scale summary (graphed greedy against the weight-bandwidth floor)"
"$PY" -m onnx_genrt lane-targets "$LOGDIR" | sed -n '/^scale/,$p'
