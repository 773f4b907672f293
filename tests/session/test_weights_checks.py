"""External data mapped into memory (``session.weights``), found by a mutation run to have no
test of: one-byte element types, an empty tensor in a file of its own, and the pages
``release_pages`` drops (none for an array of no file or under a page, only whole pages
inside the array otherwise). Values are checked against onnxruntime on the same files."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.session import InferenceSession
from onnx_genrt.session.weights import MappedFiles, mapped_buffer, release_pages


def _external(array: np.ndarray, name: str, location: str, offset: int = 0):
    """An initializer whose bytes are at ``offset`` of ``location``."""
    tensor = numpy_helper.from_array(array, name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", array.nbytes)):
        tensor.external_data.add(key=key, value=str(value))
    return tensor


def _identity_model(folder: Path, arrays: dict[str, np.ndarray]) -> Path:
    """A model returning each array (an initializer in a file of its own) through Identity."""
    inits = []
    for name, array in arrays.items():
        (folder / f"{name}.bin").write_bytes(array.tobytes())
        inits.append(_external(array, name, f"{name}.bin"))
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in arrays],
        "weights",
        [],
        [
            helper.make_tensor_value_info(
                f"{n}_out", helper.np_dtype_to_tensor_dtype(a.dtype), None
            )
            for n, a in arrays.items()
        ],
        inits,
    )
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_one_byte_element_types_are_mapped(tmp_path):
    arrays = {
        "u8": np.arange(40, dtype=np.uint8).reshape(5, 8),
        "i8": np.arange(-20, 20, dtype=np.int8),
        "flags": np.arange(9) % 2 == 0,
        "one": np.array([7], np.uint8),  # a tensor of one byte
    }
    path = _identity_model(tmp_path, arrays)
    sess = InferenceSession(path)
    for name in arrays:
        assert mapped_buffer(sess.plan.constants[name]) is not None, name
    want = ort.InferenceSession(str(path)).run(None, {})
    for got, ref, array in zip(sess.run(None, {}), want, arrays.values(), strict=True):
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got, array)


def test_an_empty_tensor_in_an_empty_file_loads(tmp_path):
    """Nothing to map (an empty file cannot be mapped at all): read as the empty array."""
    path = _identity_model(tmp_path, {"none": np.zeros((0, 4), np.float32)})
    assert (tmp_path / "none.bin").stat().st_size == 0
    (got,) = InferenceSession(path).run(None, {})
    (want,) = ort.InferenceSession(str(path)).run(None, {})
    assert got.shape == want.shape == (0, 4) and got.dtype == want.dtype


@pytest.fixture
def pages(tmp_path) -> Path:
    """A file of four pages and a half, each byte its offset modulo 251."""
    path = tmp_path / "pages.bin"
    path.write_bytes((np.arange(int(4.5 * mmap.PAGESIZE)) % 251).astype(np.uint8).tobytes())
    return path


@pytest.mark.parametrize(
    ("offset", "length", "released"),
    [
        (0, 4 * mmap.PAGESIZE, 4 * mmap.PAGESIZE),  # four whole pages
        (100, 2 * mmap.PAGESIZE, mmap.PAGESIZE),  # only the one page wholly inside
        (mmap.PAGESIZE, mmap.PAGESIZE, mmap.PAGESIZE),  # exactly one page
        (10, mmap.PAGESIZE - 20, 0),  # under a page: its neighbours' bytes too
        (mmap.PAGESIZE + 8, mmap.PAGESIZE, 0),  # a page's length across two pages
    ],
)
def test_release_pages_drops_only_whole_pages_inside_the_array(pages, offset, length, released):
    files = MappedFiles()
    array = files.view(pages, offset, length, np.dtype(np.uint8), (length,))
    assert array is not None and mapped_buffer(array) is not None
    assert release_pages(array) == released
    want = (np.arange(offset, offset + length) % 251).astype(np.uint8)
    np.testing.assert_array_equal(array, want)  # still readable: pages fault in again


def test_release_pages_of_arrays_that_map_nothing_releases_nothing(pages):
    assert release_pages(np.zeros(4 * mmap.PAGESIZE, np.uint8)) == 0
    empty = MappedFiles().view(pages, 0, 0, np.dtype(np.uint8), (0,))
    assert empty is None  # nothing to map: the caller reads the empty tensor
    mapped = MappedFiles().view(
        pages, 0, 4 * mmap.PAGESIZE, np.dtype(np.uint8), (4 * mmap.PAGESIZE,)
    )
    assert release_pages(mapped[:0]) == 0
