#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels the GPU machine (no network, Python 3.12)
# needs, into folders git ignores that the device tool carries:
#   .whl/        onnxruntime-genai (its model builder: the lane's builder models), and
#                pytest-xdist with execnet (the lane's tests in several processes)
#   .whl_serve/  the serve stack and the openai client (scripts/serve_bench.sh on the GPU)
# Install them there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_serve/*.whl
#   export PYTHONPATH=/tmp/site
# Usage: bash scripts/fetch_gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
fetch() {  # fetch DIR REQUIREMENT...
  local dir=$1
  shift
  python3 -m pip download -q --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}
# the version pyproject.toml's test extras pin
genai=$(grep -o '"onnxruntime-genai==[^"]*"' pyproject.toml | tr -d '"')
fetch .whl --no-deps "$genai"
fetch .whl --no-deps "pytest-xdist>=3.5" "execnet>=2.1"
fetch .whl_serve "starlette>=0.40" "uvicorn>=0.30" "openai>=1.40" "httpx>=0.27"
ls .whl .whl_serve
