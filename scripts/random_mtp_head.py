"""Add a random-weight MTP head to a builder-format model folder, for timing only.

    python scripts/random_mtp_head.py MODEL_DIR [--intermediate 4864] [--seed 0]
                                                [--draft-vocab N]

The head has the embedded model's structure (``scripts/default_model_mtp.py``): RMSNorm of
the hidden state and of the next token's embedding, a projection of their concatenation, a
SwiGLU block with a residual, a final RMSNorm and an lm_head. It is written with standard
ops plus SimplifiedLayerNormalization, in the dtype of the model's ``hidden_states`` output,
to ``MODEL_DIR/mtp/model.onnx``; ``speculative.json`` gains its ``mtp`` entry. The model must
expose hidden states (builder ``--extra_options include_hidden_states=true``). With random
weights the acceptance is meaningless: use it for the verify + MTP step cost
(``onnx-genrt step-cost``), not for tok/s. ``--draft-vocab N`` restricts the chained draft
steps' lm_head to the first N token ids (``speculative.json``'s ``mtp.draft_vocab``, as the
embedded model's head does with its ranked ids): each step then reads N rows of the lm_head
instead of the whole vocabulary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_head(hidden: int, intermediate: int, vocab: int, dtype: np.dtype, seed: int):
    """The head as an ONNX model: (hidden_states [1,1,H], input_ids [1,1]) -> logits, hidden."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, std: float = 0.02) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * std).astype(dtype), name)

    def ones(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(np.ones(hidden, dtype), name)

    def norm(x: str, w: str, y: str) -> onnx.NodeProto:
        return helper.make_node("SimplifiedLayerNormalization", [x, w], [y], axis=-1, epsilon=1e-6)

    inits = [
        weight("embed", vocab, hidden),
        weight("proj", 2 * hidden, hidden),
        weight("gate", hidden, intermediate),
        weight("up", hidden, intermediate),
        weight("down", intermediate, hidden),
        weight("lm_head", hidden, vocab),
        *(ones(n) for n in ("w_hidden", "w_embed", "w_mlp", "w_final")),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["e"]),
        norm("hidden_states", "w_hidden", "hn"),
        norm("e", "w_embed", "en"),
        helper.make_node("Concat", ["hn", "en"], ["c"], axis=-1),
        helper.make_node("MatMul", ["c", "proj"], ["x"]),
        norm("x", "w_mlp", "y"),
        helper.make_node("MatMul", ["y", "gate"], ["g"]),
        helper.make_node("MatMul", ["y", "up"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["sg"]),
        helper.make_node("Mul", ["g", "sg"], ["act"]),
        helper.make_node("Mul", ["act", "u"], ["m"]),
        helper.make_node("MatMul", ["m", "down"], ["d"]),
        helper.make_node("Add", ["x", "d"], ["r"]),
        norm("r", "w_final", "mtp_hidden_states"),
        helper.make_node("MatMul", ["mtp_hidden_states", "lm_head"], ["logits"]),
    ]
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        nodes,
        "random_mtp_head",
        [
            helper.make_tensor_value_info("hidden_states", t, [1, 1, hidden]),
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1]),
        ],
        [
            helper.make_tensor_value_info("logits", t, [1, 1, vocab]),
            helper.make_tensor_value_info("mtp_hidden_states", t, [1, 1, hidden]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", type=Path, help="builder-format model folder (genai_config.json)")
    p.add_argument(
        "--intermediate", type=int, default=None, help="SwiGLU width (default 4x hidden)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="draft over the first N token ids (default: the whole vocabulary)",
    )
    a = p.parse_args()
    config_path = a.model / "genai_config.json"
    config = json.loads(config_path.read_text())
    decoder = config["model"]["decoder"]
    hidden, vocab = int(decoder["hidden_size"]), int(config["model"]["vocab_size"])
    base = onnx.load(a.model / decoder["filename"], load_external_data=False)
    outputs = {o.name: o for o in base.graph.output}
    if "hidden_states" not in outputs:
        raise SystemExit(
            f"{a.model}: the model has no hidden_states output; build it with "
            "--extra_options include_hidden_states=true"
        )
    elem = outputs["hidden_states"].type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    decoder.setdefault("outputs", {})["hidden_states"] = "hidden_states"
    config_path.write_text(json.dumps(config, indent=4))
    head = build_head(hidden, a.intermediate or 4 * hidden, vocab, dtype, a.seed)
    (a.model / "mtp").mkdir(exist_ok=True)
    onnx.save(head, a.model / "mtp" / "model.onnx")
    spec_path = a.model / "speculative.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
    spec["mtp"] = {
        "filename": "mtp/model.onnx",
        "hidden_states": "hidden_states",
        "inputs": {"hidden_states": "hidden_states", "input_ids": "input_ids"},
        "outputs": {"logits": "logits", "hidden_states": "mtp_hidden_states"},
    }
    if a.draft_vocab is not None:
        if not 1 <= a.draft_vocab <= vocab:
            raise SystemExit(f"--draft-vocab {a.draft_vocab}: must be 1..{vocab}")
        spec["mtp"]["draft_vocab"] = a.draft_vocab
    spec_path.write_text(json.dumps(spec, indent=4))
    drafts = f", drafts over the first {a.draft_vocab} ids" if a.draft_vocab else ""
    print(
        f"{a.model}: random MTP head ({dtype}, hidden {hidden}, vocab {vocab}{drafts}) "
        "in mtp/model.onnx"
    )


if __name__ == "__main__":
    main()
