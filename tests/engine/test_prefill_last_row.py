"""DecoderRunner's prefill computes the logits of its last row only (session.row_tail)."""

from __future__ import annotations

import numpy as np


def test_decoder_prefill_computes_the_last_row_only(qwen2_dir):
    """The runner's prefill binds one row of logits; it equals the last of every row's."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.decoder import DecoderRunner

    model = Model(qwen2_dir)
    prompt = [5, 17, 99, 3, 250, 7, 5, 17, 99]
    last = DecoderRunner(model.session, model.config, 32)
    assert last.prefill_last_row
    out = last.forward(prompt, None)
    full = DecoderRunner(model.session, model.config, 32)
    full.prefill_last_row = False
    every = full.forward(prompt, None)
    assert out.logits.shape == (1, every.logits.shape[-1])
    assert every.logits.shape[0] == len(prompt)
    np.testing.assert_allclose(out.logits[-1], every.logits[-1], rtol=1e-5, atol=1e-5)
    assert int(out.tokens[-1]) == int(every.tokens[-1])
    assert out.hidden.shape[0] == len(prompt)  # hidden states stay whole (an MTP head reads them)
