"""Provider options: keyword argument, else environment variable, else default; unknown
names and wrong types are refused with the option named."""

from __future__ import annotations

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.provider import ProviderOption, resolve_options
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

from ..models import mlp


def test_an_option_comes_from_the_argument_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.delenv("ONNX_GENRT_NBITS_CACHE", raising=False)
    assert CPUProvider().option("nbits_cache") is False
    monkeypatch.setenv("ONNX_GENRT_NBITS_CACHE", "1")
    assert CPUProvider().option("nbits_cache") is True
    assert CPUProvider(nbits_cache=False).option("nbits_cache") is False
    monkeypatch.delenv("ONNX_GENRT_INT4_VNNI", raising=False)
    monkeypatch.delenv("ONNX_GENRT_NATIVE_REPLAY", raising=False)
    assert CPUProvider().options == {
        "skinny_matmul": True,
        "blas_threads": 1,
        "native_replay": True,
        "nbits_cache": True,
        "int4_vnni": True,
    }


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(
        InvalidInputError,
        match=r"provider 'cpu' has no option 'skinny' \(its options: blas_threads, "
        r"int4_vnni, native_replay, nbits_cache, skinny_matmul\)",
    ):
        InferenceSession(mlp(hidden=4), providers=[("cpu", {"skinny": False})])


def test_a_wrong_type_or_a_bad_environment_value_is_refused(monkeypatch):
    with pytest.raises(InvalidInputError, match="option 'skinny_matmul' must be a bool, got 'no'"):
        CPUProvider(skinny_matmul="no")
    monkeypatch.setenv("ONNX_GENRT_SKINNY_MATMUL", "maybe")
    with pytest.raises(
        InvalidInputError, match=r"ONNX_GENRT_SKINNY_MATMUL='maybe': expected 0 or 1"
    ):
        CPUProvider()


def test_numeric_options_take_their_type():
    declared = (ProviderOption("tiles", 4, "tiles a row"), ProviderOption("scale", 0.5, "x"))
    assert resolve_options("p", declared, {"tiles": 8, "scale": 2}) == {"tiles": 8, "scale": 2.0}
    with pytest.raises(InvalidInputError, match="option 'tiles' must be a int, got True"):
        resolve_options("p", declared, {"tiles": True})


_CUDA_OPTIONS = r"""
import json
from onnx_genrt.providers.cuda.provider import CUDAProvider
print(json.dumps([[o.name, o.default, o.env] for o in CUDAProvider.OPTIONS]))
"""


def _readme_rows() -> dict[tuple[str, str], str]:
    """The README's "Provider options" table: (provider, option) -> its default cell."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = text.split("## Provider options", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`"):
            rows[cells[0], cells[1].strip("`")] = cells[2]
    return rows


def test_every_option_is_in_the_readme_table_with_its_default_and_variable():
    """Each declared option of the CPU and CUDA providers (the CUDA provider's read with
    CuPy stubbed) has a README row naming its default and environment variable."""
    from tests.cuda_stub import run_with_cupy_stub

    rows = _readme_rows()
    declared = [("cpu", o.name, o.default, o.env) for o in CPUProvider.OPTIONS]
    declared += [("cuda", *o) for o in run_with_cupy_stub(_CUDA_OPTIONS)]
    assert any(name == "cublas_in_graphs" for _, name, _, _ in declared)
    for provider, name, default, env in declared:
        cell = rows.get((provider, name))
        assert cell is not None, f"README.md has no row for {provider} option {name!r}"
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert cell.startswith(shown) or cell.startswith(f'`"{default}"`'), (name, cell)
        if env:
            assert f"(`{env}`)" in cell, (name, cell)
