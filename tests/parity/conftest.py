"""Parity fixtures: one random Qwen2 checkpoint, seen through every format we run.

The HF checkpoint (``hf_checkpoint``) is the single source of weights: the builder's fp32
and int4 models convert it, and ``export_dynamo`` exports it to standard ONNX. All
artifacts are cached on disk by ``tests/llm_fixtures.py``; the HF reference results
(greedy tokens and logits) are computed once per session here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ..llm_fixtures import (
    TINY_QWEN2,
    build_qwen2,
    build_qwen2_with_options,
    export_dynamo,
    greedy_generator,
    hf_checkpoint,
    ort_forced,  # noqa: F401 (the parity tests import it from here)
)

PROMPTS = [[5, 17, 99, 3, 250, 7], [300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
#: TINY_QWEN2 with an embedding table of its own, which the int4 builder keeps in float
#: (a plain Gather): the accuracy_level 4 parity model (tests/parity/test_int4.py says why).
UNTIED_QWEN2 = {**TINY_QWEN2, "tie_word_embeddings": False}
NEW_TOKENS = 64
DECODE_STEPS = 12


# ----------------------------------------------------------------------------- references


@dataclass
class HFGreedy:
    """HF ``generate`` (greedy, 64 new tokens) of one prompt and the logits of its steps."""

    prompt: list[int]
    new: list[int]  # the 64 new tokens
    step_logits: np.ndarray  # [64, vocab]: row i chose new[i] (row 0 is the prefill's last)
    prefill_logits: np.ndarray  # [len(prompt), vocab]

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.new


def hf_forward(model, ids: list[int]) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` of one no-cache HF forward over ``ids``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.int64), use_cache=False)
    return out.logits[0].numpy()


def engine_greedy(model, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """Our DecoderRunner, greedy: prefill ``prompt``, then ``steps`` one-token decode steps
    (replayed from the PRIMARY graph slot, as Generator does).

    Returns the logits ``[len(prompt) + steps, vocab]`` (the prefill's rows, then one row per
    step) and the ``steps + 1`` greedy tokens (argmax of the rows from the prompt's last on).
    """
    from onnx_genrt.core.graph_slots import DeviceGraphSlot
    from onnx_genrt.engine.decoder import DecoderRunner

    runner = DecoderRunner(model.session, model.config, len(prompt) + steps + 1)
    runner.prefill_last_row = False  # every prompt row's logits, to compare them all
    rows = [runner.forward(prompt, None).logits.copy()]
    tokens = [int(np.argmax(rows[0][-1]))]
    for _ in range(steps):
        row = runner.forward([tokens[-1]], DeviceGraphSlot.PRIMARY).logits.copy()
        rows.append(row)
        tokens.append(int(np.argmax(row[-1])))
    return np.concatenate(rows), tokens


def engine_generate(model, prompt: list[int], new: int) -> list[int]:
    """New tokens from our Generator, greedy, with eos ignored."""
    return greedy_generator(model, prompt, new).get_sequence()[len(prompt) :]


def genai_forced(folder: Path, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """onnxruntime-genai's last-row logits after the prompt and after each fed token:
    ``[1 + C, vocab]`` (teacher-forced through ``append_tokens``)."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(continuation) + 1, do_sample=False)
    gen = og.Generator(model, params)
    rows = []
    for feed in [prompt, *([t] for t in continuation)]:
        gen.append_tokens(feed)
        rows.append(np.array(gen.get_logits(), np.float32).reshape(-1)[None])
    return np.concatenate(rows)


def genai_generate(folder: Path, prompt: list[int], new: int) -> list[int]:
    """New tokens from onnxruntime-genai, greedy, for exactly ``new`` tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = len(prompt) + new
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt) :]


#: Largest logit difference each parity test measured (printed at the end of the run).
MEASURED: dict[str, float] = {}


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]
    MEASURED[test] = max(MEASURED.get(test, 0.0), diff)
    return diff


def pytest_terminal_summary(terminalreporter) -> None:
    """The measured maximum absolute logit differences, for closing notes and reviews."""
    if MEASURED:
        terminalreporter.section("parity: max |logit difference| per test")
        for test, diff in sorted(MEASURED.items()):
            terminalreporter.write_line(f"{diff:10.3e}  {test}")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def hf_dir() -> Path:
    return hf_checkpoint(TINY_QWEN2)


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model) -> dict[tuple[int, ...], HFGreedy]:
    """HF greedy decoding of every prompt: 64 new tokens and the logits of each step."""
    import torch

    refs = {}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        new = [int(t) for t in out.sequences[0, len(prompt) :]]
        logits = torch.cat(out.logits).numpy()
        refs[tuple(prompt)] = HFGreedy(prompt, new, logits, hf_forward(hf_model, prompt))
    return refs


@pytest.fixture(scope="session")
def fp32_dir(hf_dir) -> Path:
    """The builder's fp32 model of ``hf_dir`` (GroupQueryAttention, SkipSimplifiedLayerNorm)."""
    return build_qwen2(TINY_QWEN2)


@pytest.fixture(scope="session")
def fp32_model(fp32_dir):
    from onnx_genrt.engine import Model

    return Model(fp32_dir)


@pytest.fixture(scope="session")
def int4_dir(hf_dir) -> Path:
    """The builder's int4 model (MatMulNBits accuracy_level 4, the CPU default;
    GatherBlockQuantized for the tied embedding)."""
    return build_qwen2(TINY_QWEN2, "int4")


@pytest.fixture(scope="session")
def int4_fp32acc_dir(hf_dir) -> Path:
    """The same int4 weights with ``accuracy_level=1``: onnxruntime keeps activations fp32."""
    return build_qwen2_with_options(TINY_QWEN2, "int4", options={"accuracy_level": 1})


@pytest.fixture(scope="session")
def int4_untied_dir() -> Path:
    """The builder's int4 model of ``UNTIED_QWEN2`` (accuracy_level 4, float embedding)."""
    return build_qwen2(UNTIED_QWEN2, "int4")


@pytest.fixture(scope="session")
def int4_untied_fp32acc_dir() -> Path:
    """The same int4 weights with ``accuracy_level=1``."""
    return build_qwen2_with_options(UNTIED_QWEN2, "int4", options={"accuracy_level": 1})


@pytest.fixture(scope="session", params=[23, 18], ids=lambda o: f"opset{o}")
def dynamo_onnx(request, hf_dir) -> Path:
    """``torch.onnx.export(dynamo=True)`` of ``hf_dir``: a no-cache ``input_ids -> logits``."""
    pytest.importorskip("onnxscript")
    return export_dynamo(TINY_QWEN2, 0, request.param)
