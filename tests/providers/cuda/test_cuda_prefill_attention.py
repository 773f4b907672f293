"""CUDA GroupQueryAttention for long prompts as matrix products (``attention_gemm_min_rows``,
``providers/cuda/attention_gemm.py``) against the CPU provider's kernel on the same inputs:
a prompt, a prompt after a past (chunked prefill), a local window, softcap, two batch entries
of different lengths. Marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.providers.cuda.test_cuda_gqa_window import _close, _cpu, _gpu, _node, _rope

pytestmark = pytest.mark.gpu


@pytest.fixture
def gemm_calls(monkeypatch):
    from onnx_genrt.providers.cuda.kernels import contrib_attention

    calls = []
    real = contrib_attention._gqa_attend_gemm

    def spy(ctx, call, y):
        calls.append(call.new)
        return real(ctx, call, y)

    monkeypatch.setattr(contrib_attention, "_gqa_attend_gemm", spy)
    return calls


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "steps,window,softcap,batch",
    [
        ([600], 0, 0.0, 1),
        ([520, 530], 0, 0.0, 1),
        ([700], 256, 30.0, 1),
        ([520, 513], 0, 0.0, 2),
    ],
    ids=["prompt", "after-a-past", "window-softcap", "batch2"],
)
def test_long_prompt_attention_matches_cpu(cp, prov, rng, gemm_calls, dtype, steps, window,
                                           softcap, batch):  # fmt: skip
    dtype = np.dtype(dtype)
    h, kvh, d, cap = 8, 2, 64, 1200
    attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1, "softcap": softcap}
    attrs |= {"local_window_size": window} if window else {}
    info = _node(9, attrs)
    keys = np.zeros((batch, kvh, cap, d), dtype)
    values = np.zeros((batch, kvh, cap, d), dtype)
    dev = [prov.as_array(keys.copy()), prov.as_array(values.copy())]
    cos, sin = _rope(4096, d, dtype)
    dev_cos, dev_sin = prov.as_array(cos), prov.as_array(sin)
    host_cache = [keys, values]
    done = [0] * batch
    for s in steps:
        # Entry i has s new tokens after i * 7 fewer past ones (different lengths per entry).
        totals = [max(s, done[i] + s - 7 * i) for i in range(batch)]
        qkv = rng.standard_normal((batch, s, (h + 2 * kvh) * d)).astype(dtype)
        seqlens = np.array(totals, np.int32) - 1
        total = np.array(max(totals), np.int32)
        host = [qkv, None, None, *host_cache, seqlens, total, cos, sin]
        inputs = [prov.as_array(qkv), None, None, *dev, prov.as_array(seqlens), total]
        y = cp.full((batch, s, h * d), np.nan, dtype)
        _gpu(prov, info, [*inputs, dev_cos, dev_sin], [y])
        want = _cpu(info, host)
        got = prov.to_numpy(y)
        for i, t in enumerate(totals):
            _close(got[i], want[0][i], dtype, f"output of entry {i}, total {t}")
            for j in (0, 1):
                cache = prov.to_numpy(dev[j])
                _close(cache[i, :, :t], want[1 + j][i, :, :t], dtype, f"cache {j} of entry {i}")
        host_cache = [prov.to_numpy(buf).copy() for buf in dev]
        done = totals
    assert gemm_calls == steps


def test_short_prompts_and_the_option_keep_the_kernels(cp, rng, gemm_calls):
    """Below ``attention_gemm_min_rows`` (and with it 0) the attention kernels run."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    for option, s in ((512, 100), (0, 600)):
        prov = CUDAProvider(attention_gemm_min_rows=option)
        info = _node(7, {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 0})
        cache = [prov.as_array(np.zeros((1, 2, 700, 32), np.float32)) for _ in range(2)]
        qkv = prov.as_array(rng.standard_normal((1, s, 8 * 32)).astype(np.float32))
        seqlens = prov.as_array(np.array([s - 1], np.int32))
        y = cp.empty((1, s, 4 * 32), np.float32)
        _gpu(prov, info, [qkv, None, None, *cache, seqlens, np.array(s, np.int32)], [y])
    assert gemm_calls == []
