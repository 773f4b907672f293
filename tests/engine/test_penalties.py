"""OpenAI's presence and frequency penalties (additive, over the generated tokens only) and
logit bias, against a float64 reference, and greedy decoding with them against a plain
onnxruntime loop that applies them itself."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, generate, generate_batch
from onnx_genrt.engine.config import SearchOptions, load_config
from onnx_genrt.engine.sampling import masked_logits
from onnx_genrt.generate_cli import default_model_dir

PRESENCE, FREQUENCY = 0.7, 0.9
#: One token pushed down, another up.
BIAS = {14: -3.0, 7: 2.5}


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _reference(logits: np.ndarray, generated: list[int]) -> np.ndarray:
    out = logits.astype(np.float64)
    for token in set(generated):
        out[token] -= FREQUENCY * generated.count(token) + PRESENCE
    for token, bias in BIAS.items():
        out[token] += bias
    return out


def test_penalties_count_only_what_follows_the_prompt():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(64).astype(np.float32)
    prompt, generated = [3, 3, 5, 9], [5, 7, 7, 7, 63]
    options = SearchOptions(
        presence_penalty=PRESENCE, frequency_penalty=FREQUENCY, logit_bias=tuple(BIAS.items())
    )
    got = masked_logits(logits, prompt + generated, options, set(), len(prompt))
    np.testing.assert_allclose(got, _reference(logits, generated), rtol=1e-6, atol=1e-6)
    assert got[3] == logits[3] and got[9] == logits[9]  # prompt-only tokens: untouched


def _onnxruntime_greedy(folder, prompt: list[int], new: int) -> list[int]:
    """A plain onnxruntime loop (growing KV cache) picking the argmax of the penalised
    logits in float64, end of sequence ruled out."""
    import onnxruntime as ort

    cfg = load_config(folder)
    sess = ort.InferenceSession(str(cfg.model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    pasts = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    past = {n: np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), np.float32) for n in pasts}
    ids, feed = list(prompt), list(prompt)
    for _ in range(new):
        feeds = {
            cfg.io.input_ids: np.array([feed], np.int64),
            cfg.io.attention_mask: np.ones((1, len(ids)), np.int64),
            **past,
        }
        outs = dict(zip(names, sess.run(None, feeds), strict=True))
        row = _reference(outs[cfg.io.logits][0, -1], ids[len(prompt) :])
        row[list(cfg.eos_token_ids)] = -np.inf
        ids.append(int(np.argmax(row)))
        feed = [ids[-1]]
        past = {n: outs[n.replace("past_key_values", "present")] for n in pasts}
    return ids


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_greedy_with_penalties_matches_a_plain_onnxruntime_loop(model, spec):
    """Alone and speculating, and in a batch (plain and speculating per row): the tokens of
    the onnxruntime loop."""
    prompts = [model.tokenizer.encode(t) for t in ("import os\nimport sys\n", "class Foo:")]
    want = [_onnxruntime_greedy(model.folder, p, 32) for p in prompts]
    options = {"presence_penalty": PRESENCE, "frequency_penalty": FREQUENCY, "logit_bias": BIAS}
    for prompt, tokens in zip(prompts, want, strict=True):
        got = generate(model, prompt, 32, min_length=len(prompt) + 32, spec=spec, **options)
        assert got.tokens == tokens
    longest = max(len(p) for p in prompts) + 32
    batched = generate_batch(model, prompts, 32, min_length=longest, spec=spec, **options)
    assert [r.tokens for r in batched] == want
    plain = generate(model, prompts[0], 32, min_length=len(prompts[0]) + 32)
    assert plain.tokens != want[0]  # the penalties changed the text


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("frequency_penalty", float("nan")),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {4096: 1}),
        ("logit_bias", [1, 2]),
    ],
)
def test_options_outside_their_range_are_refused(model, option, value):
    with pytest.raises(InvalidInputError, match=option):
        generate(model, "x", 2, **{option: value})
