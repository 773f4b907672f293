"""Small ONNX models built in code for tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.testing.models import elementwise_chain, elementwise_chain_reference


def mlp(hidden: int = 16, seed: int = 0, batch: int | str = "batch") -> onnx.ModelProto:
    """y = relu(x @ w1 + b1) @ w2 * 0.5 + x, with a few shape ops on the way."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32) * 0.1
    b1 = rng.standard_normal((2 * hidden,)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((2 * hidden, hidden)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="mm2"),
        helper.make_node("Mul", ["h3", "half"], ["h4"], name="scale"),
        helper.make_node("Add", ["h4", "x"], ["y"], name="residual"),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def mlp_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The same computation in numpy float64, independent of onnx-genrt."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    xd = x.astype(np.float64)
    h = np.maximum(xd @ w["w1"] + w["b1"], 0.0)
    return h @ w["w2"] * w["half"] + xd


def chain(length: int, width: int = 8) -> onnx.ModelProto:
    """``length`` tiny elementwise nodes in a row: a model that is all dispatch cost."""
    return elementwise_chain(length, width)


def chain_reference(length: int, x: np.ndarray) -> np.ndarray:
    """``chain(length)`` in numpy float64."""
    return elementwise_chain_reference(length, x)


def decomposed_head(hidden: int = 24, vocab: int = 300, dtype=np.float32, seed: int = 0):
    """An exporter-style MTP-like tail: residual Add, decomposed RMSNorm, lm_head, then the
    draft pick ``ArgMax`` and its probability ``ReduceMax(Softmax)`` (all standard ops).
    Inputs a, b [1, 2, hidden]; outputs draft [1, 2] and confidence [1, 2]."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    inits = [
        const("w", rng.uniform(0.5, 1.5, hidden)),
        const("lm", rng.standard_normal((hidden, vocab)) * 2 / np.sqrt(hidden)),
        const("two", 2.0),
        const("eps", 1e-6),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    nodes = [
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node("Pow", ["r", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "last"], ["mean"]),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["inv"]),
        helper.make_node("Mul", ["r", "inv"], ["normed"]),
        helper.make_node("Mul", ["normed", "w"], ["h"]),
        helper.make_node("MatMul", ["h", "lm"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["draft"], axis=-1, keepdims=0),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("ReduceMax", ["probs", "last"], ["confidence"], keepdims=0),
    ]
    shape = [1, 2, hidden]
    graph = helper.make_graph(
        nodes,
        "decomposed_head",
        [helper.make_tensor_value_info(n, elem, shape) for n in "ab"],
        [
            helper.make_tensor_value_info("draft", TensorProto.INT64, [1, 2]),
            helper.make_tensor_value_info("confidence", elem, [1, 2]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def decomposed_head_reference(model: onnx.ModelProto, a: np.ndarray, b: np.ndarray):
    """(logits, draft, confidence) in float64."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    r = a.astype(np.float64) + b.astype(np.float64)
    h = w["w"] * r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + 1e-6)
    logits = h @ w["lm"]
    top = logits.max(axis=-1, keepdims=True)
    conf = 1.0 / np.exp(logits - top).sum(axis=-1)
    return logits, logits.argmax(axis=-1), conf


def norm_projections(
    hidden: int = 64,
    rows: int = 3,
    n: int = 48,
    variant: str = "fusable",
    dtype=np.float32,
    seed: int = 0,
) -> onnx.ModelProto:
    """RMS norms feeding projections, as a decoder layer writes them:
    ``SkipSimplifiedLayerNormalization(a, b)`` read by two MatMuls, its residual sum read
    afterwards, and a ``SimplifiedLayerNormalization`` of that sum read by a 4-bit
    ``MatMulNBits`` (block 32, uint8 zero points). Outputs ``y`` and ``z``.

    ``variant``: "fusable"; "extra_reader" (the normalized output is also added to ``y``);
    "sum_first" (the residual sum is read before the projections run).
    """
    rng = np.random.default_rng(seed)
    f = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    w1 = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(dtype)
    w2 = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(dtype)
    g1 = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    g2 = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    q = rng.integers(0, 16, (n, hidden // 32, 32))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    scales = (rng.uniform(0.01, 0.05, (n, hidden // 32))).astype(dtype)
    zeros = rng.integers(0, 16, (n, hidden // 32 + (hidden // 32) % 2))
    zp = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)
    ms = "com.microsoft"
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["a", "b", "g1"],
            ["n1", "", "", "r"],
            domain=ms,
            epsilon=1e-5,
        ),
    ]
    if variant == "sum_first":
        nodes.append(helper.make_node("Mul", ["r", "r"], ["rr"]))
    nodes += [
        helper.make_node("MatMul", ["n1", "w1"], ["p1"]),
        helper.make_node("MatMul", ["n1", "w2"], ["p2"]),
        helper.make_node("Add", ["p1", "p2"], ["y0"]),
        helper.make_node(
            "SimplifiedLayerNormalization", ["r", "g2"], ["n2"], axis=-1, epsilon=1e-6
        ),
        helper.make_node(
            "MatMulNBits",
            ["n2", "B", "scales", "zp"],
            ["z"],
            domain=ms,
            K=hidden,
            N=n,
            bits=4,
            block_size=32,
        ),
    ]
    if variant == "extra_reader":
        nodes.append(helper.make_node("ReduceSum", ["n1"], ["n1sum"], keepdims=1))
        nodes.append(helper.make_node("Add", ["y0", "n1sum"], ["y"]))
    elif variant == "sum_first":
        nodes.append(helper.make_node("ReduceSum", ["rr"], ["rsum"], keepdims=1))
        nodes.append(helper.make_node("Add", ["y0", "rsum"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["y0"], ["y"]))
    shape = [1, rows, hidden]
    graph = helper.make_graph(
        nodes,
        "norm_projections",
        [helper.make_tensor_value_info(x, f, shape) for x in "ab"],
        [
            helper.make_tensor_value_info("y", f, [1, rows, n]),
            helper.make_tensor_value_info("z", f, [1, rows, n]),
        ],
        [
            const("w1", w1),
            const("w2", w2),
            const("g1", g1),
            const("g2", g2),
            const("B", packed),
            const("scales", scales),
            const("zp", zp),
        ],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ms, 1)]
    )


def silu_projection(
    hidden: int = 32,
    inter: int = 64,
    rows: int = 3,
    seed: int = 0,
    down: str = "nbits",
    norm: bool = False,
    dtype=np.float32,
    gate_up: str = "matmul",
):
    """A gated MLP as exporters write it: gate and up MatMuls, ``gate * Sigmoid(gate) * up``,
    then a 4-bit ``MatMulNBits`` down projection (block 32, no zero points), or a float
    ``MatMul`` with ``down="matmul"``. Output ``y``. With ``norm``, the MLP reads
    ``SkipSimplifiedLayerNormalization(x, r, gamma)`` and its residual sum is output ``h``.
    ``dtype``: of the activations and float weights. ``gate_up="nbits"``: the gate and up
    projections are 4-bit ``MatMulNBits`` too (weights ``Bg``/``sg`` and ``Bu``/``su``, the
    zero point 8; see :func:`nbits_weight`)."""
    rng = np.random.default_rng(seed)
    wg = (rng.standard_normal((hidden, inter)) / np.sqrt(hidden)).astype(dtype)
    wu = (rng.standard_normal((hidden, inter)) / np.sqrt(hidden)).astype(dtype)
    q = rng.integers(0, 16, (hidden, inter // 32, 32))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, (hidden, inter // 32)).astype(dtype)
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"]),
        helper.make_node("MatMul", ["x", "wu"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["m"]),
        helper.make_node(
            "MatMulNBits",
            ["m", "B", "scales"],
            ["y"],
            domain="com.microsoft",
            K=inter,
            N=hidden,
            bits=4,
            block_size=32,
        )
        if down == "nbits"
        else helper.make_node("MatMul", ["m", "wd"], ["y"]),
    ]
    wd = (rng.standard_normal((inter, hidden)) / np.sqrt(inter)).astype(dtype)
    f = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [helper.make_tensor_value_info("x", f, [1, rows, hidden])]
    outputs = [helper.make_tensor_value_info("y", f, [1, rows, hidden])]
    extra = []
    if norm:
        for n in nodes[:2]:
            n.input[0] = "n"
        skip_norm = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "r", "gamma"],
            ["n", "", "", "h"],
            domain="com.microsoft",
            epsilon=1e-6,
        )
        nodes.insert(0, skip_norm)
        inputs.append(helper.make_tensor_value_info("r", f, [1, rows, hidden]))
        outputs.append(helper.make_tensor_value_info("h", f, [1, rows, hidden]))
        gamma = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
        extra.append(numpy_helper.from_array(gamma, "gamma"))
    if gate_up == "nbits":
        for i, name in enumerate("gu"):
            q = rng.integers(0, 16, (inter, hidden // 32, 32))
            w_scales = rng.uniform(0.01, 0.05, (inter, hidden // 32)).astype(dtype)
            packed_w = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
            extra += [
                numpy_helper.from_array(packed_w, f"B{name}"),
                numpy_helper.from_array(w_scales, f"s{name}"),
            ]
            src = nodes[i + int(norm)].input[0]
            nodes[i + int(norm)] = helper.make_node(
                "MatMulNBits",
                [src, f"B{name}", f"s{name}"],
                [name],
                domain="com.microsoft",
                K=hidden,
                N=inter,
                bits=4,
                block_size=32,
            )
    graph = helper.make_graph(
        nodes,
        "silu_projection",
        inputs,
        outputs,
        [
            *extra,
            numpy_helper.from_array(wg, "wg"),
            numpy_helper.from_array(wu, "wu"),
            numpy_helper.from_array(packed, "B"),
            numpy_helper.from_array(scales, "scales"),
            numpy_helper.from_array(wd, "wd"),
        ],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )


def nbits_weight(model: onnx.ModelProto, packed: str, scales: str) -> np.ndarray:
    """The [K, N] float64 weight of a 4-bit MatMulNBits initializer pair (block 32, zero
    point 8) as :func:`silu_projection` writes them."""
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    b, s = init[packed], init[scales].astype(np.float64)
    q = np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], b.shape[1], 32)
    return ((q - 8.0) * s[..., None]).reshape(b.shape[0], -1).T


def mtp_chain_case(seed: int, k: int = 4):
    """The embedded model's MTP head unrolled k times, and random feeds of an after-verify
    chain (``engine.mtp_chain``): verify ids whose first drafts partly match the argmax, a
    draft count and a verify start."""
    from onnx_genrt.engine import mtp_chain as mc
    from onnx_genrt.models import default_model_path
    from onnx_genrt.session import InferenceSession, load_model

    chain = mc.unroll_mtp_head(load_model(default_model_path() / "mtp" / "model.onnx"), k)
    hidden_size = int(InferenceSession(chain).input_spec("hidden_states").shape[-1])
    rng = np.random.default_rng(seed)
    feeds = {
        mc.VERIFY_IDS: rng.integers(0, 50, (1, k + 1)).astype(np.int64),
        mc.VERIFY_ARGMAX: rng.integers(0, 50, (1, k + 1)).astype(np.int64),
        mc.VERIFY_HIDDEN: rng.standard_normal((1, k + 1, hidden_size)).astype(np.float32),
        mc.DRAFT_COUNT: np.array([int(rng.integers(0, k + 1))], np.int64),
        mc.VERIFY_START: np.array([int(rng.integers(0, 40))], np.int64),
    }
    matches = int(rng.integers(0, k + 1))
    feeds[mc.VERIFY_IDS][0, 1 : matches + 1] = feeds[mc.VERIFY_ARGMAX][0, :matches]
    return chain, feeds


def cpu_kernels(skip=lambda domain, op: False):
    """A new registry holding every CPU kernel whose (domain, op) ``skip`` does not name:
    the start of a test provider that lacks, replaces or adds kernels."""
    from onnx_genrt.core.kernels import KernelRegistry
    from onnx_genrt.providers.cpu.kernels import REGISTRY

    registry = KernelRegistry()
    for domain, op in REGISTRY.ops():
        if skip(domain, op):
            continue
        for since in REGISTRY.versions(domain, op):
            registry.add(REGISTRY.lookup(domain, op, since))
    return registry


def standard_ops_cpu():
    """A CPU provider ("cpu-standard") without any ``onnx_genrt`` kernel: placement runs the
    bodies of that domain's ops (``core.genrt_ops``) on it, and no fusion applies."""
    from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelRegistry
    from onnx_genrt.providers.cpu.provider import CPUProvider

    registry = cpu_kernels(lambda domain, op: domain == GENRT_DOMAIN)

    class StandardOpsCPU(CPUProvider):
        name = "cpu-standard"

        @property
        def kernels(self) -> KernelRegistry:
            return registry

    return StandardOpsCPU()
