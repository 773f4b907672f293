"""The CLI says so when Numba compiles (a first run), once, and stays quiet on cache hits."""

from __future__ import annotations

import io

import numba
import numpy as np

from onnx_genrt.compile_notice import install


def test_the_first_compilation_prints_one_notice_and_later_ones_none():
    stream = io.StringIO()

    @numba.njit(cache=False)
    def twice(x):
        return x * 2

    @numba.njit(cache=False)
    def thrice(x):
        return x * 3

    with install(stream) as notice:
        assert not notice.told
        assert twice(np.arange(3)).tolist() == [0, 2, 4]  # compiles
        assert thrice(np.arange(3)).tolist() == [0, 3, 6]  # compiles again: no second line
    assert notice.told
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "compiling CPU kernels with Numba" in lines[0]


def test_no_compilation_or_a_closed_notice_prints_nothing():
    @numba.njit(cache=False)
    def plus_one(x):
        return x + 1

    plus_one(np.arange(2))  # compiled before the notice is installed
    stream = io.StringIO()
    with install(stream) as notice:
        plus_one(np.arange(2))
    assert not notice.told

    @numba.njit(cache=False)
    def plus_two(x):
        return x + 2

    plus_two(np.arange(2))  # compiles after the notice was closed: still silent
    assert not notice.told and stream.getvalue() == ""
