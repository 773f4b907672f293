#!/usr/bin/env bash
# Where the 0.5B graphed decode (M=1) and verify (M=k+1) steps spend their time, kernel by
# kernel: each step timed plainly, then replayed under Nsight Compute (ncu, one metric: the
# kernel's duration) and tabled by scripts/gpu_kernel_times.py (launches and us per step, and
# the share of the step no kernel covers). Builds the models through gpu_llm_bench.sh (carry
# .whl). Logs and tables go to $OUT. One device call:
#   bash scripts/gpu_kernel_profile.sh   (KT_PRECISIONS, default "fp16 int4"; KT_SLOTS, default
#                                          "primary verify"; KT_STEPS, default 5)
set -uo pipefail
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
WORK="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}"
STEPS="${KT_STEPS:-5}"
mkdir -p "$LOGDIR"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
command -v ncu >/dev/null || { echo "no ncu (Nsight Compute) on this machine"; exit 1; }
PRECISIONS="${KT_PRECISIONS:-fp16 int4}"
GPU_BENCH_PRECISIONS="$PRECISIONS" GPU_BENCH_BUILD_ONLY=1 bash scripts/gpu_llm_bench.sh || exit 1
for prec in $PRECISIONS; do
  dir="$WORK/qwen05b-$prec"
  [ -f "$dir/genai_config.json" ] || { echo "no $prec build in $dir"; continue; }
  for slot in ${KT_SLOTS:-primary verify}; do
    tag="$prec-$slot"
    "$PY" scripts/gpu_kernel_times.py run "$dir" --slot "$slot" --steps 1 | tee "$LOGDIR/wall-$tag.txt"
    wall=$(grep -o '[0-9.]* ms a step' "$LOGDIR/wall-$tag.txt" | cut -d' ' -f1)
    ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none \
      --metrics gpu__time_duration.sum --csv --log-file "$LOGDIR/ncu-$tag.csv" \
      "$PY" scripts/gpu_kernel_times.py run "$dir" --slot "$slot" --steps "$STEPS" \
      >"$LOGDIR/ncu-$tag.out" 2>&1 || { echo "ncu $tag failed"; tail -n 20 "$LOGDIR/ncu-$tag.out"; continue; }
    echo "== $tag"
    "$PY" scripts/gpu_kernel_times.py table "$LOGDIR/ncu-$tag.csv" --steps "$STEPS" \
      ${wall:+--wall-ms "$wall"} | tee "$LOGDIR/kernels-$tag.txt"
  done
done
