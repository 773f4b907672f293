#!/usr/bin/env python3
"""Write the bundled demo model, ``onnx_genrt/models/demo_decoder.onnx``, from
``onnx_genrt.demo.build_demo_model`` (fixed seed; ``tests/cli/test_demo.py`` checks that the
file in the repository is what the builder makes).

    python scripts/build_demo_model.py
"""

from __future__ import annotations

from pathlib import Path

import onnx

from onnx_genrt.demo import MODEL_FILE, build_demo_model

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    out = REPO / "onnx_genrt" / "models" / MODEL_FILE
    onnx.save_model(build_demo_model(), str(out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
