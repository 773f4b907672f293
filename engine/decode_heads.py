"""Small additions to a decoder graph so the host reads back little per step.

``argmax`` gives the greedy token of every row on the device, and ``nonfinite`` is
``sum(logits - logits)``: 0 when every logit is finite, NaN otherwise. With both in the
captured graph, a greedy step reads back M token ids and one float instead of M x vocab
logits, and non-finite logits still raise instead of producing text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnx_genrt.core.errors import ModelLoadError

if TYPE_CHECKING:  # onnx is imported when a model is read, not with the engine
    import onnx

ARGMAX = "onnx_genrt.argmax"
NONFINITE = "onnx_genrt.nonfinite"


def add_decode_heads(model: onnx.ModelProto, logits: str) -> onnx.ModelProto:
    """Return ``model`` with the argmax and non-finite outputs appended (in place)."""
    from onnx import TensorProto, helper

    graph = model.graph
    if any(o.name == ARGMAX for o in graph.output):
        return model
    found = [o for o in graph.output if o.name == logits]
    if not found:
        raise ModelLoadError(
            f"the model has no output {logits!r} (genai_config.json model.decoder.outputs.logits)"
        )
    declared = found[0].type.tensor_type
    logits_type = declared.elem_type or TensorProto.FLOAT
    diff = "onnx_genrt.logits_minus_logits"
    graph.node.extend(
        [
            helper.make_node(
                "ArgMax", [logits], [ARGMAX], name="onnx_genrt/argmax", axis=-1, keepdims=0
            ),
            helper.make_node("Sub", [logits, logits], [diff], name="onnx_genrt/nonfinite_sub"),
            helper.make_node(
                "ReduceSum", [diff], [NONFINITE], name="onnx_genrt/nonfinite_sum", keepdims=0
            ),
        ]
    )
    graph.output.extend(
        [
            helper.make_tensor_value_info(ARGMAX, TensorProto.INT64, _leading_dims(declared)),
            helper.make_tensor_value_info(NONFINITE, logits_type, []),
        ]
    )
    return model


def _leading_dims(declared: onnx.TypeProto.Tensor) -> list[int | str | None] | None:
    """The logits' dims but the vocabulary (ONNX's checker wants a graph output's shape)."""
    if not declared.HasField("shape"):
        return None
    return [
        d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
        for d in declared.shape.dim[:-1]
    ]
