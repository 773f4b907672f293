"""A session holds each weight once, in the layout its kernels read.

External data is mapped from its file (``session.weights``), not copied into the proto;
shape inference sees no weight bytes; a weight prepacked for its kernel (a transposed
float MatMul weight, 4-bit tiles) is not also kept as it was; the proto's bytes are dropped
once the plan holds the weights. Memory is measured in fresh processes (VmRSS / VmHWM, no
timings) against the weights file's size; results against float64 numpy and onnxruntime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.session import InferenceSession, load_model
from onnx_genrt.session.constant_cache import ReleasedConstant
from onnx_genrt.session.plan import _infer_value_types, _value_spec
from onnx_genrt.session.weights import mapped_buffer

LAYERS = 8
MS = "com.microsoft"


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    """``model.onnx`` with every tensor in ``model.onnx.data``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    return folder


def _projections(kind: str, n: int, seed: int = 0) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """x [M, n] -> y_i = x @ W_i for LAYERS weights (fp32 MatMul or 4-bit MatMulNBits);
    returns the model and each W_i [n, n] (K, N) as float64."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs, dense = [], [], [], []
    block = 32
    for i in range(LAYERS):
        if kind == "fp32":
            w = rng.standard_normal((n, n)).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
            dense.append(w.astype(np.float64))
        else:
            q = rng.integers(0, 16, (n, n // block, block))  # (N, blocks, block) nibbles
            scales = (rng.random((n, n // block)) * 0.1 + 0.01).astype(np.float32)
            packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
            inits += [
                numpy_helper.from_array(packed, f"b{i}"),
                numpy_helper.from_array(scales, f"s{i}"),
            ]
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    ["x", f"b{i}", f"s{i}"],
                    [f"y{i}"],
                    domain=MS,
                    K=n,
                    N=n,
                    bits=4,
                    block_size=block,
                )
            )
            w = ((q - 8) * scales[..., None].astype(np.float64)).reshape(n, n)  # (N, K)
            dense.append(w.T)
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", n])],
        outputs,
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets), dense


_MEASURE = """
import json, sys
import numpy as np
import onnx
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.inference_session import resolve_providers

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

folder, n, out, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
providers = resolve_providers(["cpu"])  # the CPU kernels, numba and onnx before the baseline
onnx.defs.get_all_schemas_with_history()
small = InferenceSession(warm, providers=providers)  # numba's runtime and these kernels
for m in (3, 40):
    small.run(None, {"x": np.ones((m, 64), np.float32)})
del small
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
sess = InferenceSession(folder, providers=providers)
peak, held = status("VmHWM") - base, status("VmRSS") - base
x = np.random.default_rng(1).standard_normal((40, n)).astype(np.float32)
for m in (3, 40):  # the packed (decode-sized) path, then the BLAS one
    np.save(f"{out}{m}.npy", np.stack(sess.run(None, {"x": x[:m]})))
    if m == 3:
        ran = status("VmRSS") - base
print(json.dumps({"peak": peak, "held": held, "ran": ran}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "kind,n,external,peak_max,held_max",
    [
        ("fp32", 1024, True, 1.4, 1.15),
        ("int4", 2048, True, 1.6, 1.4),
        ("fp32", 1024, False, 2.3, 1.15),
        ("int4", 2048, False, 2.3, 1.4),
    ],
)
def test_loading_holds_the_weights_once(tmp_path, kind, n, external, peak_max, held_max) -> None:
    """Resident memory a session adds while loading (peak), keeps (held) and holds after a
    decode-sized run (ran), over the weights' bytes: about 1x for float weights (kept transposed only), about 1.25x for 4-bit
    ones (kept as tiles only). Copies in the proto, a second array per weight and shape
    inference on the full model each add another 1x or more. Weights inside model.onnx
    are parsed into the proto and then converted, so loading them peaks near 2x."""
    model, dense = _projections(kind, n)
    if external:
        folder = _save(model, tmp_path / kind)
        weights = (folder / "model.onnx.data").stat().st_size
    else:
        folder = tmp_path / kind
        folder.mkdir()
        onnx.save_model(model, str(folder / "model.onnx"))
        weights = (folder / "model.onnx").stat().st_size
    warm = _save(_projections(kind, 64)[0], tmp_path / "warm")
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(folder), str(n), str(tmp_path / "y"), str(warm)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    slack = 6 << 20  # Python objects of the plan and the session
    assert got["peak"] <= peak_max * weights + slack, (got, weights)
    assert got["held"] <= held_max * weights + slack, (got, weights)
    assert got["ran"] <= held_max * weights + slack, (got, weights)  # nothing built on use
    x = np.random.default_rng(1).standard_normal((40, n)).astype(np.float32)
    for m in (3, 40):
        ys = np.load(tmp_path / f"y{m}.npy")
        for y, w in zip(ys, dense, strict=True):
            np.testing.assert_allclose(y, x[:m].astype(np.float64) @ w, rtol=2e-4, atol=2e-3)


def test_prepacked_weights_are_released_and_external_ones_mapped(tmp_path) -> None:
    """A weight read as it is (a Gather table) is a view of the mapped file; one read
    prepacked (a MatMul weight, kept transposed) leaves only its shape in the plan. The
    results are onnxruntime's on the same file."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(2)
    table = rng.standard_normal((512, 64)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"]),
            helper.make_node("MatMul", ["e", "w"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")],
    )
    folder = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path)
    sess = InferenceSession(folder / "model.onnx")
    assert mapped_buffer(sess.plan.constants["table"]) is not None
    assert not sess.plan.constants["table"].flags.writeable
    released = sess.plan.constants["w"]
    assert isinstance(released, ReleasedConstant) and released.shape == (64, 32)
    ids = rng.integers(0, 512, (1, 7))
    for rows in (ids[:, :1], ids):  # the skinny kernel, then BLAS
        (got,) = sess.run(None, {"ids": rows})
        ref = ort.InferenceSession(str(folder / "model.onnx")).run(None, {"ids": rows})[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, table[rows].astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def test_a_misaligned_tensor_is_read_not_mapped(tmp_path) -> None:
    """A float tensor at an offset that is no multiple of 4 cannot be a numpy view: it is
    read (a copy) and gives the same results."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    tensor = numpy_helper.from_array(w, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "2"), ("length", str(w.nbytes))):
        tensor.external_data.add(key=key, value=value)
    (tmp_path / "w.bin").write_bytes(b"\0\0" + w.tobytes())
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [tensor],
    )
    onnx.save_model(helper.make_model(graph), str(tmp_path / "model.onnx"))
    sess = InferenceSession(tmp_path / "model.onnx")
    assert mapped_buffer(sess.plan.constants["w"]) is None
    x = rng.standard_normal((16, 8)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + w)


def test_the_session_drops_its_own_proto_bytes_not_a_callers(tmp_path) -> None:
    model, _ = _projections("fp32", 64)
    folder = _save(model, tmp_path)
    sess = InferenceSession(folder)
    assert all(not init.raw_data for init in sess.model.graph.initializer)
    with pytest.raises(ModelLoadError, match="'w0' has no bytes.*load the model again"):
        InferenceSession(sess.model)
    proto = load_model(folder / "model.onnx")  # a caller's proto, weights read in
    before = [init.raw_data for init in proto.graph.initializer]
    x = np.ones((2, 64), np.float32)
    first = InferenceSession(proto).run(["y0"], {"x": x})[0]
    assert [init.raw_data for init in proto.graph.initializer] == before
    np.testing.assert_array_equal(InferenceSession(proto).run(["y0"], {"x": x})[0], first)


def test_shape_inference_without_weight_bytes_gives_onnx_types(tmp_path) -> None:
    """The skeleton shape inference runs on (large initializers as typed inputs) infers
    what onnx infers on the whole model, for a builder-style LLM."""
    from onnx_genrt.models import default_model_path

    model = load_model(default_model_path() / "model.onnx", folder=default_model_path())
    full = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    want = {vi.name: _value_spec(vi) for vi in [*full.graph.value_info, *full.graph.output]}
    got = _infer_value_types(model)
    assert len(want) > 50
    assert {name: got.get(name) for name in want} == want
