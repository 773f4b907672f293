"""The decode heads appended to a decoder graph (device argmax, non-finite flag), run by
onnxruntime and by onnx-genrt against numpy, and their declared types under ONNX's strict
shape inference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.engine.decode_heads import ARGMAX, NONFINITE, add_decode_heads
from onnx_genrt.session import InferenceSession

VOCAB = 7


def _decoder(logits_type: int, other_type: int) -> onnx.ModelProto:
    """A stand-in decoder: ``logits`` [batch, seq, VOCAB] of ``logits_type`` listed after
    another output of ``other_type`` (as a KV cache's ``present`` may come first)."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["logits"]),
            helper.make_node("Identity", ["y"], ["present"]),
        ],
        "decoder",
        [
            helper.make_tensor_value_info("x", logits_type, ["batch", "seq", VOCAB]),
            helper.make_tensor_value_info("y", other_type, ["batch", 2]),
        ],
        [
            helper.make_tensor_value_info("present", other_type, ["batch", 2]),
            helper.make_tensor_value_info("logits", logits_type, ["batch", "seq", VOCAB]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


TYPES = [
    (TensorProto.FLOAT, TensorProto.FLOAT16, np.float32),
    (TensorProto.FLOAT16, TensorProto.FLOAT, np.float16),
]


@pytest.mark.parametrize(("logits_type", "other_type", "dtype"), TYPES)
def test_heads_declare_what_strict_shape_inference_infers(logits_type, other_type, dtype):
    model = add_decode_heads(_decoder(logits_type, other_type), "logits")
    onnx.checker.check_model(model, full_check=True)  # declared types and ranks agree
    declared = {o.name: o.type.tensor_type for o in model.graph.output}
    assert declared[ARGMAX].elem_type == TensorProto.INT64
    assert declared[NONFINITE].elem_type == logits_type
    assert len(declared[NONFINITE].shape.dim) == 0  # a scalar


def _feeds(dtype, rng, batch: int = 3, seq: int = 2, bad: float | None = None) -> dict:
    x = rng.standard_normal((batch, seq, VOCAB)).astype(dtype)
    if bad is not None:
        x[batch - 1, 0, 3] = bad
    return {"x": x, "y": np.zeros((batch, 2), np.float32 if dtype == np.float16 else np.float16)}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize(("logits_type", "other_type", "dtype"), TYPES)
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_heads_give_numpys_argmax_and_flag_non_finite_logits(logits_type, other_type, dtype, bad):
    """ARGMAX is numpy's argmax over the vocabulary, per row and position; NONFINITE is a
    scalar of the logits' type, 0 when every logit is finite and NaN otherwise. onnxruntime
    and onnx-genrt both run the edited graph."""
    ort = pytest.importorskip("onnxruntime")
    model = add_decode_heads(_decoder(logits_type, other_type), "logits")
    feeds = _feeds(dtype, np.random.default_rng(0), bad=bad)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = InferenceSession(model)
    names = [ARGMAX, NONFINITE]
    for argmax, flag in (reference.run(names, feeds), ours.run(names, feeds)):
        if bad is None or bad > 0:  # with -inf or NaN in a row numpy's answer differs by rule
            np.testing.assert_array_equal(argmax, np.argmax(feeds["x"], axis=-1))
        assert argmax.dtype == np.int64 and argmax.shape == feeds["x"].shape[:2]
        assert flag.dtype == dtype and flag.shape == ()
        assert np.isnan(flag) if bad is not None else flag == 0


def test_heads_are_added_once():
    model = add_decode_heads(_decoder(TensorProto.FLOAT, TensorProto.FLOAT), "logits")
    nodes, outputs = len(model.graph.node), [o.name for o in model.graph.output]
    assert add_decode_heads(model, "logits") is model
    assert len(model.graph.node) == nodes and [o.name for o in model.graph.output] == outputs


def test_a_missing_logits_output_names_the_config_key():
    model = _decoder(TensorProto.FLOAT, TensorProto.FLOAT)
    with pytest.raises(ModelLoadError, match=r"no output 'scores' \(genai_config.json model"):
        add_decode_heads(model, "scores")
    assert [o.name for o in model.graph.output] == ["present", "logits"]  # left unchanged


def test_a_builder_decoder_declares_the_argmax_over_the_logits_leading_dims(qwen2_dir):
    """(Builder models put contrib ops in the default domain: ONNX's checker refuses them
    whole, so the declaration is compared with the logits' own.)"""
    model = onnx.load(qwen2_dir / "model.onnx", load_external_data=False)
    add_decode_heads(model, "logits")
    declared = {o.name: o.type.tensor_type for o in model.graph.output}
    logits_dims = [d.dim_param or d.dim_value for d in declared["logits"].shape.dim]
    assert logits_dims[:2] == ["batch_size", "sequence_length"]
    assert [d.dim_param or d.dim_value for d in declared[ARGMAX].shape.dim] == logits_dims[:-1]
    assert declared[NONFINITE].elem_type == declared["logits"].elem_type
