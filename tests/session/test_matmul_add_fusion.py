"""A projection's bias fused into it (``session.fusion.fuse_matmul_add``: MatMul + Add ->
``onnx_genrt::MatMulAdd``), on the CPU provider, against onnxruntime on the unfused model
and, bit for bit, against the CPU provider without the fused kernel."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelRegistry
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from tests.models import cpu_kernels

ort = pytest.importorskip("onnxruntime")

F32 = np.float32
K, N = 48, 70  # N not a multiple of the skinny kernel's 32-column tiles


class UnfusedCPU(CPUProvider):
    """The CPU provider without the MatMulAdd kernel: the MatMul and the Add stay apart."""

    name = "unfused-cpu"

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        return cpu_kernels(lambda domain, op: (domain, op) == (GENRT_DOMAIN, "MatMulAdd"))


def _model(
    bias_first: bool = False,
    bias_shape: tuple[int, ...] = (N,),
    bias_input: bool = False,
    product_output: bool = False,
    second_reader: bool = False,
    producer: str = "MatMul",
    consumer: str = "Add",
):
    """y = x @ W + b (x [1, m, K]); the variants break one condition of the fusion each
    (``producer="Mul"``: x * W with W [1, K], then the bias a row of K; ``consumer="Mul"``:
    (x @ W) * b)."""
    rng = np.random.default_rng(7)
    shape = (K, N) if producer == "MatMul" else (1, K)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(F32), "W")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", K])]
    if bias_input:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, list(bias_shape)))
    else:
        inits.append(numpy_helper.from_array(rng.standard_normal(bias_shape).astype(F32), "b"))
    add_inputs = ["b", "p"] if bias_first else ["p", "b"]
    nodes = [
        helper.make_node(producer, ["x", "W"], ["p"]),
        helper.make_node(consumer, add_inputs, ["y"]),
    ]
    width = N if producer == "MatMul" else K
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", width])]
    if product_output:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, "m", width]))
    if second_reader:
        nodes.append(helper.make_node("Relu", ["p"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, "m", width]))
    graph = helper.make_graph(nodes, "biased", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ops(sess: InferenceSession) -> list[str]:
    return [s.node.op_type for s in sess.plan.steps]


@pytest.mark.parametrize("bias_first", [False, True])
def test_bias_fuses_and_matches_onnxruntime_and_the_unfused_run(bias_first):
    model = _model(bias_first=bias_first)
    fused = InferenceSession(model, providers=["cpu"])
    plain = InferenceSession(model, providers=[UnfusedCPU()])
    assert _ops(fused) == ["MatMulAdd"] and sorted(_ops(plain)) == ["Add", "MatMul"]
    onnxrt = ort.InferenceSession(model.SerializeToString())
    rng = np.random.default_rng(1)
    for m in (1, 5, 20):  # the skinny kernel's rows, and BLAS past 16
        x = rng.standard_normal((1, m, K)).astype(F32)
        (got,) = fused.run(["y"], {"x": x})
        (want,) = plain.run(["y"], {"x": x})
        np.testing.assert_array_equal(got, want)  # the Add rounds the same float32 sums
        np.testing.assert_allclose(got, onnxrt.run(["y"], {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_decode_and_verify_steps_replay_the_fused_kernel():
    model = _model()
    sess = InferenceSession(model, providers=["cpu"])
    plain = InferenceSession(model, providers=[UnfusedCPU()])
    rng = np.random.default_rng(2)
    for slot, m in ((DeviceGraphSlot.PRIMARY, 1), (DeviceGraphSlot.VERIFY, 5)):
        binding = sess.io_binding()
        x = binding.bind_input("x", np.zeros((1, m, K), F32))
        y = binding.bind_output("y", shape=(1, m, N))
        for _ in range(4):  # eager, captured, then two replays
            x[...] = rng.standard_normal(x.shape).astype(F32)
            sess.run_with_iobinding(binding, slot)
            np.testing.assert_array_equal(y, plain.run(["y"], {"x": x})[0])
        stats = sess.graph_stats(slot)
        assert stats.captures == 1 and stats.replays == 2 and stats.fallbacks == 0
        graph = sess.main_provider.recorded_graph(slot)
        assert graph.bound == len(graph.calls) == 1  # the prebound skinny call with its bias


@pytest.mark.parametrize(
    "variant",
    [
        {"bias_shape": (1, N)},  # not a row of N: the Add broadcasts differently
        {"bias_input": True},  # not a constant
        {"product_output": True},  # the product is a graph output
        {"second_reader": True},  # the product has another reader
        {"consumer": "Mul"},  # a scale, not a bias
        {"producer": "Mul", "bias_shape": (K,)},  # a constant 2-D operand, but no MatMul
    ],
)
def test_what_does_not_fuse(variant):
    model = _model(**variant)
    sess = InferenceSession(model, providers=["cpu"])
    assert "MatMulAdd" not in _ops(sess), _ops(sess)
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 2, K)).astype(F32)}
    if variant.get("bias_input"):
        feeds["b"] = np.ones(N, F32)
    names = [o.name for o in model.graph.output]
    got = sess.run(names, feeds)
    want = ort.InferenceSession(model.SerializeToString()).run(names, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_a_provider_without_the_kernel_runs_the_body():
    """An onnx_genrt::MatMulAdd node in a model: the unfused provider runs its standard-op
    body (MatMul, Add), the CPU provider its kernel; both equal numpy in float64."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((K, N)).astype(F32)
    b = rng.standard_normal(N).astype(F32)
    node = helper.make_node("MatMulAdd", ["x", "W", "b"], ["y"], domain=GENRT_DOMAIN)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(GENRT_DOMAIN, 1)]
    )
    x = rng.standard_normal((3, K)).astype(F32)
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    for provider in ("cpu", UnfusedCPU()):
        sess = InferenceSession(model, providers=[provider])
        (got,) = sess.run(["y"], {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_embedded_model_fuses_each_qkv_bias_and_decodes_the_same_tokens():
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.generate_cli import default_model_dir

    fused = Model(default_model_dir(), ["cpu"])
    ops = _ops(fused.session)
    assert ops.count("MatMulAdd") == fused.config.num_layers and "Add" not in ops, ops
    plain = Model(default_model_dir(), [UnfusedCPU()])
    prompt = "    def __init__(self"
    want = generate(plain, prompt, max_new_tokens=24, ignore_eos=True).tokens
    assert generate(fused, prompt, max_new_tokens=24, ignore_eos=True).tokens == want
