"""Each RawKernel a CUDA kernel module (or a helper module such as ``_flash``) launches is
defined in the source it compiles, and each device helper those sources call is defined
there too: checked on the text, with CuPy stubbed in a child process, so a source split
between modules fails here, not only on a GPU (which then says so at the first compile)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

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


_FLASH_DUMP = r"""
import json, sys
import onnx_genrt.providers.cuda.kernels._flash as flash
names = []
for s in ("half_t", "bf16_t"):
    for c in ("float", s):
        for d in flash.HEAD_SIZES:
            names.append(f"flash_attn<{flash.flash_template_args(s, c, d)}>")
body = "".join(f"  auto k{i} = &{n}; (void)k{i};\n" for i, n in enumerate(names))
open(sys.argv[1], "w").write(flash._SOURCE + "\nvoid instantiate() {\n" + body + "}\n")
print(json.dumps(names))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_flash_kernel_compiles_without_spills(tmp_path, arch):
    """The flash-attention source, every instance the provider launches, through nvcc
    (where it is installed): it compiles, and ptxas keeps every accumulator in registers."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    source = tmp_path / "flash.cu"
    names = run_with_cupy_stub(_FLASH_DUMP, str(source))
    done = subprocess.run(
        [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-diag-suppress",
         "550", str(source), "-o", str(tmp_path / "flash.cubin")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert len(spills) == len(names) == 8
    assert all(s == ("0", "0") for s in spills), done.stderr
