#!/usr/bin/env bash
# The per-op step profiles that `onnx-genrt lane-targets` names beside issue 17's and 19's
# targets (where each target's time goes), each `onnx-genrt profile` of the step the target
# times, written to $OUT as the names lane-targets reads:
#   0.5b: profile-chain-P.txt (verify M=5 + the MTP chain), profile-rows32-P.txt (a 32-row
#         decode step after 96 positions), for P in GPU_BENCH_PRECISIONS (default "fp16
#         int4"); profile-prefill-32-fp16.txt and profile-prefill-512-fp16.txt (a step of 32
#         / 512 tokens: every row's logits, so its lm_head is wider than a prefill's);
#   long: profile-long-P.txt (decode after P cached positions) and profile-prefill-P.txt (a
#         step of P tokens) on the 32768-position build, for P in GPU_LONG_PROMPTS (default
#         "8192 30000").
# The decode step and verify profiles (profile-P.txt, profile-verify-P.txt,
# profile-default.txt) come from gpu_llm_bench.sh. Builds the models it needs (carry .whl);
# each profile has GPU_PROFILE_TIMEOUT seconds (default 180). One device call:
#   bash scripts/gpu_profiles.sh [0.5b] [long]      (no argument: both)
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
LIMIT="${GPU_PROFILE_TIMEOUT:-180}"
PARTS="${*:-0.5b long}"
for part in $PARTS; do
  case "$part" in
    0.5b | long) ;;
    *) echo "gpu_profiles.sh: unknown part '$part' (expected: 0.5b, long)" >&2; exit 2 ;;
  esac
done
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1

# profile NAME MODEL ARGS...: one `onnx-genrt profile` into $LOGDIR/NAME (its failure noted there).
profile() {
  local name="$1" model="$2"
  shift 2
  echo "== $name: onnx-genrt profile --model $model --provider cuda $*"
  timeout "$LIMIT" "$PY" -m onnx_genrt profile --model "$model" --provider cuda "$@" \
    >"$LOGDIR/$name" 2>&1 || echo "profile failed or timed out (exit $?)" >>"$LOGDIR/$name"
  head -n 12 "$LOGDIR/$name"
}

if [[ " $PARTS " == *" 0.5b "* ]]; then
  PRECISIONS="${GPU_BENCH_PRECISIONS:-fp16 int4}"
  GPU_BENCH_PRECISIONS="$PRECISIONS" GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh \
    >"$LOGDIR/build.log" 2>&1 || { echo "building the 0.5B models failed (see build.log)"; exit 1; }
  for prec in $PRECISIONS; do
    dir="$WORK/qwen05b-$prec"
    profile "profile-chain-$prec.txt" "$dir" --width 5 --mtp --top 10
    profile "profile-rows32-$prec.txt" "$dir" --rows 32 --context 96 --steps 30 --top 10
    if [ "$prec" = fp16 ]; then
      profile "profile-prefill-32-fp16.txt" "$dir" --width 32 --context 1 --steps 5 --top 10
      profile "profile-prefill-512-fp16.txt" "$dir" --width 512 --context 1 --steps 3 --top 10
    fi
  done
fi
if [[ " $PARTS " == *" long "* ]]; then
  GPU_LONG_BUILD_ONLY=1 bash scripts/gpu_long_bench.sh || exit 1
  dir="$WORK/qwen05b-32k-fp16"
  for p in ${GPU_LONG_PROMPTS:-8192 30000}; do
    profile "profile-long-$p.txt" "$dir" --context "$p" --steps 10 --top 10
    profile "profile-prefill-$p.txt" "$dir" --width "$p" --context 1 --steps 1 --top 10
  done
fi
