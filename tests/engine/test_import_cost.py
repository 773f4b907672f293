"""What importing the engine loads, checked in fresh processes (no timed asserts).

Importing ``onnx_genrt.engine`` must not import onnx (which imports ml_dtypes, about half a
second), numba, tokenizers, pluggy, asyncio or a provider: a model load imports onnx and the
provider it resolves, a tokenizer is loaded on first use. The figures are in
docs/performance.md ("CPU memory and import").
"""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.genrt_ops import AttrKind
from onnx_genrt.models import default_model_path

#: Modules the engine's import must leave unloaded.
HEAVY = (
    "onnx",
    "ml_dtypes",
    "numba",
    "tokenizers",
    "pluggy",
    "asyncio",
    "google.protobuf",
    "onnx_genrt.providers",
)


def _loaded_after(code: str) -> dict[str, bool]:
    """Which of HEAVY are in sys.modules after ``code`` runs in a fresh interpreter."""
    probe = (
        f"import sys, json\n{code}\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import onnx_genrt.engine",
        "from onnx_genrt.engine import *",
        "import onnx_genrt.session",
        "import onnx_genrt.engine.scheduler, onnx_genrt.engine.mtp_chain",
    ],
)
def test_importing_the_engine_loads_nothing_heavy(code: str) -> None:
    loaded = _loaded_after(code)
    assert not any(loaded.values()), {m for m, yes in loaded.items() if yes}


def test_loading_a_model_imports_what_it_needs_and_runs() -> None:
    """The probe can see those modules: a model load brings onnx and the CPU provider's
    kernels (registered through the registry as before), a prompt the tokenizer."""
    loaded = _loaded_after(
        "from onnx_genrt.engine import Model, generate\n"
        f"model = Model({str(default_model_path())!r})\n"
        "assert generate(model, 'def f(', max_new_tokens=2).new_tokens == 2"
    )
    for name in ("onnx", "ml_dtypes", "tokenizers", "onnx_genrt.providers", "numba"):
        assert loaded[name], name


def test_type_codes_written_as_integers_are_onnx_codes() -> None:
    """DType and AttrKind spell ONNX's codes as integers so that they need no onnx import."""
    for dtype in DType:
        name = {"FLOAT32": "FLOAT", "FLOAT64": "DOUBLE"}.get(dtype.name, dtype.name)
        assert dtype.value == getattr(onnx.TensorProto, name), dtype
    for kind in AttrKind:
        assert kind.value == getattr(onnx.AttributeProto, kind.name), kind
