#!/usr/bin/env bash
# GPU lane: run from the repository root on the GPU machine (no network there).
#   bash scripts/gpu_lane.sh [tests] [kit] [bench]
# Installs the project without fetching anything, runs the GPU tests with the GPU required,
# runs the provider test kit on CUDA, lists providers, runs the dispatch and LLM benches and
# prints a summary. Logs go to $OUT when set. With no argument all parts run; `tests`, `kit`
# (`onnx-genrt check-provider cuda`) or `bench` runs one (each fits a 10-minute call).
# GPU_LANE_PYTEST_ARGS overrides the extra pytest arguments (default: -x); GPU_LANE_WORKERS the
# number of pytest-xdist processes where its wheels are carried in .whl/ (default 8, 0: one);
# GPU_LANE_TESTS the test paths (default "tests/providers/cuda tests/ops"), e.g. one file for
# a short first check.
set -euo pipefail

PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/gpu_lane}"
mkdir -p "$LOGDIR"
LOG="$LOGDIR/gpu_lane.log"
PARTS="${*:-tests kit bench}"
for part in $PARTS; do
  case "$part" in
    tests | kit | bench) ;;
    *) echo "gpu_lane.sh: unknown part '$part' (expected: tests, kit, bench)" >&2; exit 2 ;;
  esac
done
has_part() { [[ " $PARTS " == *" $1 "* ]]; }

main() {
  echo "== machine"
  nvidia-smi -L || echo "nvidia-smi failed"
  "$PY" -V
  "$PY" - <<'EOF' || echo "CuPy does not import or sees no GPU"
import cupy, numpy
rt = cupy.cuda.runtime
print(f"cupy {cupy.__version__}, numpy {numpy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, "
      f"driver {rt.driverGetVersion()}, devices {rt.getDeviceCount()}")
props = rt.getDeviceProperties(0)
print(f"device 0: {props['name'].decode()}, {props['multiProcessorCount']} SMs")
EOF
  "$PY" -c "import setuptools, pip; print('setuptools', setuptools.__version__, 'pip', pip.__version__)" \
    || echo "setuptools missing: the install below will fail"
  if "$PY" -c "import numba; print('numba', numba.__version__)"; then
    NUMBA="imports"
  else
    NUMBA="does NOT import (CPU provider unusable here)"
  fi

  echo "== install (no network, no build isolation)"
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . ; then
    echo "editable install failed; installing a regular copy"
    "$PY" -m pip install -q --no-deps --no-build-isolation .
  fi
  CLI=(onnx-genrt)
  command -v onnx-genrt >/dev/null || CLI=("$PY" -m onnx_genrt)
  if "$PY" -c "import onnx_genrt.providers.cpu.provider" 2>"$LOGDIR/cpu_import.txt"; then
    CPU_PROVIDER="imports"
  else
    CPU_PROVIDER="does NOT import: $(tail -n 1 "$LOGDIR/cpu_import.txt")"
  fi

  TESTS_RC=0
  KIT_RC=0
  if has_part tests; then run_tests; fi
  if has_part kit; then run_kit; fi
  if has_part bench; then run_benches; fi
  summary
  return $((TESTS_RC != 0 || KIT_RC != 0))
}

run_tests() {
  echo "== GPU test fixtures (tiny builder models and their CPU reference results)"
  if [ -f .gpu_fixtures/qwen2-int4/reference.npz ] && [ -f .gpu_fixtures/qwen2-fp32/reference.npz ] \
    && [ -f .gpu_fixtures/qwen2-bf16/reference.npz ]; then
    echo "carried: .gpu_fixtures"
  else
    local site="${GPU_BENCH_DIR:-/tmp/onnx_genrt_bench}/site" whl
    whl=$(ls .whl/onnxruntime_genai-*.whl 2>/dev/null | head -n 1) || true
    if [ -z "$whl" ]; then
      echo "no onnxruntime-genai wheel in .whl/ and no .gpu_fixtures: the whole-model tests skip"
    elif "$PY" -m pip install -q --no-index --no-deps --target "$site" "$whl" \
      && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PY" tests/providers/cuda/test_cuda_llm_kernels.py --build; then
      echo "built: .gpu_fixtures"
    else
      echo "building .gpu_fixtures failed: the whole-model tests skip"
    fi
  fi

  # pytest-xdist where its wheels are carried (.whl/, scripts/fetch_gpu_wheels.sh): the tests
  # in GPU_LANE_WORKERS processes (default 8) sharing the GPU, a few minutes instead of ten.
  local workers=()
  if [ "${GPU_LANE_WORKERS:-8}" != 0 ] && ls .whl/pytest_xdist-*.whl .whl/execnet-*.whl >/dev/null 2>&1 \
    && "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu_lane_xdist \
      .whl/pytest_xdist-*.whl .whl/execnet-*.whl; then
    export PYTHONPATH="/tmp/gpu_lane_xdist${PYTHONPATH:+:$PYTHONPATH}"
    workers=(-n "${GPU_LANE_WORKERS:-8}")
  fi
  echo "== GPU tests (${workers[*]:-one process})"
  set +e
  # Every test marked gpu: the CUDA provider's own tests, then the op tests' cuda
  # parametrization (tests/ops, one test on every provider), after them so that -x stops there
  # only once the CUDA provider's tests have run.
  # shellcheck disable=SC2086
  ONNX_GENRT_REQUIRE_GPU=1 "$PY" -m pytest -q -m gpu ${GPU_LANE_TESTS:-tests/providers/cuda tests/ops} \
    "${workers[@]}" ${GPU_LANE_PYTEST_ARGS--x} -rA \
    --junitxml="$LOGDIR/gpu_tests.xml"
  TESTS_RC=$?
  set -e
}

run_kit() {
  echo "== provider test kit (onnx-genrt check-provider cuda)"
  set +e
  "${CLI[@]}" check-provider cuda 2>&1 | tee "$LOGDIR/check_provider.txt"
  KIT_RC=${PIPESTATUS[0]}
  set -e
}

run_benches() {
  echo "== providers"
  "${CLI[@]}" providers || echo "onnx-genrt providers failed"

  echo "== dispatch bench (eager vs replay per node)"
  BENCH=(bench)
  if "${CLI[@]}" bench --help 2>/dev/null | grep -q -- "--dispatch"; then
    BENCH=(bench --dispatch)
  fi
  : >"$LOGDIR/bench.txt"
  if ! "${CLI[@]}" "${BENCH[@]}" --provider cuda --provider cpu | tee "$LOGDIR/bench.txt"; then
    echo "bench with cpu failed; cuda alone:"
    "${CLI[@]}" "${BENCH[@]}" --provider cuda | tee "$LOGDIR/bench.txt" || echo "cuda bench failed"
  fi

  echo "== LLM bench (Qwen2.5-0.5B shape, random weights)"
  bash scripts/gpu_llm_bench.sh || echo "LLM bench failed"
}

summary() {
  echo "== summary ($PARTS)"
  echo "numba: $NUMBA; CPU provider: $CPU_PROVIDER"
  if has_part tests; then summarize_tests; fi
  if has_part kit; then echo "kit: $(tail -n 1 "$LOGDIR/check_provider.txt") (exit $KIT_RC)"; fi
  if has_part bench; then summarize_benches; fi
}

summarize_tests() {
  "$PY" - "$LOGDIR/gpu_tests.xml" <<'EOF' || echo "tests: no junit report"
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"tests: {passed} passed, {tot['failures']} failed, {tot['errors']} errors, {tot['skipped']} skipped")
for case in root.iter("testcase"):
    for bad in list(case):
        if bad.tag in ("failure", "error"):
            msg = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
            print(f"  {bad.tag.upper()}: {case.get('name')}: {msg}")
EOF
  echo "pytest exit code: $TESTS_RC"
}

summarize_benches() {
  echo "dispatch (us per node):"
  sed 's/^/  /' "$LOGDIR/bench.txt"
  for f in "$LOGDIR"/bench-fp16.txt "$LOGDIR"/bench-int4.txt "$LOGDIR"/step-fp16.txt "$LOGDIR"/step-int4.txt "$LOGDIR"/hf_bench.txt "$LOGDIR"/bench-default.txt "$LOGDIR"/step-default.txt "$LOGDIR"/profile-default.txt; do
    [ -f "$f" ] && { echo "$(basename "$f"):"; sed 's/^/  /' "$f"; }
  done
  echo "targets (issues 17 and 19; add gpu_long_bench.sh's long.txt to the same folder for the long rows):"
  "$PY" -m onnx_genrt lane-targets "$LOGDIR" | sed 's/^/  /' || echo "  target table failed"
  return 0
}

main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
