"""Each RawKernel a CUDA kernel module (or a helper module such as ``_flash``) launches is
defined in the source it compiles, and each device helper those sources call is defined
there too: checked on the text, with CuPy stubbed in a child process, so a source split
between modules fails here, not only on a GPU (which then says so at the first compile)."""

from __future__ import annotations

from tests.cuda_stub import run_with_cupy_stub

_CHILD = r"""
import importlib, json, pathlib, re
import onnx_genrt.providers.cuda.kernels as pkg
found, problems = 0, []
for path in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
    if path.stem == "__init__":
        continue
    mod = importlib.import_module(f"{pkg.__name__}.{path.stem}")
    text = path.read_text()
    for m in re.finditer(r'function\(\s*(_[A-Z_]+)\s*,\s*f?"([A-Za-z_0-9]+)', text):
        source, kernel = getattr(mod, m.group(1)), m.group(2)
        found += 1
        if not re.search(r"__global__\s+void\s+(__launch_bounds__\([^)]*\)\s+)?" + kernel + r"\(", source):
            problems.append(f"{path.stem}: {kernel} is not in {m.group(1)}")
        called = set(re.findall(r"\b([a-z_0-9]+)\(", source))
        defined = set(re.findall(r"(?:DEVI|__device__[^(;{]*?)\s+[\w:<>, ]*?\b([a-z_0-9]+)\(", source))
        for helper in sorted(called & {"arg_key", "arg_index", "kmax", "block_kmax", "vec_elem", "block_sum", "block_max", "warp_sum", "stage_act"}):
            if helper not in defined:
                problems.append(f"{path.stem}: {m.group(1)} calls {helper} without defining it")
print(json.dumps({"found": found, "problems": sorted(set(problems))}))
"""


def test_cuda_raw_kernels_are_defined_in_the_sources_that_launch_them():
    result = run_with_cupy_stub(_CHILD)
    assert result["found"] >= 10  # the launches were seen at all
    assert result["problems"] == []
