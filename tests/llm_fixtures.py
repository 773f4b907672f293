"""Random-weight LLM fixtures, built in seconds and cached on disk.

Models come from a transformers config with a fixed seed, saved with ``save_pretrained``
and converted by onnxruntime-genai's model builder: the format most ONNX LLMs ship in
(GroupQueryAttention, SkipSimplifiedLayerNormalization, genai_config.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
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

#: Gemma-2 shape: local (sliding-window) and global layers alternate, attention and final
#: logit softcaps. The window (8) is far shorter than a prompt plus 32 new tokens.
TINY_GEMMA2 = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 16,
    # A tied lm_head reads back the (sqrt(hidden)-scaled) input embedding: greedy text then
    # repeats the prompt's last token whatever the layers do.
    "tie_word_embeddings": False,
}


#: About 52M parameters (hidden 768, 8 layers, MLP 1792, vocabulary 4096, untied lm_head):
#: the int4 build's weights file is about 43 MB, its embedding float32 (Gather). The memory
#: and import figures of docs/performance.md use it (``memory_model``, scripts/memory_bench.py).
MEMORY_QWEN2 = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 1792,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def cache_root() -> Path:
    root = os.environ.get("ONNX_GENRT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "onnx_genrt"
    )
    return Path(root) / "fixtures"


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """One process at a time makes ``folder`` (pytest-xdist workers, lanes run side by side):
    an advisory lock on its ``.lock`` sibling, released when the block ends."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(folder: Path, ready: str, build: Callable[[Path], None]) -> Path:
    """``folder``, holding the file ``ready``: made once by ``build(private_folder)`` under
    ``_exclusive`` and renamed into place, so a concurrent caller waits and then reuses it,
    and none sees a folder half made. A folder an interrupted run left without ``ready`` is
    made again."""
    with _exclusive(folder):
        if (folder / ready).is_file():
            return folder
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".", suffix=".tmp"))
        try:
            build(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def build_qwen2(
    config: dict,
    precision: str = "fp32",
    seed: int = 0,
    hidden_states: bool = True,
    target: str = "cpu",
) -> Path:
    """Folder with model.onnx + genai_config.json for a random Qwen2 (built once, then cached).
    ``target``: the builder's execution provider (``cuda`` builds bf16 with GroupQueryAttention,
    where ``cpu`` writes MultiHeadAttention)."""
    import onnxruntime_genai

    parts = [config, precision, seed, hidden_states, onnxruntime_genai.__version__]
    if target != "cpu":  # the cpu key stays as it was: caches remain valid
        parts.append(target)
    key = json.dumps(parts, sort_keys=True)
    tag = precision if target == "cpu" else f"{precision}-{target}"
    folder = cache_root() / f"qwen2-{tag}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (folder / "genai_config.json").is_file():
        return folder
    hf = _publish(
        folder.with_name(folder.name + "-hf"),
        "config.json",
        lambda out: _save_hf(config, seed, out),
    )
    extra = ["include_hidden_states=true"] if hidden_states else []
    return _publish(
        folder,
        "genai_config.json",
        lambda out: _run_builder(hf, out, precision, extra, target),
    )


def _save_hf(config: dict, seed: int, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    model.eval()
    model.save_pretrained(out)


def memory_model() -> Path:
    """``MEMORY_QWEN2`` built in int4, with the embedded model's tokenizer (4096 tokens)
    so that text prompts encode: a copy of the build, made once."""
    from onnx_genrt.models import default_model_path

    built = build_qwen2(MEMORY_QWEN2, "int4")
    folder = built.with_name(built.name + "-tok")

    def copy(out: Path) -> None:
        shutil.copytree(built, out, dirs_exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(default_model_path() / name, out / name)

    return _publish(folder, "genai_config.json", copy)


def build_gemma2(config: dict, seed: int = 0) -> Path:
    """Folder with model.onnx + genai_config.json for a random Gemma-2 (built once, then
    cached): the builder's CPU fp32 model, GroupQueryAttention with local_window_size,
    softcap and sliding_window_cache=1 on the local layers."""
    import onnxruntime_genai

    key = json.dumps([config, seed, "gemma2-normal-v1", onnxruntime_genai.__version__])
    folder = cache_root() / f"gemma2-fp32-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (folder / "genai_config.json").is_file():
        return folder
    hf = _publish(
        folder.with_name(folder.name + "-hf"),
        "config.json",
        lambda out: _save_gemma2(config, seed, out),
    )
    return _publish(folder, "genai_config.json", lambda out: _run_builder(hf, out, "fp32", []))


def _save_gemma2(config: dict, seed: int, out: Path) -> None:
    """A Gemma-2 checkpoint with every weight drawn at random: matrices N(0, 1/fan_in), the
    embedding N(0, 1), norm weights N(0, 0.09). transformers' own init (zero norm weights,
    0.02 matrices) gives greedy text of one repeated token."""
    import math

    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            elif param.ndim == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))
            else:
                param.normal_(0.0, 0.3)
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
    # Written beside and renamed into place: a concurrent reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".model.", suffix=".tmp")
    os.close(fd)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- parity fixtures


def hf_checkpoint(config: dict, seed: int = 0) -> Path:
    """The HF checkpoint (``save_pretrained`` folder) that ``build_qwen2(config, "fp32", seed)``
    converts: the ``-hf`` sibling of the built model, built (and cached) if needed."""
    built = build_qwen2(config, "fp32", seed)
    # The converted model may have been cached without it: made again then.
    return _publish(
        built.with_name(built.name + "-hf"), "config.json", lambda out: _save_hf(config, seed, out)
    )


def build_qwen2_with_options(
    config: dict, precision: str, seed: int = 0, options: dict | None = None
) -> Path:
    """Like ``build_qwen2`` (hidden_states on), with extra builder options such as
    ``{"accuracy_level": 1}``; converts the same HF checkpoint as ``hf_checkpoint``."""

    import onnxruntime_genai

    options = {"include_hidden_states": "true", **(options or {})}
    key = json.dumps(
        [config, precision, seed, options, onnxruntime_genai.__version__], sort_keys=True
    )
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_root() / f"qwen2-{precision}-opts-{tag}"
    if (folder / "genai_config.json").is_file():
        return folder
    hf = hf_checkpoint(config, seed)
    extra = [f"{k}={v}" for k, v in sorted(options.items())]
    return _publish(
        folder, "genai_config.json", lambda out: _run_builder(hf, out, precision, extra)
    )


def export_dynamo(config: dict, seed: int = 0, opset: int = 23) -> Path:
    """``model.onnx`` of the ``hf_checkpoint`` exported by ``torch.onnx.export(dynamo=True)``.

    The graph is a no-cache forward: ``input_ids [1, seq]`` (seq dynamic) to ``logits
    [1, seq, vocab]``, in standard ONNX ops only. Attention runs through SDPA, so at opset
    23 the exporter's optimizer emits Attention, RMSNormalization and RotaryEmbedding; at
    opset 18 it writes them as primitive ops. Cached by config, seed, opset and the
    torch / transformers / onnxscript versions.
    """
    import onnxscript
    import torch
    import transformers

    versions = [torch.__version__, transformers.__version__, onnxscript.__version__]
    key = json.dumps([config, seed, opset, versions], sort_keys=True)
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_root() / f"qwen2-dynamo-opset{opset}-{tag}"
    path = folder / "model.onnx"
    if path.is_file():
        return path
    hf = hf_checkpoint(config, seed)

    def export(out: Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="sdpa"
        )

        class LogitsOnly(torch.nn.Module):
            """``input_ids -> logits`` without a KV cache (the graph re-reads the whole
            sequence)."""

            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.model(input_ids=input_ids, use_cache=False).logits

        wrapper = LogitsOnly().eval()
        ids = torch.tensor([[5, 17, 99, 3, 250, 7]], dtype=torch.int64)
        seq = torch.export.Dim("seq", min=1, max=config["max_position_embeddings"])
        with torch.no_grad():
            program = torch.onnx.export(
                wrapper,
                (ids,),
                dynamo=True,
                opset_version=opset,
                input_names=["input_ids"],
                output_names=["logits"],
                dynamic_shapes=({1: seq},),
                optimize=True,
                verbose=False,
            )
        program.save(str(out / "model.onnx"), external_data=False)

    _publish(folder, "model.onnx", export)
    return path


def greedy_generator(model, prompt: list[int], new: int):
    """Our Generator run greedily for ``new`` tokens with eos ignored; returns it."""
    from onnx_genrt.engine import Generator, GeneratorParams

    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new)
    gen = Generator(model, params)
    gen.eos = set()
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return gen


def _run_builder(
    hf: Path, out: Path, precision: str, extra_options: list[str], target: str = "cpu"
) -> None:
    """onnxruntime-genai's model builder for ``target`` (CPU by default) into a fresh ``out``
    (its cache folder removed after); raises with the builder's output on failure."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        target,
        "-c",
        str(out / "cache"),
    ]
    if extra_options:
        cmd += ["--extra_options", *extra_options]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"model builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    shutil.rmtree(out / "cache", ignore_errors=True)


def spy_device_fed_launches(monkeypatch) -> list[bool]:
    """Record, for every ``DecoderRunner.launch``, whether its inputs were fed on the device
    (``tokens is None``: a pipelined verify step whose ids the MTP chain wrote)."""
    from onnx_genrt.engine.decoder import DecoderRunner

    fed: list[bool] = []
    real_launch = DecoderRunner.launch

    def spy(self, tokens, *args, **kwargs):
        fed.append(tokens is None)
        return real_launch(self, tokens, *args, **kwargs)

    monkeypatch.setattr(DecoderRunner, "launch", spy)
    return fed


def nan_token_copy(source: Path, target: Path, token: int) -> Path:
    """A copy of the builder decoder in ``source`` whose embedding row of ``token`` is NaN
    (its own copy of the tied table): steps that feed the token, or attend to it, give
    non-finite logits; others are unchanged."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("draft", "mtp", "spec*"))
    proto = onnx.load(target / "model.onnx")
    graph = proto.graph
    gather = next(n for n in graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    weight = next(i for i in graph.initializer if i.name == "lm_head.MatMul.weight")
    table = numpy_helper.to_array(weight).T.copy()  # [vocab, hidden]
    table[token] = np.nan
    graph.initializer.append(numpy_helper.from_array(table, "nan_embedding"))
    gather.input[0] = "nan_embedding"
    (target / "model.onnx.data").unlink()
    onnx.save(proto, target / "model.onnx")  # small enough to hold its weights inline
    return target


def ort_forced(
    folder: Path,
    prompt: list[int],
    continuation: list[int],
    past_length: Callable[[int], int] = lambda layer: 0,
) -> np.ndarray:
    """onnxruntime on a model folder (CPU, growing KV cache), teacher-forced: prefill
    ``prompt``, then feed ``continuation`` one token a step. Logits ``[P + C, vocab]``.
    ``past_length(layer)``: the positions of that layer's first past (a window-sized cache
    starts at the window, as small as onnxruntime allows; a growing one at 0)."""
    import onnxruntime as ort

    from onnx_genrt.engine import load_config

    cfg = load_config(folder)
    sess = ort.InferenceSession(str(cfg.model_path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    past = {
        i.name: np.zeros(
            (1, cfg.num_kv_heads, past_length(int(i.name.split(".")[1])), cfg.head_size),
            np.float32,
        )
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values")
    }
    rows, feed, length = [], list(prompt), 0
    for nxt in [*continuation, None]:
        length += len(feed)
        feeds = {
            "input_ids": np.array([feed], np.int64),
            "attention_mask": np.ones((1, length), np.int64),
            **past,
        }
        results = dict(zip(outputs, sess.run(None, feeds), strict=True))
        rows.append(results["logits"][0])
        past = {k: results[k.replace("past_key_values", "present")] for k in past}
        feed = [nxt]
    return np.concatenate(rows)
