"""Sampling a batched decode step's tokens on the device (``onnx_genrt::SampleTokens``,
``core.token_sampling``): a one-node graph bound to the step's logits, run on the same
provider and stream right after the step, so the host reads back one token per row instead
of every row's logits.

Which rows it takes (:func:`device_samplable`): sampling by temperature and top-k (no top-p
or min-p filter, no penalty, no logit bias); the others keep the host sampler
(``engine/sampling.py``). A row draws with its seed at the offset of the token it chooses (its
index in the sequence), so its tokens do not depend on the rows beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.kernels import GENRT_DOMAIN

if TYPE_CHECKING:
    from onnx_genrt.session import InferenceSession

    from .config import SearchOptions

LOGITS, TEMPERATURE, SEED, OFFSET, TOP_K, TOKENS = (
    "logits",
    "temperature",
    "seed",
    "offset",
    "top_k",
    "tokens",
)


#: A step's per-row (temperature, seed, offset, top_k) for :meth:`DeviceSampler.launch`.
SampleInputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def device_samplable(search: SearchOptions) -> bool:
    """Whether a row's next token can be drawn on the device: sampling by temperature and
    top-k (``SampleTokens`` has no other filter, no penalty and no bias)."""
    return (
        search.do_sample
        and search.top_p >= 1.0
        and search.min_p == 0.0
        and search.repetition_penalty == 1.0
        and search.presence_penalty == 0.0
        and search.frequency_penalty == 0.0
        and not search.logit_bias
    )


def draws_on_device(search: SearchOptions, eos: object, length: int) -> bool:
    """Whether a sequence of ``length`` tokens draws its next one on the device (where its
    generator draws there at all): it samples by temperature and top-k and is free to end
    (no end token ``eos`` masked before ``min_length``)."""
    return device_samplable(search) and not (eos and length < search.min_length)


def sample_inputs(size: int, rows: dict[int, tuple[SearchOptions, int, int]]) -> SampleInputs:
    """(temperature, seed, offset, top_k) of a step of ``size`` rows: row ``i`` of ``rows``
    draws with its search's temperature and top_k, its seed, at ``offset`` (the index its
    token will have in its sequence); the other rows get temperature 0 (the argmax)."""
    temperature = np.zeros(size, np.float32)
    seed, offset, top_k = (np.zeros(size, np.int64) for _ in range(3))
    for i, (search, row_seed, at) in rows.items():
        temperature[i], top_k[i] = search.temperature, search.top_k
        seed[i], offset[i] = row_seed, at
    return temperature, seed, offset, top_k


def sampler_model(vocab: int, logits_dtype: Any):
    """The one-node model: logits [rows, 1, vocab], temperature / seed / offset / top_k
    [rows, 1] -> tokens [rows, 1]."""
    from onnx import TensorProto, helper

    node = helper.make_node(
        "SampleTokens",
        [LOGITS, TEMPERATURE, SEED, OFFSET, TOP_K],
        [TOKENS],
        name="onnx_genrt/sample",
        domain=GENRT_DOMAIN,
    )
    graph = helper.make_graph(
        [node],
        "device_sampler",
        [
            helper.make_tensor_value_info(
                LOGITS, DType.from_numpy(logits_dtype).value, ["rows", 1, vocab]
            ),
            helper.make_tensor_value_info(TEMPERATURE, TensorProto.FLOAT, ["rows", 1]),
            helper.make_tensor_value_info(SEED, TensorProto.INT64, ["rows", 1]),
            helper.make_tensor_value_info(OFFSET, TensorProto.INT64, ["rows", 1]),
            helper.make_tensor_value_info(TOP_K, TensorProto.INT64, ["rows", 1]),
        ],
        [helper.make_tensor_value_info(TOKENS, TensorProto.INT64, ["rows", 1])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(GENRT_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


class DeviceSampler:
    """Draws the tokens of a runner's one-token steps on the device: one binding per logits
    buffer (a step shape), its parameters uploaded per step."""

    def __init__(self, session: InferenceSession, vocab: int, logits_dtype: Any) -> None:
        self._session = session.sibling(sampler_model(vocab, logits_dtype))
        self._io = self._session.device_io
        self._bound: dict[int, tuple[Any, Any, Any, Any, Any]] = {}

    def launch(
        self,
        logits: Any,
        temperature: np.ndarray,
        seed: np.ndarray,
        offset: np.ndarray,
        top_k: np.ndarray,
    ) -> Any:
        """Queue the draw of each row of ``logits`` (a step's device buffer [rows, 1, vocab])
        and return the device buffer of its tokens [rows, 1]. Rows of temperature 0 get
        their argmax; top_k 0 keeps every entry."""
        rows = int(logits.shape[0])
        bound = self._bound.get(id(logits))
        if bound is None or bound[0] is not logits:  # (an id outlives its buffer)
            b = self._session.io_binding()
            b.bind_input(LOGITS, logits)
            temp = b.bind_input(TEMPERATURE, np.zeros((rows, 1), np.float32))
            keys = self._io.upload(np.zeros(3 * rows, np.int64))  # one upload of the three
            b.bind_input(SEED, keys[:rows].reshape(rows, 1))
            b.bind_input(OFFSET, keys[rows : 2 * rows].reshape(rows, 1))
            b.bind_input(TOP_K, keys[2 * rows :].reshape(rows, 1))
            tokens = b.bind_output(TOKENS, shape=(rows, 1), dtype=np.int64)
            bound = self._bound[id(logits)] = (logits, b, temp, keys, tokens)
        _, binding, temp, keys, tokens = bound
        self._io.write(temp, np.asarray(temperature, np.float32).reshape(rows, 1))
        self._io.write(keys, np.concatenate([seed, offset, top_k]).astype(np.int64))
        self._session.run_eager_with_iobinding(binding)
        return tokens
