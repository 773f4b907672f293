"""pytest-benchmark: a 128-token prefill on a 32000-token vocabulary. Our prefill computes
the last row's logits only (``session.row_tail``); beside it, our prefill of every row's, and
onnxruntime on the same model file (which computes every row's, as the graph says).

``pytest tests/bench --benchmark-enable`` times them; the normal test run executes each
body once and checks each row's last logits against onnxruntime's.
"""

from __future__ import annotations

import numpy as np
import pytest

from ..llm_fixtures import TINY_QWEN2, build_qwen2

CONFIG = {
    **TINY_QWEN2,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "vocab_size": 32000,
    "initializer_range": 0.02,
}
PROMPT = np.random.default_rng(0).integers(1, CONFIG["vocab_size"], 128).tolist()


@pytest.fixture(scope="module")
def folder():
    return build_qwen2(CONFIG)


def _ours(folder, last_row: bool):
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.decoder import DecoderRunner

    model = Model(folder)

    def once() -> np.ndarray:
        runner = DecoderRunner(model.session, model.config, len(PROMPT) + 1)
        runner.prefill_last_row = last_row
        return np.array(runner.forward(PROMPT, None).logits[-1], copy=True)

    return once


def _onnxruntime(folder):
    import onnxruntime as ort

    from onnx_genrt.engine.config import load_config

    cfg = load_config(folder)
    sess = ort.InferenceSession(str(cfg.model_path), providers=["CPUExecutionProvider"])
    feeds = {
        cfg.io.input_ids: np.array([PROMPT], np.int64),
        cfg.io.attention_mask: np.ones((1, len(PROMPT)), np.int64),
    }
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), np.float32)

    def once() -> np.ndarray:
        return sess.run([cfg.io.logits], feeds)[0][0, -1]

    return once


ROWS = {
    "onnx-genrt-last-row": lambda f: _ours(f, True),
    "onnx-genrt-every-row": lambda f: _ours(f, False),
    "onnxruntime": _onnxruntime,
}


@pytest.mark.benchmark(group="prefill-128-tokens-vocab-32000")
@pytest.mark.parametrize("row", list(ROWS))
def test_prefill(benchmark, folder, row):
    once = ROWS[row](folder)
    once()  # warm-up: plans memory, compiles
    logits = benchmark(once)
    want = _onnxruntime(folder)()
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
