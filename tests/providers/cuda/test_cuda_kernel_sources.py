"""Each RawKernel a CUDA kernel module (or a helper module such as ``_flash``) launches is
defined in the source it compiles, and each device helper those sources call is defined
there too: checked on the text, with CuPy stubbed in a child process, so a source split
between modules fails here, not only on a GPU (which then says so at the first compile)."""

from __future__ import annotations

import json
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


# ----------------------------------------------------------------------------- every source

#: Instances compiled per source (module attribute; contrib_quant's two sources in both NBITS_HALF2
#: forms): every kernel of every source at least once, fp16 / bf16 / fp32 and the fused
#: prologues among them. flash_attn is compiled by the test above.
INSTANCES = {
    "matmul._SOURCE": [
        "skinny_gemm<half_t, 8, 1>",
        "skinny_gemm<float, 4, 4>",
        "skinny_gemm<bf16_t, 8, 2>",
        "gemv_nk<half_t, 1, 1, 0, 0>",
        "gemv_nk<bf16_t, 2, 2, 1, 0>",
        "gemv_nk<float, 4, 1, 2, 0>",
        "gemv_nk<half_t, 16, 1, 0, 0>",
        "gemv_nk<half_t, 1, 2, 1, 1>",
        "gemv_nk<bf16_t, 2, 2, 0, 1>",
        "gemv_nk<float, 8, 2, 1, 1>",
        "splitk_sum<half_t>",
        "splitk_sum<float>",
        "splitk_sum_gated<bf16_t>",
    ],
    "matmul._MMA_SOURCE": [
        "gemm_mma<half_t, 1, 0, 0, 0>",
        "gemm_mma<bf16_t, 4, 0, 0, 0>",
        "gemm_mma<half_t, 2, 1, 0, 0>",
        "gemm_mma<half_t, 1, 0, 1, 1>",
        "gemm_mma<bf16_t, 1, 1, 1, 16>",
        "gemm_mma<half_t, 1, 0, 2, 2>",
    ],
    "contrib_quant._BODY": [
        "nbits_gemv<half_t, half_t, 1, 4, 1>",
        "nbits_gemv<float, float, 2, 8, 2>",
        "nbits_gemv_stream<half_t, half_t, 1, 4, 2>",
        "nbits_gemv_stream<bf16_t, float, 4, 2, 1>",
        "nbits4_gemv16<half_t, half_t, 1, 1, 0, 0>",
        "nbits4_gemv16<half_t, half_t, 2, 2, 1, 0>",
        "nbits4_gemv16<bf16_t, bf16_t, 1, 1, 2, 0>",
        "nbits4_gemv16<float, float, 4, 1, 0, 0>",
        "nbits4_gemv16<half_t, half_t, 1, 2, 1, 1>",
        "nbits4_gemv16<float, float, 8, 2, 0, 1>",
        "nbits4_gemv16_small_k<half_t, half_t, 1, 4, 4, 0, 0>",
        "nbits4_gemv16_small_k<half_t, half_t, 2, 8, 2, 1, 0>",
        "nbits4_gemv16_small_k<bf16_t, bf16_t, 1, 2, 8, 2, 0>",
        "nbits4_gemv16_small_k<half_t, half_t, 1, 8, 4, 1, 1>",
        "nbits4_gemv16_small_k<float, float, 4, 16, 2, 0, 1>",
        "nbits_dequant<half_t, half_t, 4>",
        "gather_block_quant<long long, float, 4>",
    ],
    "contrib_quant._MMA4_SOURCE": [
        "gemm_mma_nbits4<half_t, half_t, 1, 0, 0, 0>",
        "gemm_mma_nbits4<bf16_t, bf16_t, 4, 0, 0, 0>",
        "gemm_mma_nbits4<half_t, half_t, 2, 1, 0, 0>",
        "gemm_mma_nbits4<half_t, half_t, 1, 1, 1, 2>",
        "gemm_mma_nbits4<half_t, half_t, 1, 0, 2, 1>",
    ],
    "reduce._SOURCE": [
        "reduce_sum_split<float, float, 4>",
        "reduce_sum_split<half_t, float, 8>",
        "reduce_sum_split<long long, long long, 1>",
    ],
    "reduce._ARGMAX_SOURCE": [
        "argmax_split<half_t, 8, false>",
        "argmax_split<float, 1, false>",
        "argmax_split<half_t, 8, true>",
        "argmax_split<bf16_t, 1, true>",
    ],
    "shape_ops._CONCAT_SOURCE": ["concat_parts<unsigned short>", "concat_parts<unsigned int>"],
    "contrib_attention._SOURCE": [
        "gqa_append<half_t, half_t>",
        "gqa_attn<half_t, half_t, 1, 4, 8>",
        "gqa_attn<float, float, 2, 4, 8>",
        "gqa_attn<bf16_t, float, 4, 4, 8>",
        "gqa_attn_cluster<half_t, half_t, 1, 4, 8>",
        "gqa_window_store<float, float>",
        "rotary_rows<half_t, float>",
    ],
    "_gqa_decode._SOURCE": [
        "gqa_decode<half_t, half_t, 64, 7, 4, 1, 2>",
        "gqa_decode<float, float, 64, 4, 4, 1, 2>",
        "gqa_decode<half_t, half_t, 64, 7, 4, 2, 1>",
        "gqa_decode<half_t, half_t, 64, 7, 4, 4, 1>",
        "gqa_decode_cluster<half_t, half_t, 64, 7, 4, 1, 2>",
        "gqa_decode_cluster<half_t, half_t, 64, 7, 4, 2, 1>",
        "gqa_decode_cluster<bf16_t, float, 128, 6, 4, 2, 1>",
        "gqa_decode_cluster<float, float, 64, 8, 4, 1, 2>",
        "gqa_decode_cluster<float, float, 64, 8, 4, 2, 1>",
        "gqa_decode_cluster<bf16_t, bf16_t, 64, 6, 4, 4, 1>",
    ],
    "normalization._SOURCE": [
        "rms_norm_rows<half_t, half_t>",
        "layer_norm_rows<float, float>",
        "rms_rows_staged<bf16_t>",
        "rms_rows_staged<float>",
    ],
    "contrib_norm._SOURCE": ["skip_norm_rows<half_t, half_t>", "skip_rms_rows_reg<bf16_t, bf16_t>"],
    "softmax._SOURCE": ["softmax_rows<half_t>"],
    "genrt._SOURCE": ["mtp_accept<half_t, float>", "mtp_next_inputs"],
    "genrt._SAMPLE_SOURCE": ["sample_tokens_rows<half_t>", "sample_tokens_rows<float>"],
    "_gated_mlp._SOURCE": [
        "norm_gated_mlp<half_t, 1>",
        "norm_gated_mlp<half_t, 4>",
        "norm_gated_mlp<bf16_t, 8>",
    ],
}
#: Sources whose kernels prefetch weights into L2 on sm_90 whether or not PDL is on (a
#: phase's weights while the phase before it streams its own).
L2_PREFETCHING = ("_gated_mlp._SOURCE",)
#: Kernels that exist on sm_90 and newer only (their sources guard them).
SM90_ONLY = ("gqa_attn_cluster", "gqa_decode_cluster")

_DUMP_SOURCES = r"""
import importlib, json, sys
from onnx_genrt.providers.cuda.kernel_source import kernels
instances = json.loads(sys.argv[1])
out, found = {}, {}
for key in instances:
    module, attr = key.split(".")
    text = getattr(importlib.import_module("onnx_genrt.providers.cuda.kernels." + module), attr)
    out[key] = text
    found[key] = sorted(kernels(text))
print(json.dumps({"sources": out, "kernels": found}))
"""


def test_every_kernel_has_an_instance_to_compile():
    """A kernel added to a source is compiled by the test below once it is listed here."""
    got = run_with_cupy_stub(_DUMP_SOURCES, json.dumps(INSTANCES))
    for key, names in got["kernels"].items():
        listed = {n.split("<")[0] for n in INSTANCES[key]}
        assert listed == set(names), key


def _instantiating(source: str, names: list[str]) -> str:
    lines = []
    for i, name in enumerate(names):
        line = f"  auto k{i} = &{name}; (void)k{i};"
        if name.split("<")[0] in SM90_ONLY:
            line = f"#if __CUDA_ARCH__ >= 900\n{line}\n#endif"
        lines.append(line)
    return source + "\nvoid instantiate() {\n" + "\n".join(lines) + "\n}\n"


#: Instances that spill to local memory without PDL too (mangled-name pieces), per
#: architecture: the attention kernels (their launch bounds cap them at 64 registers), a bf16
#: SiluMul-fused GEMV and, on sm_90 with NBITS_HALF2 0, a norm-fused small-K GEMV of two rows;
#: on sm_80 the unfused fp16 chunk16 GEMV of one row. The one-tile fp16 tensor-core GEMMs
#: that stage a norm of one row or a SiLU gating of two spill 4-20 bytes since their warps
#: load two chunks' weights ahead (``mma_tiles``): ptxas keeps them near 40 registers
#: (``__launch_bounds__(256, 1)`` would take 60 there). On sm_90 the grouped decode kernels of
#: four head groups (``attention_decode_head_groups`` 4, 512 threads, 128 registers) spill
#: for groups of 7 or 6 heads (12 bytes for the fp16 group of 7).
KNOWN_SPILLS = {
    "sm_90": (
        "10gqa_decodeIttLi64ELi7ELi4ELi4ELi1E",
        "18gqa_decode_clusterI6bf16_tS0_Li64ELi6ELi4ELi4ELi1E",
        "8gqa_attnI",
        "16gqa_attn_clusterI",
        "13nbits4_gemv16I6bf16_tS0_Li1ELi1ELi2E",
        "21nbits4_gemv16_small_kIttLi2ELi8ELi2ELi1E",
        "8gemm_mmaItLi1ELi0ELi1ELi1E",
        "8gemm_mmaItLi1ELi0ELi2ELi2E",
    ),
    "sm_80": (
        "8gqa_attnI",
        "13nbits4_gemv16I6bf16_tS0_Li1ELi1ELi2E",
        "13nbits4_gemv16IttLi1ELi1ELi0E",
        "8gemm_mmaItLi1ELi0ELi2ELi2E",
    ),
}
#: The ways the provider compiles a source (``launch.compile_defines``).
PDL = ("-DGENRT_PDL=1", "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=1")
PDL_NO_PREFETCH = ("-DGENRT_PDL=1", "-DGENRT_PDL_PREFETCH=0", "-DGENRT_PDL_EARLY=0")
PDL_EARLY = ("-DGENRT_PDL=1", "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=2")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "defines"),
    [
        ("sm_90", PDL),
        ("sm_90", PDL_NO_PREFETCH),
        ("sm_90", PDL_EARLY),
        ("sm_90", ()),
        ("sm_80", PDL),
    ],
    ids=["sm90-pdl", "sm90-pdl-no-prefetch", "sm90-pdl-early", "sm90-plain", "sm80-pdl"],
)
def test_every_kernel_source_compiles(tmp_path, arch, defines):
    """Every source the provider compiles, through nvcc (where installed) as NVRTC builds it
    at run time (C++17, one architecture, the PDL defines of a programmatic stream or none):
    it compiles, no kernel spills that does not spill on main, and the PTX has
    griddepcontrol.wait in every kernel and the L2 prefetches exactly where they are asked
    for (sm_90 with GENRT_PDL; GENRT_PDL_PREFETCH), the next grid's launch right after the
    wait (GENRT_PDL_EARLY: 1 in the decode attention kernels and the 4-bit GEMVs, 2 in every
    kernel), nothing of
    PDL elsewhere."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    got = run_with_cupy_stub(_DUMP_SOURCES, json.dumps(INSTANCES))
    pdl = arch == "sm_90" and bool(defines)
    prefetch = pdl and "-DGENRT_PDL_PREFETCH=1" in defines
    early = pdl and "-DGENRT_PDL_EARLY=2" in defines
    attention_early = pdl and "-DGENRT_PDL_EARLY=1" in defines
    for key, names in INSTANCES.items():
        variants = [got["sources"][key]]
        if key in ("contrib_quant._BODY", "contrib_quant._MMA4_SOURCE"):  # NBITS_HALF2 on, off
            variants = [f"#define NBITS_HALF2 {h}\n" + variants[0] for h in (1, 0)]
        for v, text in enumerate(variants):
            path = tmp_path / f"{key.replace('.', '_')}_{v}.cu"
            path.write_text(_instantiating(text, names))
            done = subprocess.run(
                [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", *defines, "-Xptxas", "-v",
                 "-keep", "-keep-dir", str(tmp_path), "-diag-suppress", "550,177", str(path),
                 "-o", str(path.with_suffix(".cubin"))],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            assert done.returncode == 0, f"{path.name}: {done.stderr[-3000:]}"
            spills = re.findall(
                r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill "
                r"stores, (\d+) bytes spill loads",
                done.stderr,
            )
            assert spills, done.stderr[-2000:]
            new = [f for f, st, ld in spills if (st, ld) != ("0", "0")]
            assert not [f for f in new if not any(k in f for k in KNOWN_SPILLS[arch])], new
            ptx = path.with_suffix(".ptx").read_text()
            entries = re.split(r"\.entry\s+", ptx)[1:]
            guarded = sum(n.split("<")[0] in SM90_ONLY for n in names)  # absent below sm_90
            assert len(entries) >= len(names) - guarded * (arch != "sm_90"), path.name
            for entry in entries:
                name = entry.split("(", 1)[0]
                assert ("griddepcontrol.wait" in entry) == pdl, (path.name, name)
                if attention_early and ("gqa_decode" in name or "nbits4_gemv16" in name):
                    assert "griddepcontrol.launch_dependents" in entry, (path.name, name)
                if early:  # the trigger right after the wait, in the same asm statement
                    assert re.search(
                        r"griddepcontrol\.wait;\s*griddepcontrol\.launch_dependents;", entry
                    ), (path.name, name)
            assert ("cp.async.bulk.prefetch" in ptx or "prefetch.global.L2" in ptx) == (
                prefetch
                and any(k in key for k in ("matmul", "contrib_quant"))
                or (key in L2_PREFETCHING and arch == "sm_90")
            ), path.name
