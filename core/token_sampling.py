"""The rule of ``onnx_genrt::SampleTokens``, written once for every provider.

A token is drawn from ``softmax(logits / temperature)`` by the Gumbel-max trick: the argmax of
``logits / temperature + g`` with ``g = -log(-log(u))`` for a uniform ``u`` per vocabulary
entry. The uniforms come from Philox4x32-10 (Salmon et al., SC11; Random123), a counter-based
generator, so they are a pure function of (seed, offset, vocabulary index): any device makes
the same noise for a row without state to carry, whatever the batch around the row, and a
sequence drawn again with the same seed gets the same noise at each offset.

* Key ``(seed & 0xffffffff, seed >> 32)`` (the int64 seed's 64 bits); counter ``(v >> 2,
  offset & 0xffffffff, offset >> 32, SAMPLE_STREAM)``; entry ``v`` takes word ``v & 3``.
* ``u = (2 * (x >> 9) + 1) * 2**-24``: an odd multiple of ``2**-24`` in (0, 1), exact in
  float32; ``g = -log(-log(u))`` and the score ``logits / temperature + g`` in float32.
* ``top_k`` (optional, per row; 0 or at least the vocabulary: off) leaves out the entries
  whose logit is below the row's k-th largest (ties of it stay; a NaN logit counts as -inf).
* The first largest score wins; a NaN score never does; a row of no finite score gives 0.
  ``temperature <= 0`` scores the logits alone: the argmax (greedy decoding).

:func:`sample_tokens` is the numpy statement of the rule (tests, and the host when logits are
already there); the CPU and CUDA kernels and the op's standard-op body
(``core.genrt_ops``) compute the same.
"""

from __future__ import annotations

import numpy as np

#: Philox4x32 multipliers and Weyl key increments (Random123).
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
#: The counter's last word for sampling noise ("SAMP"): other uses of the generator take
#: other words and never share a draw with it.
SAMPLE_STREAM = 0x53414D50
MASK32 = 0xFFFFFFFF


def philox4x32(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of ``counter`` [..., 4] under ``key`` [..., 2] (32-bit values in any
    integer dtype; the leading dims broadcast): [..., 4] uint32."""
    counter = np.asarray(counter, np.uint64)
    key = np.asarray(key, np.uint64)
    c = [counter[..., i] for i in range(4)]
    k0, k1 = key[..., 0], key[..., 1]
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    w0, w1 = np.uint64(PHILOX_W[0]), np.uint64(PHILOX_W[1])
    mask, shift = np.uint64(MASK32), np.uint64(32)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = m0 * c[0], m1 * c[2]  # 32 x 32 -> 64 bits: exact in uint64
        c = [(p1 >> shift) ^ c[1] ^ k0, p1 & mask, (p0 >> shift) ^ c[3] ^ k1, p0 & mask]
    return np.stack(np.broadcast_arrays(*c), axis=-1).astype(np.uint32)


def uniforms(seed: np.ndarray, offset: np.ndarray, vocab: int) -> np.ndarray:
    """The float32 uniforms in (0, 1) of each row (``seed`` and ``offset``: int64 arrays of
    one shape) for vocabulary entries 0 .. vocab - 1: [*seed.shape, vocab]."""
    seed = np.asarray(seed, np.int64).astype(np.uint64)[..., None]
    offset = np.asarray(offset, np.int64).astype(np.uint64)[..., None]
    blocks = np.arange((vocab + 3) // 4, dtype=np.uint64)
    mask, shift = np.uint64(MASK32), np.uint64(32)
    counter = np.stack(
        np.broadcast_arrays(blocks, offset & mask, offset >> shift, np.uint64(SAMPLE_STREAM)),
        axis=-1,
    )
    key = np.stack([seed & mask, seed >> shift], axis=-1)
    words = philox4x32(counter, key).reshape(*counter.shape[:-2], -1)[..., :vocab]
    odd = (words >> np.uint32(9)).astype(np.float32) * np.float32(2) + np.float32(1)
    return odd * np.float32(2.0**-24)


def top_k_floor(logits: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Each row's k-th largest logit (float32, NaN as -inf), or -inf where ``top_k`` is off
    (0, negative, or at least the vocabulary)."""
    x = np.asarray(logits).astype(np.float32)
    x = np.where(np.isnan(x), np.float32(-np.inf), x)
    vocab = x.shape[-1]
    k = np.asarray(top_k, np.int64)
    descending = -np.sort(-x, axis=-1)
    kth = np.take_along_axis(descending, np.clip(k - 1, 0, vocab - 1)[..., None], axis=-1)[..., 0]
    return np.where((k > 0) & (k < vocab), kth, np.float32(-np.inf)).astype(np.float32)


def gumbel_scores(
    logits: np.ndarray,
    temperature: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    top_k: np.ndarray | None = None,
) -> np.ndarray:
    """float32 scores [..., vocab] whose first largest entry is the sampled token: ``logits /
    temperature - log(-log(u))``, or the logits alone where ``temperature <= 0``; -inf for
    entries below the row's ``top_k`` floor."""
    x = np.asarray(logits).astype(np.float32)
    t = np.asarray(temperature, np.float32)[..., None]
    u = uniforms(seed, offset, x.shape[-1])
    noise = -np.log(-np.log(u))
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.where(t > 0, x / np.where(t > 0, t, np.float32(1)) + noise, x)
    if top_k is not None:
        floor = top_k_floor(x, top_k)[..., None]
        scores = np.where((t > 0) & (x < floor), np.float32(-np.inf), scores)
    return scores.astype(np.float32)


def sample_tokens(
    logits: np.ndarray,
    temperature: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    top_k: np.ndarray | None = None,
) -> np.ndarray:
    """The sampled token (int64) of each row of ``logits`` [..., vocab]; ``temperature``
    (float32), ``seed``, ``offset`` and ``top_k`` (int64) are shaped like
    ``logits.shape[:-1]``."""
    scores = gumbel_scores(logits, temperature, seed, offset, top_k)
    scores = np.where(np.isnan(scores), -np.inf, scores)
    return np.argmax(scores, axis=-1).astype(np.int64)


def check_sample_shapes(where: str, logits: tuple, *others: tuple[str, tuple]) -> int:
    """The rows of a SampleTokens call (``logits`` [..., vocab] with a vocabulary of at least
    one entry); ValueError naming the input (``others``: (name, shape) of temperature, seed
    and offset) whose shape is not the logits' leading dims."""
    if len(logits) < 1 or logits[-1] < 1:
        raise ValueError(f"{where}: logits {list(logits)} need a last axis of at least 1")
    lead = tuple(logits[:-1])
    for name, shape in others:
        if tuple(shape) != lead:
            raise ValueError(
                f"{where}: {name} {list(shape)} must have the logits' leading shape {list(lead)}"
            )
    return int(np.prod(lead, dtype=np.int64))
