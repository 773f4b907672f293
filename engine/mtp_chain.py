"""Unroll an MTP head k times into one graph, so a whole draft chain is one (graphed) run.

Step i feeds the head its previous hidden output and the argmax of its previous logits, all
on the device. The chain outputs ``drafts`` [1, k] (int64) and ``confidences`` [1, k] (the
softmax probability of each draft); the host reads back 2k numbers per speculative step
instead of running the head k times with a round trip each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.core.kernels import GENRT_DOMAIN

if TYPE_CHECKING:  # onnx is imported when a chain is built, not with the engine
    import onnx

DRAFTS = "drafts"
CONFIDENCES = "confidences"


def unroll_mtp_head(
    head: onnx.ModelProto,
    k: int,
    hidden_input: str = "hidden_states",
    ids_input: str = "input_ids",
    logits_output: str = "logits",
    hidden_output: str = "mtp_hidden_states",
    draft_ids: np.ndarray | None = None,
) -> onnx.ModelProto:
    """A model with inputs (hidden_input [B,1,H], ids_input [B,1]) and outputs drafts and
    confidences [B, k], running ``head`` k times in a chain (B: 1, or a batch's rows). Weights are shared, not copied.
    ``draft_ids``: the token id of each logit column (a head restricted to a ranked draft
    vocabulary, ``restrict_draft_vocab``); each step's argmax is mapped through it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if k < 1:
        raise InvalidInputError(f"k (drafts per speculative step) must be >= 1, got {k}")
    g = head.graph
    weights = {init.name for init in g.initializer}
    graph_inputs = {hidden_input, ids_input}
    missing = graph_inputs - {i.name for i in g.input}
    if missing:
        raise ModelLoadError(f"the MTP head has no input {sorted(missing)}")
    opset = next((o.version for o in head.opset_import if o.domain in ("", "ai.onnx")), 18)
    nodes: list[onnx.NodeProto] = []
    axes = "mtp_chain/axes_last"
    extra_inits = [numpy_helper.from_array(np.array([-1], np.int64), axes)]
    id_map = "mtp_chain/draft_ids"
    if draft_ids is not None:
        extra_inits.append(numpy_helper.from_array(np.asarray(draft_ids, np.int64), id_map))
    constants, hoisted = _constant_nodes(g, weights)
    for index in sorted(hoisted):  # computed once (folded at load), read by every step
        copy = onnx.NodeProto()
        copy.CopyFrom(g.node[index])
        copy.name = "mtp_chain/" + (copy.name or f"{copy.op_type}_{index}")
        nodes.append(copy)
    drafts, confs = [], []
    hidden, ids = hidden_input, ids_input
    for step in range(k):
        prefix = f"mtp{step}/"

        def rename(name: str, hidden: str = hidden, ids: str = ids, prefix: str = prefix) -> str:
            if not name or name in constants:
                return name
            if name == hidden_input:
                return hidden
            if name == ids_input:
                return ids
            return prefix + name

        for index, node in enumerate(g.node):
            if index in hoisted:
                continue
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
        if draft_ids is None:
            nodes.append(
                helper.make_node("ArgMax", [logits], [token], axis=-1, keepdims=0, **named)
            )
        else:  # the argmax is a column of the ranked vocabulary: its id
            column = prefix + "draft_column"
            nodes.append(
                helper.make_node("ArgMax", [logits], [column], axis=-1, keepdims=0, **named)
            )
            nodes.append(
                helper.make_node("Gather", [id_map, column], [token], name=prefix + "draft_id")
            )
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
    logits_type = next(
        (o.type.tensor_type.elem_type for o in g.output if o.name == logits_output),
        TensorProto.FLOAT,
    )
    if logits_type == TensorProto.FLOAT:
        nodes.append(
            helper.make_node("Concat", confs, [CONFIDENCES], axis=1, name="mtp_chain/conf")
        )
    else:  # fp16 / bf16 logits: the chain still returns float32 confidences
        cat = "mtp_chain/conf_cat"
        nodes.append(helper.make_node("Concat", confs, [cat], axis=1, name="mtp_chain/conf"))
        nodes.append(helper.make_node("Cast", [cat], [CONFIDENCES], to=TensorProto.FLOAT))
    inputs = [i for i in g.input if i.name in graph_inputs]
    outputs = [  # one row per batch row of the inputs (a batch's rows propose together)
        helper.make_tensor_value_info(DRAFTS, TensorProto.INT64, ["batch", k]),
        helper.make_tensor_value_info(CONFIDENCES, TensorProto.FLOAT, ["batch", k]),
    ]
    graph = helper.make_graph(
        nodes, f"{g.name}_chain{k}", inputs, outputs, list(g.initializer) + extra_inits
    )
    model = helper.make_model(graph, opset_imports=list(head.opset_import))
    model.ir_version = head.ir_version
    return model


#: Ops whose output differs between runs of the same inputs: never hoisted out of the steps.
_RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip


def _constant_nodes(graph: onnx.GraphProto, weights: set[str]) -> tuple[set[str], set[int]]:
    """The values computed from the weights alone (the weights included) and the indices of
    the nodes computing them (a Cast or Transpose of a weight): the chain runs those once,
    so its steps share one folded copy instead of one per step."""
    constants, hoisted = set(weights), set()
    for index, node in enumerate(graph.node):
        if node.op_type in _RANDOM_OPS or node.domain not in ("", "ai.onnx"):
            continue
        if all(not name or name in constants for name in node.input):
            hoisted.add(index)
            constants.update(name for name in node.output if name)
    return constants, hoisted


def restrict_draft_vocab(
    head: onnx.ModelProto, vocab: int | np.ndarray, logits_output: str = "logits"
) -> onnx.ModelProto:
    """``head`` drafting only from a draft vocabulary (as in FR-Spec): ``vocab`` an int, the
    first that many token ids; an array, those token ids (ranked by frequency, say; the
    chain then maps each argmax column back through them: ``unroll_mtp_head``'s
    ``draft_ids``). The MatMul making ``logits_output`` reads only those columns of its
    weight, which constant folding then cuts, so each chained head step multiplies by a
    smaller lm_head. Verification is unchanged, so the output is too."""
    import onnx
    from onnx import helper, numpy_helper

    ranked = None if isinstance(vocab, int) else np.asarray(vocab, np.int64).reshape(-1)
    size = vocab if ranked is None else int(ranked.size)
    if size < 1:
        raise InvalidInputError(f"a draft vocabulary needs at least 1 token, got {size}")
    h = onnx.ModelProto()
    h.CopyFrom(head)
    g = h.graph
    producer = next((n for n in g.node if logits_output in n.output), None)
    if producer is None or producer.op_type != "MatMul" or producer.domain not in ("", "ai.onnx"):
        kind = "nothing" if producer is None else f"a {producer.op_type}"
        raise InvalidInputError(
            f"a draft vocabulary needs {logits_output!r} to come from a MatMul; {kind} makes it"
        )
    weight = producer.input[1]
    sliced = f"{weight}/draft_vocab"
    index = list(g.node).index(producer)
    if ranked is None:
        names = [f"draft_vocab/{n}" for n in ("starts", "ends", "axes")]
        g.initializer.extend(
            numpy_helper.from_array(np.array([v], np.int64), n)
            for n, v in zip(names, (0, size, -1), strict=True)
        )
        cut = helper.make_node("Slice", [weight, *names], [sliced], name="draft_vocab")
    else:
        g.initializer.append(numpy_helper.from_array(ranked, "draft_vocab/ids"))
        cut = helper.make_node(
            "Gather", [weight, "draft_vocab/ids"], [sliced], axis=-1, name="draft_vocab"
        )
    g.node.insert(index, cut)
    producer.input[1] = sliced
    for out in g.output:
        dims = out.type.tensor_type.shape.dim
        if out.name == logits_output and dims:
            dims[-1].Clear()
            dims[-1].dim_value = size
    return h


#: Inputs and output of a chain that runs right after a verify step (see ``after_verify``).
VERIFY_IDS = "verify_input_ids"
VERIFY_ARGMAX = "verify_argmax"
VERIFY_HIDDEN = "verify_hidden_states"
DRAFT_COUNT = "draft_count"
ACCEPTED = "accepted_count"


def after_verify(
    chain: onnx.ModelProto,
    k: int,
    hidden_input: str = "hidden_states",
    ids_input: str = "input_ids",
    verify_hidden_type: int = DType.FLOAT32.value,
) -> onnx.ModelProto:
    """``chain`` fed straight from a verify step of width ``k + 1``, on the device.

    Inputs: the verify step's ids [1, k+1], its argmax [1, k+1] and hidden states
    [1, k+1, H], and the number of real drafts [1]. One ``onnx_genrt::MTPAccept`` node counts
    the accepted drafts (the leading run of ``argmax[i] == ids[i + 1]`` among the real ones)
    and takes the hidden row and argmax at that count (the state that predicts the new
    pending token); the chain runs from there. Outputs: the chain's drafts and confidences,
    and ``accepted_count``. So one verify replay, one chain replay and one read-back make a
    speculative step. Where no provider has MTPAccept, placement runs its standard-op body
    (``core.genrt_ops``).
    """
    from onnx import TensorProto, helper

    g = chain.graph
    by_name = {i.name: i for i in g.input}
    if hidden_input not in by_name or ids_input not in by_name:
        raise ModelLoadError(f"the chain has no inputs {hidden_input!r} and {ids_input!r}")
    hidden_type = by_name[hidden_input].type.tensor_type.elem_type
    hidden_size = by_name[hidden_input].type.tensor_type.shape.dim[-1]
    i64 = TensorProto.INT64
    accept = helper.make_node(
        "MTPAccept",
        [VERIFY_IDS, VERIFY_ARGMAX, VERIFY_HIDDEN, DRAFT_COUNT],
        [ACCEPTED, ids_input, hidden_input],
        name="accept/MTPAccept",
        domain=GENRT_DOMAIN,
        to=hidden_type,
    )
    width = k + 1
    dim = hidden_size.dim_value if hidden_size.HasField("dim_value") else "hidden"
    inputs = [
        helper.make_tensor_value_info(VERIFY_IDS, i64, [1, width]),
        helper.make_tensor_value_info(VERIFY_ARGMAX, i64, [1, width]),
        helper.make_tensor_value_info(VERIFY_HIDDEN, verify_hidden_type, [1, width, dim]),
        helper.make_tensor_value_info(DRAFT_COUNT, i64, [1]),
    ]
    # one sequence: the chain's [batch, k] outputs are [1, k] here
    outputs = [
        *(
            helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, [1, k])
            if o.name in (DRAFTS, CONFIDENCES)
            else o
            for o in g.output
        ),
        helper.make_tensor_value_info(ACCEPTED, i64, [1]),
    ]
    graph = helper.make_graph(
        [accept, *g.node], f"{g.name}_after_verify", inputs, outputs, list(g.initializer)
    )
    model = helper.make_model(graph, opset_imports=_with_genrt(chain.opset_import))
    model.ir_version = chain.ir_version
    return model


#: Input and outputs of an after-verify chain that also writes the next verify's inputs.
VERIFY_START = "verify_start"
NEXT_IDS = "next_input_ids"
NEXT_POSITIONS = "next_position_ids"
NEXT_MASK = "next_attention_mask"
NEXT_COUNT = "next_draft_count"
NEXT_START = "next_verify_start"


def with_next_inputs(
    after: onnx.ModelProto,
    k: int,
    min_confidence: float,
    mask_length: int | None,
    positions: bool,
    ids_input: str = "input_ids",
) -> onnx.ModelProto:
    """``after`` (from :func:`after_verify`) that also writes the next verify step's inputs.

    New input: ``verify_start`` [1], the cache length the verify step started at. New
    outputs, written by one ``onnx_genrt::MTPNextInputs`` node: the next step's start
    (``start + accepted + 1``), its ids (the new pending token and the chain's k drafts), its
    position ids and attention mask (when the decoder takes them) and its real draft count
    (the leading drafts with confidence >= ``min_confidence``, as ``MTPProposer.confident``
    counts them). Bound to the decoder's own input buffers, they let the next verify be
    queued before the host has read this one back.
    """
    from onnx import TensorProto, helper

    g = after.graph
    i64 = TensorProto.INT64
    outputs = [
        helper.make_tensor_value_info(NEXT_START, i64, [1]),
        helper.make_tensor_value_info(NEXT_IDS, i64, [1, k + 1]),
        helper.make_tensor_value_info(NEXT_COUNT, i64, [1]),
    ]
    if positions:
        outputs.append(helper.make_tensor_value_info(NEXT_POSITIONS, i64, [1, k + 1]))
    if mask_length is not None:
        outputs.append(helper.make_tensor_value_info(NEXT_MASK, i64, [1, mask_length]))
    names = [NEXT_START, NEXT_IDS, NEXT_COUNT]
    names += [NEXT_POSITIONS if positions else "", NEXT_MASK if mask_length is not None else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node(
        "MTPNextInputs",
        [ACCEPTED, VERIFY_START, ids_input, DRAFTS, CONFIDENCES],
        names,
        name="next/MTPNextInputs",
        domain=GENRT_DOMAIN,
        min_confidence=float(min_confidence),
        mask_length=int(mask_length or 0),
    )
    graph = helper.make_graph(
        [*g.node, node],
        f"{g.name}_next",
        [*g.input, helper.make_tensor_value_info(VERIFY_START, i64, [1])],
        [*g.output, *outputs],
        list(g.initializer),
    )
    model = helper.make_model(graph, opset_imports=_with_genrt(after.opset_import))
    model.ir_version = after.ir_version
    return model


def _with_genrt(opsets) -> list:
    from onnx import helper

    opsets = list(opsets)
    if all(o.domain != GENRT_DOMAIN for o in opsets):
        opsets.append(helper.make_opsetid(GENRT_DOMAIN, 1))
    return opsets
