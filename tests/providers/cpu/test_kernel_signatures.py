"""First-run compilation: the kernels a generation calls compile for one signature each.

A read-only array (an initializer mapped from the model file) is another Numba type than
the writable arrays a native call builds, and a literal argument is another type than an
int64: each extra signature of a kernel costs seconds of first-run compilation. A process
generating with the embedded model (speculation included) must leave every CPU kernel
dispatcher with at most one signature, none of them with a read-only array."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json
from numba.core.registry import CPUDispatcher
from onnx_genrt.engine import Model, generate
from onnx_genrt.models import default_model_path

model = Model(default_model_path())
generate(model, "    def __init__(self", 24, spec="mtp")
generate(model, ["def f(x):", "import os"], 8)
found = {}
for obj in gc.get_objects():
    try:
        if not isinstance(obj, CPUDispatcher):
            continue
        module = obj.py_func.__module__ or ""
    except ReferenceError:
        continue
    if ".providers.cpu." in module and obj.signatures:
        found[f"{module}.{obj.py_func.__name__}"] = [str(s) for s in obj.signatures]
print(json.dumps(found))
"""


def test_each_kernel_compiles_one_writable_signature():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=False, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("rms_norm_rows" in name for name in found), sorted(found)
    twice = {name: sigs for name, sigs in found.items() if len(sigs) > 1}
    assert not twice, twice
    readonly = {n: s for n, s in found.items() if any(", True, aligned" in x for x in s)}
    assert not readonly, readonly
