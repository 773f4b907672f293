"""Unroll an MTP head k times into one graph, so a whole draft chain is one (graphed) run.

Step i feeds the head its previous hidden output and the argmax of its previous logits, all
on the device. The chain outputs ``drafts`` [1, k] (int64) and ``confidences`` [1, k] (the
softmax probability of each draft); the host reads back 2k numbers per speculative step
instead of running the head k times with a round trip each.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DRAFTS = "drafts"
CONFIDENCES = "confidences"


def unroll_mtp_head(
    head: onnx.ModelProto,
    k: int,
    hidden_input: str = "hidden_states",
    ids_input: str = "input_ids",
    logits_output: str = "logits",
    hidden_output: str = "mtp_hidden_states",
) -> onnx.ModelProto:
    """A model with inputs (hidden_input [1,1,H], ids_input [1,1]) and outputs drafts and
    confidences, running ``head`` k times in a chain. Weights are shared, not copied."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    g = head.graph
    weights = {init.name for init in g.initializer}
    graph_inputs = {hidden_input, ids_input}
    missing = graph_inputs - {i.name for i in g.input}
    if missing:
        raise ValueError(f"the MTP head has no input {sorted(missing)}")
    opset = next((o.version for o in head.opset_import if o.domain in ("", "ai.onnx")), 18)
    nodes: list[onnx.NodeProto] = []
    axes = "mtp_chain/axes_last"
    extra_inits = [numpy_helper.from_array(np.array([-1], np.int64), axes)]
    drafts, confs = [], []
    hidden, ids = hidden_input, ids_input
    for step in range(k):
        prefix = f"mtp{step}/"

        def rename(name: str, hidden: str = hidden, ids: str = ids, prefix: str = prefix) -> str:
            if not name or name in weights:
                return name
            if name == hidden_input:
                return hidden
            if name == ids_input:
                return ids
            return prefix + name

        for index, node in enumerate(g.node):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = prefix + (node.name or f"{node.op_type}_{index}")
            copy.input[:] = [rename(n) for n in node.input]
            copy.output[:] = [rename(n) for n in node.output]
            nodes.append(copy)
        logits = prefix + logits_output
        token = prefix + "draft"
        probs, conf = prefix + "probs", prefix + "confidence"
        named = {"name": prefix + "chain"}
        nodes.append(helper.make_node("ArgMax", [logits], [token], axis=-1, keepdims=0, **named))
        nodes.append(
            helper.make_node("Softmax", [logits], [probs], axis=-1, name=prefix + "softmax")
        )
        if opset >= 18:
            nodes.append(
                helper.make_node(
                    "ReduceMax", [probs, axes], [conf], keepdims=0, name=prefix + "conf"
                )
            )
        else:
            nodes.append(
                helper.make_node(
                    "ReduceMax", [probs], [conf], axes=[-1], keepdims=0, name=prefix + "conf"
                )
            )
        drafts.append(token)
        confs.append(conf)
        hidden, ids = prefix + hidden_output, token
    nodes.append(helper.make_node("Concat", drafts, [DRAFTS], axis=1, name="mtp_chain/drafts"))
    nodes.append(helper.make_node("Concat", confs, [CONFIDENCES], axis=1, name="mtp_chain/conf"))
    inputs = [i for i in g.input if i.name in graph_inputs]
    outputs = [
        helper.make_tensor_value_info(DRAFTS, TensorProto.INT64, [1, k]),
        helper.make_tensor_value_info(CONFIDENCES, TensorProto.FLOAT, [1, k]),
    ]
    graph = helper.make_graph(
        nodes, f"{g.name}_chain{k}", inputs, outputs, list(g.initializer) + extra_inits
    )
    model = helper.make_model(graph, opset_imports=list(head.opset_import))
    model.ir_version = head.ir_version
    return model
