"""scripts/random_mtp_head.py: the head it writes computes the documented MTP step.

Checked against numpy float64 on the head's own weights, then run as an MTP proposer on a
copy of the embedded model (speculative output must still equal greedy).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from onnx_genrt.engine import Model, generate
from onnx_genrt.generate_cli import default_model_dir
from onnx_genrt.session import InferenceSession

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "random_mtp_head.py"


def _script():
    spec = importlib.util.spec_from_file_location("random_mtp_head", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def test_head_matches_a_float64_reference():
    head = _script().build_head(hidden=32, intermediate=48, vocab=100, dtype=np.float32, seed=3)
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in head.graph.initializer}
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 1, 32)).astype(np.float32)
    ids = np.array([[17]], np.int64)
    logits, h = InferenceSession(head).run(None, {"hidden_states": hidden, "input_ids": ids})
    e = w["embed"][17][None, None]
    x = np.concatenate([_rms(hidden.astype(np.float64), w["w_hidden"]), _rms(e, w["w_embed"])], -1)
    x = x @ w["proj"]
    y = _rms(x, w["w_mlp"])
    g, u = y @ w["gate"], y @ w["up"]
    r = x + (g / (1 + np.exp(-g)) * u) @ w["down"]
    want_h = _rms(r, w["w_final"])
    np.testing.assert_allclose(h, want_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits, want_h @ w["lm_head"], rtol=1e-4, atol=1e-5)


def test_written_head_drives_speculation_equal_to_greedy(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    monkeypatch.setattr("sys.argv", ["random_mtp_head.py", str(folder), "--intermediate", "64"])
    _script().main()
    model = Model(folder)
    greedy = generate(model, "def main():\n", max_new_tokens=24)
    fast = generate(model, "def main():\n", max_new_tokens=24, spec="mtp", k=3)
    assert fast.tokens == greedy.tokens
    # random drafts are mostly below the confidence floor: plain steps, still through MTP
    assert fast.speculation["verify_steps"] + fast.speculation["plain_steps"] > 0


def test_a_draft_vocabulary_restricts_the_chain_and_keeps_greedy_tokens(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    (folder / "speculative.json").unlink()  # the embedded head's own entry (a ranked list)
    argv = ["random_mtp_head.py", str(folder), "--intermediate", "64", "--draft-vocab", "64"]
    monkeypatch.setattr("sys.argv", argv)
    _script().main()
    assert json.loads((folder / "speculative.json").read_text())["mtp"]["draft_vocab"] == 64
    model = Model(folder)
    greedy = generate(model, "def main():\n", max_new_tokens=24)
    fast = generate(model, "def main():\n", max_new_tokens=24, spec="mtp", k=3)
    assert fast.tokens == greedy.tokens
    vocab = model.config.vocab_size
    monkeypatch.setattr("sys.argv", [*argv[:-1], str(vocab + 1)])
    with pytest.raises(SystemExit, match=f"--draft-vocab {vocab + 1}: must be 1..{vocab}"):
        _script().main()
