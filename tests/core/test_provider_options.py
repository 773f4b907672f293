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
    assert CPUProvider().options == {"skinny_matmul": True, "blas_threads": 1, "nbits_cache": True}


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(
        InvalidInputError,
        match=r"provider 'cpu' has no option 'skinny' \(its options: blas_threads, nbits_cache, skinny_matmul\)",
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
