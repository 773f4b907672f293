"""A decoder session over a static KV cache, with one persistent binding per step width.

The KV cache is allocated once at ``max_length`` and bound as both past and present, so the
same bindings serve every step: the current length lives in the attention mask (from which
the model derives ``seqlens_k`` and positions), not in any shape. A graph captured for a
step width therefore stays valid as the sequence grows, and rewinding is just lowering the
length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import InvalidInputError, KernelError, ModelLoadError, NonFiniteError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.session import InferenceSession, IOBinding
from onnx_genrt.session.device_io import DeviceIO

from .config import DecoderIO, GenAIConfig
from .decode_heads import ARGMAX, NONFINITE
from .device_sampler import DeviceSampler, SampleInputs


class StepOutput:
    """One step's results for its ``n`` real rows, brought to the host only when read.

    ``tokens`` (the device argmax of each row) costs M int64s; ``logits`` costs M x vocab.
    Values are read from the step's bound buffers, so read them before the next step of
    the same width overwrites those buffers. After a prefill that computed the last row's
    logits only (``DecoderRunner.prefill_last_row``), ``logits`` and ``tokens`` hold that
    one row: index them with -1.
    """

    def __init__(
        self,
        io: DeviceIO,
        bufs: StepBuffers,
        n: int,
        read: dict[str, np.ndarray] | None = None,
        extra: dict[str, np.ndarray] | None = None,
    ) -> None:
        self._io, self._bufs, self._n = io, bufs, n
        self._cache: dict[str, np.ndarray | None] = {
            key: value[0, :n] for key, value in (read or {}).items()
        }
        #: Values read back with the step from work queued right after it (``after=``).
        self.extra: dict[str, np.ndarray] = extra or {}

    def _get(self, key: str) -> np.ndarray | None:
        if key not in self._cache:
            buf = getattr(self._bufs, key)
            self._cache[key] = None if buf is None else self._io.read([buf])[0][0, : self._n]
        return self._cache[key]

    @property
    def logits(self) -> np.ndarray:
        return self._get("logits")

    @property
    def tokens(self) -> np.ndarray:
        """Greedy token of every row (device argmax when the model has the decode heads)."""
        tokens = self._get("argmax")
        return tokens if tokens is not None else np.argmax(self.logits, axis=-1)

    @property
    def hidden(self) -> np.ndarray | None:
        return self._get("hidden")

    def hidden_state(self, row: int) -> HiddenState | None:
        """Row ``row``'s hidden state, left on the device until someone asks for it."""
        if self._bufs.hidden is None:
            return None
        return HiddenState(self, row if row >= 0 else self._n + row)


class HiddenState:
    """One row of a step's hidden-states output: on the device, or as a host array.

    An MTP head on the same device copies it device to device; anything else reads it back.
    Valid until the next step of the same width overwrites the bound buffer.
    """

    def __init__(self, out: StepOutput, row: int) -> None:
        self._out, self.row = out, row

    @property
    def device_io(self) -> DeviceIO:
        """The transfers of the session whose step made this row."""
        return self._out._io

    def device_row(self) -> Any:
        """The row as a [1, 1, hidden] view of the step's bound output buffer."""
        buf = self._out._bufs.hidden
        return buf[:, self.row : self.row + 1]

    def numpy(self) -> np.ndarray:
        return self._out.hidden[self.row]


def check_cache_fits(io: DeviceIO, layers: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse a KV cache larger than the device can hold (``memory_limit()``, the physical
    memory for the CPU provider) before allocating it; a provider that does not say leaves
    it to its own allocator."""
    limit = io.memory_limit()
    need = 2 * layers * math.prod(shape) * np.dtype(dtype).itemsize
    if limit is not None and need > limit:
        raise InvalidInputError(
            f"the KV cache for max_length {shape[2]} needs {need} bytes ({need / 2**30:.1f} GiB: "
            f"2 x {layers} layers x {list(shape)} {np.dtype(dtype).name}), more than this "
            f"provider's {limit / 2**30:.1f} GiB of memory; lower max_length "
            "(set_search_options(max_length=...), or search.max_length in genai_config.json)"
        )


def check_token_ids(ids: np.ndarray, vocab: int | None, where: str) -> None:
    """Refuse token ids a step's device argmax gave outside ``[0, vocab)`` (a kernel fault:
    they would otherwise reach the tokenizer or the next step)."""
    if vocab is None or ids.size == 0:
        return
    if ids.size <= 64:  # a decode step's few ids: Python's min and max cost less than numpy's
        values = ids.ravel().tolist()
        if min(values) >= 0 and max(values) < vocab:
            return
    elif ids.min() >= 0 and ids.max() < vocab:
        return
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        raise KernelError(
            f"the device argmax of {where} gave token ids {ids[bad][:5].tolist()} outside the "
            f"vocabulary of {vocab} (rows {np.flatnonzero(bad)[:5].tolist()})"
        )


class StaticKVCache:
    """Per-layer key and value buffers of shape ``[rows, kv_heads, max_length, head_size]``.

    ``rows`` > 1 holds a batch (:mod:`onnx_genrt.engine.batch`); :meth:`row` is one row
    of it as a cache of its own (views of the same buffers), which a prefill fills.
    """

    def __init__(
        self,
        session: InferenceSession,
        io: DecoderIO,
        layers: int,
        max_length: int,
        kv_heads: int,
        head_size: int,
        rows: int = 1,
    ):
        spec = session.input_spec(io.past_key % 0)
        if spec.shape is None or len(spec.shape) != 4:
            raise ModelLoadError(
                f"{io.past_key % 0} must be rank 4, the model declares {spec.shape}"
            )
        for axis, want in ((1, kv_heads), (3, head_size)):
            if isinstance(spec.shape[axis], int) and spec.shape[axis] != want:
                raise ModelLoadError(
                    f"{io.past_key % 0} dimension {axis} is {spec.shape[axis]}, the config says {want}"
                )
        if isinstance(spec.shape[0], int) and spec.shape[0] != rows:
            raise ModelLoadError(
                f"{io.past_key % 0} has a fixed batch dimension {spec.shape[0]}; a cache of "
                f"{rows} rows needs a dynamic one"
            )
        io = session.device_io
        dtype = DType.from_numpy(spec.dtype)
        shape = (rows, kv_heads, max_length, head_size)
        check_cache_fits(io, layers, shape, dtype.numpy)
        zeros = np.zeros(shape, dtype.numpy)  # uploaded on the provider's stream
        self.keys = [io.upload(zeros) for _ in range(layers)]
        self.values = [io.upload(zeros) for _ in range(layers)]
        self.max_length = max_length
        self.rows = rows
        self.length = 0

    def row(self, index: int) -> StaticKVCache:
        """Row ``index`` as a one-row cache: views of this cache's buffers, length 0."""
        return self.rows_view(index, 1)

    def rows_view(self, start: int, count: int) -> StaticKVCache:
        """Rows ``start .. start + count - 1`` as a cache of their own (views), length 0."""
        if not (start >= 0 and count >= 1 and start + count <= self.rows):
            raise InvalidInputError(f"rows {start}..{start + count - 1} of a cache of {self.rows}")
        view = object.__new__(StaticKVCache)
        view.keys = [k[start : start + count] for k in self.keys]
        view.values = [v[start : start + count] for v in self.values]
        view.max_length, view.rows, view.length = self.max_length, count, 0
        return view

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in (*self.keys, *self.values))


@dataclass(frozen=True)
class StepBuffers:
    """The device buffers of one step binding (made once per shape, reused by every step
    of that shape): what the host writes and what the model writes."""

    #: ids, positions and mask packed in one int64 array: one upload writes them all.
    inputs: Any
    ids: Any  # [rows, width]
    pos: Any | None  # [rows, width], when the model takes position_ids
    mask: Any | None  # [rows, max_length], when the model takes an attention mask
    logits: Any  # [rows, width (or 1 for a last-row prefill), vocab]
    argmax: Any | None  # [rows, width], with the decode heads
    nonfinite: Any | None  # scalar probe, with the decode heads
    hidden: Any | None  # [rows, width, hidden], when the model outputs hidden states


class PendingStep:
    """A queued decoder step; ``wait()`` gives its :class:`StepOutput` (once)."""

    def __init__(
        self,
        runner: DecoderRunner,
        bufs: StepBuffers,
        start: int | None,
        n: int,
        slot: DeviceGraphSlot | None,
        queued: list[str],
        fetch: Callable[[], list[np.ndarray]],
    ) -> None:
        self.runner, self.bufs, self.start, self.n, self.slot = runner, bufs, start, n, slot
        self.queued, self.fetch = queued, fetch
        #: The device buffer of the token drawn after the step (``DRAWN``), if one was.
        self.drawn: Any = None
        self._out: StepOutput | None = None

    @property
    def chosen(self) -> Any:
        """The device buffer of the token this step chose on the device: its drawn token,
        else its last argmax (None without either)."""
        if self.drawn is not None or self.bufs.argmax is None:
            return self.drawn
        return self.bufs.argmax[:, self.n - 1 : self.n]

    def wait(self) -> StepOutput:
        if self._out is None:
            self._out = self.runner._finish(self)
        return self._out


#: Widths a prompt chunk is padded to when prompts run as graphed steps
#: (:meth:`DecoderRunner.prefill`): one captured graph per width a runner uses, with its own
#: planned memory and bound outputs (logits of ``width`` rows). Only the widths up to the
#: session's ``graph_max_rows`` are used: the CUDA provider's matmuls capture any number of
#: rows through its own cuBLAS handle (``cublas_in_graphs``), else up to 64. Each is below
#: 1024: a batch's row runners number their graph variants 1024 apart.
PREFILL_WIDTHS = (8, 16, 32, 64, 128, 256, 512)
#: The name of a step's token drawn on the device (:meth:`DecoderRunner.draw_after`) in its
#: ``StepOutput.extra``.
DRAWN = "drawn"
#: Longest prompt fed as graphed chunks; a longer one runs eagerly, in one step whose big
#: matrix products and flash attention over every row at once lose little to dispatch.
#: A first guess: measure it on the GPU (NOTES.md).
PREFILL_GRAPH_MAX_TOKENS = 1024
#: At most this many chunks of the widest width a session captures: where that is 64
#: (``cublas_in_graphs`` off), prompts of more than 256 tokens run eagerly, as measured
#: before wider chunks captured (docs/performance.md, 2026-12-04).
PREFILL_GRAPH_MAX_CHUNKS = 4
#: Graph variants of graphed prompt chunks start here (slot VERIFY; its verify step is
#: variant 0): PREFILL_VARIANT + width.
PREFILL_VARIANT = 1 << 40


@dataclass
class PendingRows:
    """A queued batched step (:meth:`DecoderRunner.launch_rows`): its buffers, rows, slot,
    whether its logits are read back, the call that waits for the read-back, and how many
    tokens each row fed (``width``)."""

    bufs: StepBuffers
    rows: int
    slot: DeviceGraphSlot | None
    with_logits: bool
    fetch: Callable[[], list[np.ndarray]]
    width: int = 1
    #: Whether the hidden states are read back too; ``finish_rows`` puts them in ``hidden``
    #: (``[rows, width, hidden]``).
    read_hidden: bool = False
    hidden: np.ndarray | None = None
    #: Whether tokens drawn on the device are read back too; ``finish_rows`` puts them in
    #: ``sampled`` (``[rows]``).
    read_sampled: bool = False
    sampled: np.ndarray | None = None
    #: The device buffer of those drawn tokens (``[rows, 1]``), which a step queued after
    #: this one can be fed (``feed_token_of``).
    drawn: Any = None

    @property
    def chosen(self) -> Any:
        """The device buffer of the tokens the rows chose on the device: the drawn ones,
        else the argmax (None without either)."""
        return self.drawn if self.drawn is not None else self.bufs.argmax


class DecoderRunner:
    """Runs the decoder for M new tokens at the cache's current length."""

    def __init__(
        self,
        session: InferenceSession,
        config: GenAIConfig,
        max_length: int,
        *,
        rows: int = 1,
        cache: StaticKVCache | None = None,
    ):
        """A runner over a new cache of ``rows`` x ``max_length`` positions, or over
        ``cache`` (a row of a batch's cache, :meth:`StaticKVCache.row`)."""
        max_length = min(max_length, config.context_length)
        io, layers = config.io, config.num_layers
        self.session = session
        #: The decoder's input and output names (genai_config.json).
        self.names = io
        self.layers = layers
        #: Transfers between the host and the session's device.
        self.io = session.device_io
        outputs = {o.name for o in session.get_outputs()}
        self._outputs = outputs
        self.hidden_name = io.hidden_states or (
            "hidden_states" if "hidden_states" in outputs else None
        )
        self.cache = cache or StaticKVCache(
            session, io, layers, max_length, config.num_kv_heads, config.head_size, rows
        )
        #: Graph variants of this runner's batched steps start here (runners over other
        #: rows of one cache keep their own graphs side by side).
        self.variant_base = 0
        #: Widest graphed prompt chunk of this runner (None: the session's limit). Each
        #: width it uses keeps a graph with logits of ``width`` rows, so runners that exist
        #: once per batch row cap it (``engine/batch.py``).
        self.prefill_max_width: int | None = None
        self._bindings: dict[tuple[int, int], tuple[IOBinding, StepBuffers]] = {}
        tail = session.row_tail(io.logits)
        #: Whether a prefill computes the logits (and device argmax) of its last row only:
        #: the lm_head then skips every other prompt row. Only where the logits come from the
        #: hidden states through row-local steps (``session.row_tail``).
        self.prefill_last_row = tail is not None and tail.outputs <= {io.logits, ARGMAX, NONFINITE}
        spec = session.output_spec(io.logits)
        self.vocab = int(spec.shape[-1]) if spec.shape and isinstance(spec.shape[-1], int) else None
        self.logits_dtype = spec.dtype or np.float32
        self._sampler: DeviceSampler | None = None

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    @property
    def device_argmax(self) -> bool:
        """Whether steps compute their argmax on the device (the decode heads)."""
        return ARGMAX in self._outputs

    def _binding(
        self, width: int, keep: bool = True, last_row: bool = False, rows: int = 1
    ) -> tuple[IOBinding, StepBuffers]:
        """The persistent binding for steps of ``width`` tokens in each of the cache's first
        ``rows`` rows (made once per shape). ``last_row``: the logits and argmax outputs
        hold one row (a prefill's last)."""
        if keep and (rows, width) in self._bindings:
            return self._bindings[rows, width]
        if not 1 <= rows <= self.cache.rows:
            raise InvalidInputError(f"a step of {rows} rows on a cache of {self.cache.rows}")
        io, b = self.names, self.session.io_binding()
        # ids, positions and the mask are views of one int64 buffer: one upload per step.
        sizes = {"ids": width}
        if io.position_ids:
            sizes["pos"] = width
        if io.attention_mask:
            sizes["mask"] = self.max_length
        packed = self.io.upload(np.zeros(rows * sum(sizes.values()), np.int64))
        views: dict[str, Any] = {}
        offset = 0
        for key, size in sizes.items():
            views[key] = packed[offset : offset + rows * size].reshape(rows, size)
            offset += rows * size
        b.bind_input(io.input_ids, views["ids"])
        if io.position_ids:
            b.bind_input(io.position_ids, views["pos"])
        if io.attention_mask:
            b.bind_input(io.attention_mask, views["mask"])
        keys, values = self.cache.keys, self.cache.values
        if rows < self.cache.rows:
            keys, values = [k[:rows] for k in keys], [v[:rows] for v in values]
        for i in range(self.layers):
            b.bind_input(io.past_key % i, keys[i])
            b.bind_input(io.past_value % i, values[i])
            b.bind_output(io.present_key % i, keys[i])
            b.bind_output(io.present_value % i, values[i])
        vocab = self.vocab
        if vocab is None:
            raise ModelLoadError(f"output {io.logits!r} needs a static vocabulary dimension")
        out_rows = 1 if last_row else width
        logits = b.bind_output(io.logits, shape=(rows, out_rows, vocab), dtype=self.logits_dtype)
        argmax = nonfinite = hidden = None
        if ARGMAX in self._outputs:
            argmax = b.bind_output(ARGMAX, shape=(rows, out_rows), dtype=np.int64)
            nonfinite = b.bind_output(NONFINITE, shape=(), dtype=self.logits_dtype)
        if self.hidden_name:
            hspec = self.session.output_spec(self.hidden_name)
            hidden = b.bind_output(
                self.hidden_name, shape=(rows, width, int(hspec.shape[-1])), dtype=hspec.dtype
            )
        bufs = StepBuffers(
            packed,
            views["ids"],
            views.get("pos"),
            views.get("mask"),
            logits,
            argmax,
            nonfinite,
            hidden,
        )
        if keep:
            self._bindings[rows, width] = (b, bufs)
        return b, bufs

    def step_buffers(self, width: int) -> StepBuffers:
        """The persistent device buffers of steps of ``width`` tokens (ids, argmax, hidden...)."""
        return self._binding(width)[1]

    def prefill_widths(self) -> tuple[int, ...]:
        """The chunk widths of graphed prompts here: ``PREFILL_WIDTHS`` up to the session's
        ``graph_max_rows`` and this runner's ``prefill_max_width`` (none when even the
        narrowest does not fit)."""
        limits = [w for w in (self.session.graph_max_rows, self.prefill_max_width) if w is not None]
        return tuple(w for w in PREFILL_WIDTHS if all(w <= most for most in limits))

    def prefill_graph_max_tokens(self) -> int:
        """The longest prompt :meth:`prefill` feeds as graphed chunks: PREFILL_GRAPH_MAX_TOKENS,
        and at most PREFILL_GRAPH_MAX_CHUNKS chunks of the widest width (0: none)."""
        widths = self.prefill_widths()
        return min(PREFILL_GRAPH_MAX_TOKENS, PREFILL_GRAPH_MAX_CHUNKS * widths[-1]) if widths else 0

    def prefill(self, tokens: list[int], graphed: bool) -> tuple[StepOutput, int]:
        """Feed a prompt at the cache's length; returns the output holding its last row
        (its logits and tokens: index -1) and that row's index among the step's hidden
        states. Eagerly in one step (only the last row's logits where the
        model allows: ``prefill_last_row``), or ``graphed``: in chunks of at most the widest
        of :meth:`prefill_widths` tokens, each padded to the next of those widths and
        replayed from that width's graph (slot VERIFY, variant ``PREFILL_VARIANT`` +
        ``variant_base`` + width),
        with no eager dispatch; padded rows write keys and values later steps overwrite. A
        chunk whose padding would pass the cache's end runs eagerly, and so does a prompt of
        more than :meth:`prefill_graph_max_tokens`."""
        if not graphed or not 2 <= len(tokens) <= self.prefill_graph_max_tokens():
            return self.forward(tokens, None), len(tokens) - 1
        widths = self.prefill_widths()
        most = widths[-1]
        step: PendingStep | None = None
        for first in range(0, len(tokens), most):
            chunk = tokens[first : first + most]
            width = next(w for w in widths if w >= len(chunk))
            if self.cache.length + width > self.max_length:
                step = self.launch(chunk, None)
            else:
                variant = PREFILL_VARIANT + self.variant_base + width
                step = self.launch(chunk, DeviceGraphSlot.VERIFY, width, variant=variant)
        assert step is not None
        return step.wait(), step.n - 1

    def forward(
        self,
        tokens: list[int] | np.ndarray,
        slot: DeviceGraphSlot | None,
        width: int | None = None,
        after: Callable[[StepBuffers], dict[str, Any]] | None = None,
        variant: int = 0,
    ) -> StepOutput:
        """Feed ``tokens`` at positions ``length ..``; pad to ``width`` rows when given.

        ``slot=None`` runs eagerly (prefill); a slot replays that slot's graph. The cache
        length grows by ``len(tokens)``; padded rows write KV that later steps overwrite.
        ``after(bufs)`` may queue more device work on the step's outputs (an MTP chain) and
        return arrays to read back together with the step's own (``StepOutput.extra``).
        """
        return self.launch(tokens, slot, width, after, variant=variant).wait()

    def launch(
        self,
        tokens: list[int] | np.ndarray | None,
        slot: DeviceGraphSlot | None,
        width: int | None = None,
        after: Callable[[StepBuffers], dict[str, Any]] | None = None,
        feed_token_of: PendingStep | None = None,
        variant: int = 0,
    ) -> PendingStep:
        """Queue a step like :meth:`forward` and return before its results are back.

        With ``feed_token_of``, the step's one token is the one that earlier step chose on
        the device (its drawn token where ``after`` drew one, else its last argmax), copied
        on the device: decoding can queue step t+1 before the host has read step t's token,
        so the GPU never waits for the host.

        ``tokens=None`` runs a step of ``width`` whose inputs (ids, positions, mask) are
        already on the device, written by work queued before it (the MTP chain after a
        verify step). Its start is not known here: the cache length is left alone, and the
        caller sets it once it has read the step before.
        """
        if tokens is None:
            return self._launch_device_fed(slot, width, after)
        n = len(tokens)
        width = width or n
        start = self.cache.length
        if n == 0 or n > width:
            raise InvalidInputError(f"cannot feed {n} tokens in a step of width {width}")
        if start + width > self.max_length:
            raise InvalidInputError(
                f"sequence of {start + width} tokens exceeds the KV cache of {self.max_length}"
            )
        last_row = slot is None and self.prefill_last_row and n == width and n > 1
        binding, bufs = self._binding(width, keep=slot is not None, last_row=last_row)
        if feed_token_of is not None and (n != 1 or width != 1 or feed_token_of.chosen is None):
            raise InvalidInputError(
                "a device-fed step takes one token from a device argmax or drawn token"
            )
        host = np.zeros(bufs.inputs.shape, np.int64)
        if feed_token_of is None:
            host[:n] = tokens
        if bufs.pos is not None:
            host[width : 2 * width] = np.arange(start, start + width)
        if bufs.mask is not None:
            host[host.size - self.max_length :][: start + width] = 1
        self.io.write(bufs.inputs, host)
        if feed_token_of is not None:  # after the upload, on the same stream
            self.io.copy(feed_token_of.chosen.reshape(bufs.ids.shape), bufs.ids)
        if slot is None:
            self.session.run_eager_with_iobinding(
                binding, last_row_of=self.names.logits if last_row else None
            )
        else:
            self.session.run_with_iobinding(binding, slot, variant=variant)
        self.cache.length = start + n
        return self._queue_reads(bufs, start, n, slot, after)

    def _launch_device_fed(
        self,
        slot: DeviceGraphSlot | None,
        width: int | None,
        after: Callable[[StepBuffers], dict[str, Any]] | None,
    ) -> PendingStep:
        if slot is None or width is None:
            raise InvalidInputError("a step fed on the device needs a graph slot and a width")
        # It starts at most where the cache's length says (the previous step's rows, some
        # perhaps rejected), so this bound is safe.
        if self.cache.length + width > self.max_length:
            raise InvalidInputError(
                f"a step of {width} after {self.cache.length} positions exceeds the KV cache "
                f"of {self.max_length}"
            )
        binding, bufs = self._binding(width)
        self.session.run_with_iobinding(binding, slot)
        return self._queue_reads(bufs, None, width, slot, after)

    def _queue_reads(
        self,
        bufs: StepBuffers,
        start: int | None,
        n: int,
        slot: DeviceGraphSlot | None,
        after: Callable[[StepBuffers], dict[str, Any]] | None,
    ) -> PendingStep:
        queued = after(bufs) if after is not None else {}
        if bufs.nonfinite is not None:  # probe, argmax and the queued arrays in one transfer
            fetch = self.io.read_later([bufs.nonfinite, bufs.argmax, *queued.values()])
        else:
            fetch = self.io.read_later(list(queued.values()))
        step = PendingStep(self, bufs, start, n, slot, list(queued), fetch)
        step.drawn = queued.get(DRAWN)
        return step

    def _finish(self, step: PendingStep) -> StepOutput:
        """Raise on NaN or infinite logits; the step's output with what was read back.

        With the decode heads, the probe scalar and the step's argmax ids come back in one
        transfer. The probe covers every row of the step, padded rows included: a padded
        verify row holds a real token's logits, so a non-finite value there is a real fault.
        A last-row prefill computes (and probes) the last row's logits only; a non-finite
        key or value of an earlier row reaches that row through attention.
        """
        values = step.fetch()
        read: dict[str, np.ndarray] = {}
        bufs, start, n = step.bufs, step.start, step.n
        if bufs.nonfinite is not None:
            probe, *values = values
            read.update(zip(["argmax", *step.queued], values, strict=True))
            ok = bool(np.isfinite(probe))
        else:
            read.update(zip(step.queued, values, strict=True))
            ok = bool(np.isfinite(self.io.read([bufs.logits])[0][0, :n]).all())
        if not ok:
            slot = step.slot
            if start is None:
                where = f"of a {n}-row step"
            elif bufs.logits.shape[1] < n:  # a prefill's last row only
                where = f"{start + n - 1}"
            else:
                where = f"{start}..{start + n - 1}"
            raise NonFiniteError(
                f"non-finite logits at positions {where} (slot {slot.value if slot else 'eager'})"
            )
        if "argmax" in read:
            check_token_ids(np.asarray(read["argmax"]), self.vocab, f"the step at {start}")
        extra = {name: read.pop(name) for name in step.queued}
        return StepOutput(self.io, bufs, n, read, extra)

    def step_rows(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        slot: DeviceGraphSlot | None,
        read_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One decode step of the cache's first ``len(tokens)`` rows: row ``r`` feeds
        ``tokens[r]`` at position ``lengths[r]`` (its own length, in its attention mask).
        ``tokens`` of shape ``[rows, width]`` feed ``width`` tokens a row, at positions
        ``lengths[r]`` on (a verify step of every row).

        The step replays ``slot``'s graph for this number of rows (one variant per row
        count). Returns each row's device argmax (``[rows]``, or ``[rows, width]``) and, with
        ``read_logits``, the rows' logits (``[rows, vocab]``, or ``[rows, width, vocab]``);
        raises :class:`NonFiniteError` on non-finite logits. Row lengths are the caller's:
        this runner's ``cache.length`` is not used.
        """
        return self.finish_rows(self.launch_rows(tokens, lengths, slot, read_logits))

    def launch_rows(
        self,
        tokens: np.ndarray | None,
        lengths: np.ndarray,
        slot: DeviceGraphSlot | None,
        read_logits: bool = False,
        feed_token_of: PendingRows | None = None,
        read_hidden: bool = False,
        sample: SampleInputs | None = None,
    ) -> PendingRows:
        """Queue :meth:`step_rows`' step and its read-back; :meth:`finish_rows` waits for it.

        With ``feed_token_of`` (an earlier one-token step of as many rows), ``tokens`` is
        None and each row's token is the one that step chose on the device (its drawn
        token where it drew, else its argmax), copied on the device: the next step is
        queued before the host has read this one's. ``read_hidden``
        reads the hidden states back too, where the model outputs them. ``sample``
        (temperature, seed, offset and top_k per row; a one-token step) draws each row's
        token on the device after the step (``engine/device_sampler.py``; temperature 0:
        the argmax)."""
        rows = len(lengths)
        if feed_token_of is None and (tokens is None or len(tokens) != rows):
            raise InvalidInputError(
                f"{0 if tokens is None else len(tokens)} tokens for {rows} row lengths"
            )
        width = 1 if tokens is None or np.ndim(tokens) == 1 else int(np.shape(tokens)[1])
        if width < 1 or (tokens is not None and np.ndim(tokens) > 2):
            raise InvalidInputError(
                f"tokens of shape {np.shape(tokens)}: expected [rows] or [rows, width >= 1]"
            )
        if rows and int(np.max(lengths)) + width > self.max_length:
            raise InvalidInputError(
                f"a row of {int(np.max(lengths)) + width} positions exceeds the KV cache of "
                f"{self.max_length}"
            )
        binding, bufs = self._binding(width, rows=rows)
        fed_by = None if feed_token_of is None else feed_token_of.chosen
        if feed_token_of is not None and (
            feed_token_of.rows != rows or fed_by is None or width != 1
        ):
            raise InvalidInputError(
                f"a step of {rows} rows fed on the device needs the device argmax or drawn "
                f"tokens of a one-token step of {rows} rows"
            )
        host = np.zeros(bufs.inputs.shape, np.int64)
        fed = rows * width
        if feed_token_of is None:
            host[:fed] = np.asarray(tokens).reshape(-1)
        offset = fed
        starts = np.asarray(lengths, np.int64)[:, None]
        if bufs.pos is not None:
            host[offset : offset + fed] = (starts + np.arange(width)).reshape(-1)
            offset += fed
        if bufs.mask is not None:
            mask = host[offset:].reshape(rows, self.max_length)
            mask[np.arange(self.max_length)[None, :] < starts + width] = 1
        self.io.write(bufs.inputs, host)
        if fed_by is not None:  # after the upload, on the same stream
            self.io.copy(fed_by.reshape(bufs.ids.shape), bufs.ids)
        # one graph per row count and width (a batch's verify steps beside its decode steps)
        variant = self.variant_base + rows + (width - 1) * (self.cache.rows + 1)
        if slot is None:  # eager, as ``launch`` runs a prefill
            self.session.run_eager_with_iobinding(binding)
        else:
            self.session.run_with_iobinding(binding, slot, variant=variant)
        device_argmax = bufs.argmax is not None
        reads = [bufs.nonfinite, bufs.argmax] if device_argmax else []
        with_logits = read_logits or not device_argmax
        if with_logits:
            reads.append(bufs.logits)
        read_hidden = read_hidden and bufs.hidden is not None
        if read_hidden:
            reads.append(bufs.hidden)
        drawn = None
        if sample is not None:
            if width != 1:
                raise InvalidInputError(
                    f"tokens are drawn on the device for one-token steps, not {width}"
                )
            drawn = self._device_sampler().launch(bufs.logits, *sample)
            reads.append(drawn)
        return PendingRows(
            bufs,
            rows,
            slot,
            with_logits,
            self.io.read_later(reads),
            width,
            read_hidden,
            read_sampled=sample is not None,
            drawn=drawn,
        )

    def draw_after(self, sample: SampleInputs) -> Callable[[StepBuffers], dict[str, Any]]:
        """An ``after=`` for :meth:`launch`: draws the one-token step's token on the device
        (``sample``: its temperature, seed, offset and top_k, one row) and reads it back
        with the step, as ``extra[DRAWN]``."""

        def draw(bufs: StepBuffers) -> dict[str, Any]:
            return {DRAWN: self._device_sampler().launch(bufs.logits, *sample)}

        return draw

    def _device_sampler(self) -> DeviceSampler:
        """The sampler of this runner's steps (made on first use)."""
        if self._sampler is None:
            assert self.vocab is not None  # a binding was made
            self._sampler = DeviceSampler(self.session, self.vocab, self.logits_dtype)
        return self._sampler

    def finish_rows(self, step: PendingRows) -> tuple[np.ndarray, np.ndarray | None]:
        """Wait for a step queued by :meth:`launch_rows`: each row's argmax and (when it
        was read) the rows' logits, one per row of a one-token step (``[rows]``,
        ``[rows, vocab]``), one per token of a wider one (``[rows, width]``,
        ``[rows, width, vocab]``); raises :class:`NonFiniteError` on non-finite logits."""
        values = list(step.fetch())
        if step.read_sampled:
            step.sampled = values.pop()[:, 0]
        if step.read_hidden:
            step.hidden = values.pop()
        logits = values[-1] if step.with_logits else None
        device_argmax = step.bufs.argmax is not None
        finite = np.isfinite(values[0]) if device_argmax else np.isfinite(logits).all()
        if not finite:
            slot = step.slot
            raise NonFiniteError(
                f"non-finite logits in a batched step of {step.rows} rows "
                f"(slot {slot.value if slot else 'eager'})"
            )
        argmax = values[1] if device_argmax else np.argmax(logits, axis=-1)
        check_token_ids(argmax, self.vocab, f"a batched step of {step.rows} rows")
        if step.width == 1:
            return argmax[:, 0], None if logits is None else logits[:, 0]
        return argmax, logits

    def row_logits(self, rows: int, row: int) -> np.ndarray:
        """Row ``row``'s logits [vocab] from the last :meth:`step_rows` of ``rows`` rows (read
        now; the next step overwrites them)."""
        _, bufs = self._binding(1, rows=rows)
        return self.io.read([bufs.logits[row, 0]])[0]

    def rewind_to(self, length: int) -> None:
        """Forget every position from ``length`` on; later steps overwrite them."""
        if not 0 <= length <= self.cache.length:
            raise InvalidInputError(
                f"cannot rewind to {length}: the cache holds {self.cache.length}"
            )
        self.cache.length = length
