"""Random-weight LLM fixtures, built in seconds and cached on disk.

Models come from a transformers config with a fixed seed, saved with ``save_pretrained``
and converted by onnxruntime-genai's model builder: the format most ONNX LLMs ship in
(GroupQueryAttention, SkipSimplifiedLayerNormalization, genai_config.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TINY_QWEN2 = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    # Wide random weights give varied greedy text (the default 0.02 repeats one token).
    "initializer_range": 0.3,
}
DRAFT_QWEN2 = {**TINY_QWEN2, "num_hidden_layers": 1, "intermediate_size": 64}


def cache_root() -> Path:
    root = os.environ.get("ONNX_GENRT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "onnx_genrt"
    )
    return Path(root) / "fixtures"


def build_qwen2(
    config: dict, precision: str = "fp32", seed: int = 0, hidden_states: bool = True
) -> Path:
    """Folder with model.onnx + genai_config.json for a random Qwen2 (built once, then cached)."""
    import onnxruntime_genai

    key = json.dumps(
        [config, precision, seed, hidden_states, onnxruntime_genai.__version__], sort_keys=True
    )
    folder = cache_root() / f"qwen2-{precision}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (folder / "genai_config.json").is_file():
        return folder
    hf = folder.with_name(folder.name + "-hf")
    _save_hf(config, seed, hf)
    tmp = folder.with_name(folder.name + ".tmp")
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(tmp),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(tmp / "cache"),
    ]
    if hidden_states:
        cmd += ["--extra_options", "include_hidden_states=true"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"model builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    for leftover in (tmp / "cache",):
        if leftover.exists():
            import shutil

            shutil.rmtree(leftover)
    tmp.rename(folder)
    return folder


def _save_hf(config: dict, seed: int, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    model.eval()
    model.save_pretrained(out)


def random_mtp_head(folder: Path, hidden: int, vocab: int, seed: int = 1) -> Path:
    """A small MTP head in standard ONNX: h' = tanh(h W1 + E[ids] W2); logits = h' E^T."""
    path = folder / "mtp" / "model.onnx"
    if path.is_file():
        return path
    rng = np.random.default_rng(seed)
    inits = {
        "embed": (rng.standard_normal((vocab, hidden)) * 0.5).astype(np.float32),
        "w1": (rng.standard_normal((hidden, hidden)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((hidden, hidden)) * 0.3).astype(np.float32),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["e"]),
        n("MatMul", ["hidden_states", "w1"], ["a"]),
        n("MatMul", ["e", "w2"], ["b"]),
        n("Add", ["a", "b"], ["c"]),
        n("Tanh", ["c"], ["mtp_hidden_states"]),
        n("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        n("MatMul", ["mtp_hidden_states", "embed_t"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mtp_head",
        [
            helper.make_tensor_value_info(
                "hidden_states", TensorProto.FLOAT, ["batch", "seq", hidden]
            ),
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
            helper.make_tensor_value_info(
                "mtp_hidden_states", TensorProto.FLOAT, ["batch", "seq", hidden]
            ),
        ],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path)
    )
    return path
