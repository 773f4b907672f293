"""The MTP chain builders on a tiny hand-made head, against a float64 numpy chain: both
ReduceMax forms (opset 17 and 18), fp16 logits, draft vocabularies (first ids and ranked),
and the errors for bad arguments. Each built graph is also run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine.mtp_chain import (
    CONFIDENCES,
    DRAFTS,
    after_verify,
    restrict_draft_vocab,
    unroll_mtp_head,
)
from onnx_genrt.session import InferenceSession

HIDDEN, VOCAB = 8, 12


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
        "w_hidden": (rng.standard_normal((HIDDEN, HIDDEN)) / 2).astype(np.float32),
        "lm_head": (rng.standard_normal((HIDDEN, VOCAB)) * 3).astype(np.float32),
    }


def _head(opset: int = 18, fp16_logits: bool = False, seed: int = 0) -> onnx.ModelProto:
    """mtp_hidden = tanh((hidden + embed[id]) @ w_hidden); logits = mtp_hidden @ lm_head."""
    w = _weights(seed)
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["emb"]),
        helper.make_node("Add", ["hidden_states", "emb"], ["mixed"]),
        helper.make_node("MatMul", ["mixed", "w_hidden"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["mtp_hidden_states"]),
        helper.make_node("MatMul", ["mtp_hidden_states", "lm_head"], ["logits32"]),
    ]
    logits_type = TensorProto.FLOAT16 if fp16_logits else TensorProto.FLOAT
    nodes.append(helper.make_node("Cast", ["logits32"], ["logits"], to=logits_type))
    graph = helper.make_graph(
        nodes,
        "tiny_mtp",
        [
            helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, 1, HIDDEN]),
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1]),
        ],
        [
            helper.make_tensor_value_info("logits", logits_type, [1, 1, VOCAB]),
            helper.make_tensor_value_info("mtp_hidden_states", TensorProto.FLOAT, [1, 1, HIDDEN]),
        ],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _head_with_matmul_logits(opset: int = 18) -> onnx.ModelProto:
    """The tiny head with logits made by the MatMul itself (what restrict_draft_vocab cuts)."""
    head = _head(opset)
    graph = head.graph
    del graph.node[-1]
    graph.node[-1].output[0] = "logits"
    return head


def _reference(
    k: int, hidden: np.ndarray, token: int, columns: np.ndarray | None = None, seed: int = 0
) -> tuple[list[int], list[float]]:
    """The chain in float64: drafts and softmax confidences (``columns``: the draft
    vocabulary the argmax ranges over, each mapped back to its id)."""
    w = {name: v.astype(np.float64) for name, v in _weights(seed).items()}
    cols = np.arange(VOCAB) if columns is None else columns
    h = hidden.reshape(-1).astype(np.float64)
    drafts, confs = [], []
    for _ in range(k):
        h = np.tanh((h + w["embed"][token]) @ w["w_hidden"])
        logits = (h @ w["lm_head"])[cols]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        token = int(cols[np.argmax(logits)])
        drafts.append(token)
        confs.append(float(p.max()))
    return drafts, confs


def _feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "hidden_states": rng.standard_normal((1, 1, HIDDEN)).astype(np.float32),
        "input_ids": rng.integers(0, VOCAB, (1, 1)).astype(np.int64),
    }


def _run_both(model: onnx.ModelProto, feeds: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """(drafts, confidences) from onnx-genrt's CPU provider and from onnxruntime."""
    ours = InferenceSession(model).run([DRAFTS, CONFIDENCES], feeds)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [tuple(ours), tuple(ref.run([DRAFTS, CONFIDENCES], feeds))]


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("k", [1, 3])
def test_chain_equals_a_float64_chain(opset, k):
    """Drafts and confidences of an unrolled head (ReduceMax with axes as an attribute
    before opset 18, as an input from 18) equal the chain computed in float64."""
    model = unroll_mtp_head(_head(opset), k)
    assert model.opset_import[0].version == opset
    onnx.checker.check_model(model, full_check=True)  # declared shapes agree with inferred
    for seed in range(4):
        feeds = _feeds(seed)
        want_drafts, want_confs = _reference(k, feeds["hidden_states"], feeds["input_ids"][0, 0])
        for drafts, confs in _run_both(model, feeds):
            assert drafts.dtype == np.int64 and drafts.shape == (1, k)
            assert drafts[0].tolist() == want_drafts
            assert confs.dtype == np.float32 and confs.shape == (1, k)
            np.testing.assert_allclose(confs[0], want_confs, rtol=1e-5)


def test_fp16_logits_give_float32_confidences():
    """A head with fp16 logits: the chain still returns float32 confidences, equal to the
    float64 chain within fp16 rounding."""
    model = unroll_mtp_head(_head(fp16_logits=True), 2)
    for seed in range(4):
        feeds = _feeds(seed)
        want_drafts, want_confs = _reference(2, feeds["hidden_states"], feeds["input_ids"][0, 0])
        for drafts, confs in _run_both(model, feeds):
            assert drafts[0].tolist() == want_drafts
            assert confs.dtype == np.float32
            np.testing.assert_allclose(confs[0], want_confs, rtol=5e-3)


@pytest.mark.parametrize("opset", [17, 18])
def test_draft_vocabularies_equal_a_float64_chain_over_their_columns(opset):
    """``restrict_draft_vocab`` with the first n ids, and with ranked ids mapped back through
    ``draft_ids``: drafts come from those columns only, as in the float64 chain; the logits
    output is declared with the vocabulary's width."""
    head = _head_with_matmul_logits(opset)
    ranked = np.array([9, 2, 11, 5, 0], np.int64)
    for vocab, columns in ((7, np.arange(7)), (1, np.arange(1)), (ranked, ranked)):
        cut = restrict_draft_vocab(head, vocab)
        (logits,) = [o for o in cut.graph.output if o.name == "logits"]
        dims = [d.dim_value for d in logits.type.tensor_type.shape.dim]
        assert dims == [1, 1, len(columns)]
        onnx.checker.check_model(cut, full_check=True)
        ids = None if isinstance(vocab, int) else ranked
        model = unroll_mtp_head(cut, 3, draft_ids=ids)
        for seed in range(4):
            feeds = _feeds(seed)
            want = _reference(3, feeds["hidden_states"], feeds["input_ids"][0, 0], columns)
            for drafts, confs in _run_both(model, feeds):
                assert drafts[0].tolist() == want[0]
                np.testing.assert_allclose(confs[0], want[1], rtol=1e-5)
    assert len(head.graph.node) == 5, "the head passed in is left unchanged"


def test_bad_arguments_are_refused_by_name():
    head = _head()
    with pytest.raises(InvalidInputError, match=r"k \(drafts per speculative step\).*got 0"):
        unroll_mtp_head(head, 0)
    with pytest.raises(ModelLoadError, match=r"no input \['hidden'\]"):
        unroll_mtp_head(head, 2, hidden_input="hidden")
    with pytest.raises(InvalidInputError, match="at least 1 token, got 0"):
        restrict_draft_vocab(_head_with_matmul_logits(), 0)
    with pytest.raises(InvalidInputError, match="at least 1 token, got 0"):
        restrict_draft_vocab(_head_with_matmul_logits(), np.zeros(0, np.int64))
    with pytest.raises(InvalidInputError, match="from a MatMul; a Cast makes it"):
        restrict_draft_vocab(head, 4)
    with pytest.raises(InvalidInputError, match="from a MatMul; nothing makes it"):
        restrict_draft_vocab(head, 4, logits_output="scores")
    chain = unroll_mtp_head(head, 2)
    with pytest.raises(ModelLoadError, match="no inputs 'hidden' and 'input_ids'"):
        after_verify(chain, 2, hidden_input="hidden")
    with pytest.raises(ModelLoadError, match="no inputs 'hidden_states' and 'ids'"):
        after_verify(chain, 2, ids_input="ids")


@pytest.mark.parametrize("k", [1, 3])
def test_after_verify_declares_the_verify_step_inputs(k):
    """The after-verify graph's inputs are declared as the verify step writes them: ids and
    argmax [1, k+1] int64, hidden states [1, k+1, H] of the given type (H from the head's
    hidden input, or a symbolic dimension when the head leaves it unnamed), count [1]."""
    from onnx_genrt.engine.mtp_chain import DRAFT_COUNT, VERIFY_ARGMAX, VERIFY_HIDDEN, VERIFY_IDS

    def declared(model: onnx.ModelProto) -> dict[str, tuple[int, list]]:
        return {
            i.name: (
                i.type.tensor_type.elem_type,
                [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim],
            )
            for i in model.graph.input
        }

    model = after_verify(unroll_mtp_head(_head(), k), k, verify_hidden_type=TensorProto.FLOAT16)
    assert declared(model) == {
        VERIFY_IDS: (TensorProto.INT64, [1, k + 1]),
        VERIFY_ARGMAX: (TensorProto.INT64, [1, k + 1]),
        VERIFY_HIDDEN: (TensorProto.FLOAT16, [1, k + 1, HIDDEN]),
        DRAFT_COUNT: (TensorProto.INT64, [1]),
    }
    head = _head()
    head.graph.input[0].type.tensor_type.shape.dim[-1].dim_param = "h"
    model = after_verify(unroll_mtp_head(head, k), k)
    assert declared(model)[VERIFY_HIDDEN] == (TensorProto.FLOAT, [1, k + 1, "hidden"])


@pytest.mark.parametrize("positions, length", [(True, 20), (False, None)])
@pytest.mark.parametrize("fused", [False, True], ids=["body", "fused"])
def test_next_inputs_graph_declares_the_shapes_it_produces(fused, positions, length):
    """Every input and output ``after_verify`` + ``with_next_inputs`` declare has the shape
    and type the arrays fed to and produced by a run have (fused kernels and their
    standard-op bodies)."""
    from onnx_genrt.engine.mtp_chain import (
        DRAFT_COUNT,
        VERIFY_ARGMAX,
        VERIFY_HIDDEN,
        VERIFY_IDS,
        VERIFY_START,
        with_next_inputs,
    )
    from tests.models import standard_ops_cpu

    k = 3
    chain = after_verify(unroll_mtp_head(_head(), k), k)
    model = with_next_inputs(chain, k, 0.2, length, positions)
    rng = np.random.default_rng(0)
    feeds = {
        VERIFY_IDS: rng.integers(0, VOCAB, (1, k + 1)),
        VERIFY_ARGMAX: rng.integers(0, VOCAB, (1, k + 1)),
        VERIFY_HIDDEN: rng.standard_normal((1, k + 1, HIDDEN)).astype(np.float32),
        DRAFT_COUNT: np.array([2], np.int64),
        VERIFY_START: np.array([5], np.int64),
    }
    session = InferenceSession(model, ["cpu" if fused else standard_ops_cpu()])
    names = [o.name for o in model.graph.output]
    produced = dict(zip(names, session.run(names, feeds), strict=True))
    arrays = {**feeds, **produced}
    for value in [*model.graph.input, *model.graph.output]:
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        dims = tuple(d.dim_value for d in tensor.shape.dim)
        assert (arrays[value.name].dtype, arrays[value.name].shape) == (dtype, dims), value.name


def _head_with_stored_weight_nodes() -> onnx.ModelProto:
    """The tiny head with ``w_hidden`` stored transposed in fp16, as exporters write it:
    Cast and Transpose of the weight before its MatMul (a constant subgraph)."""
    head = _head()
    graph = head.graph
    w = _weights()["w_hidden"]
    graph.initializer.remove(next(i for i in graph.initializer if i.name == "w_hidden"))
    graph.initializer.append(numpy_helper.from_array(w.T.astype(np.float16), "w_hidden_t16"))
    stored = [
        helper.make_node("Cast", ["w_hidden_t16"], ["w_hidden_t"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["w_hidden_t"], ["w_hidden"], perm=[1, 0]),
    ]
    for node in reversed(stored):
        graph.node.insert(0, node)
    return head


def test_nodes_of_the_weights_alone_run_once_for_the_whole_chain():
    """A Cast and Transpose of a weight are computed once, shared by every step (the
    unrolled chain holds one folded copy of the weight, not k); the chain still equals the
    float64 chain of the fp16-rounded weight, run by onnx-genrt and by onnxruntime."""
    k = 3
    model = unroll_mtp_head(_head_with_stored_weight_nodes(), k)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Transpose") == 1 and ops.count("MatMul") == 2 * k
    assert sum("w_hidden_t16" in n.input for n in model.graph.node) == 1
    w = _weights()
    w16 = w["w_hidden"].astype(np.float16).astype(np.float64)
    for seed in range(3):
        feeds = _feeds(seed)
        h, token = feeds["hidden_states"].reshape(-1).astype(np.float64), feeds["input_ids"][0, 0]
        want_drafts, want_confs = [], []
        for _ in range(k):
            h = np.tanh((h + w["embed"][token].astype(np.float64)) @ w16)
            logits = h @ w["lm_head"].astype(np.float64)
            p = np.exp(logits - logits.max())
            token = int(np.argmax(logits))
            want_drafts.append(token)
            want_confs.append(float(p.max() / p.sum()))
        for drafts, confs in _run_both(model, feeds):
            assert drafts[0].tolist() == want_drafts
            np.testing.assert_allclose(confs[0], want_confs, rtol=1e-5)
