"""Model and GeneratorParams, modelled on onnxruntime-genai's Python API."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.session import InferenceSession, open_model
from onnx_genrt.session.inference_session import ProviderArg

from .config import GenAIConfig, SearchOptions, load_config
from .decode_heads import add_decode_heads
from .decoder import DecoderRunner
from .sampling import validate
from .tokenizer import Tokenizer


class Model:
    """A decoder folder (genai_config.json, model.onnx, tokenizer.json) loaded on a provider.

    Threads: a model may be shared. Each generator gets a KV cache of its own from the
    model's pool, and generation steps take turns on the model's providers.
    """

    def __init__(
        self,
        folder: str | Path,
        provider: str | Sequence[ProviderArg] = "cpu",
        *,
        enable_graphs: bool = True,
    ) -> None:
        self.folder = Path(folder)
        self.config: GenAIConfig = load_config(self.folder)
        self.providers = [provider] if isinstance(provider, str) else list(provider)
        self.enable_graphs = enable_graphs
        # Weights in external files are mapped, not copied; the session owns the proto.
        loaded = open_model(self.config.model_path, folder=self.folder)
        add_decode_heads(loaded.proto, self.config.io.logits)
        self.session = InferenceSession(
            loaded, providers=self.providers, enable_graphs=enable_graphs
        )
        self._tokenizer: Tokenizer | None = None
        self._runners: list[tuple[DecoderRunner, weakref.ref]] = []
        self._pool_lock = threading.Lock()
        self._batches: list[Any] = []
        self._batch_count = itertools.count(1)
        #: Proposers and draft models built for this model, reused across generations.
        self.proposers: dict[Any, Any] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.folder)
        return self._tokenizer

    def acquire_runner(self, owner: object, length: int) -> DecoderRunner:
        """A decoder runner (KV cache + bindings) holding at least ``length`` positions.

        Runners are pooled by capacity (powers of two, at least 256, at most the context
        length) and handed to one live owner at a time. Reusing one keeps its buffers, and
        so its captured graphs, valid from one generation to the next.
        """
        capacity = self.capacity_for(length)
        with self._pool_lock:
            for runner, holder in self._runners:
                if runner.max_length == capacity and holder() is None:
                    self._runners.remove((runner, holder))
                    runner.rewind_to(0)
                    self._runners.append((runner, weakref.ref(owner)))
                    return runner
            runner = DecoderRunner(self.session, self.config, capacity)
            self._runners.append((runner, weakref.ref(owner)))
            return runner

    def capacity_for(self, length: int) -> int:
        """The cache length a pool hands out for ``length`` positions: a power of two, at
        least 256, at most the context length (so similar lengths share caches)."""
        context = self.config.context_length
        return min(max(256, 1 << max(min(length, context) - 1, 1).bit_length()), context)

    def graph_variant_base(self) -> int:
        """A range of graph variants of its own for a new batch (``1 << 20`` of them), so
        the bucket graphs of two batches on this model never displace each other."""
        return next(self._batch_count) << 20

    def take_batch(self, rows: int, length: int) -> Any:
        """A :class:`~onnx_genrt.engine.batch.BatchGenerator` of ``rows`` rows holding at
        least ``length`` positions each, from the model's pool (or new). Give it back with
        :meth:`give_back_batch`: the next batch of that size reuses its cache and graphs."""
        from .batch import BatchGenerator

        capacity = self.capacity_for(length)
        with self._pool_lock:
            for batch in self._batches:
                if batch.max_batch == rows and batch.max_length == capacity:
                    self._batches.remove(batch)
                    return batch
        return BatchGenerator(self, rows, capacity)

    def give_back_batch(self, batch: Any) -> None:
        """Return a batch taken with :meth:`take_batch` (its rows are freed)."""
        batch.clear()
        with self._pool_lock:
            self._batches.append(batch)

    def release_runner(self, owner: object) -> None:
        """Hand ``owner``'s runners back to the pool now, without waiting for the owner to
        be garbage collected (a reference cycle or a kept traceback can delay that)."""
        with self._pool_lock:
            for i, (runner, holder) in enumerate(self._runners):
                if holder() is owner:
                    self._runners[i] = (runner, _released)

    def session_from_proto(self, proto: Any) -> InferenceSession:
        """A session for another graph (an MTP head's chain) on this model's providers."""
        return InferenceSession(proto, providers=self.providers, enable_graphs=self.enable_graphs)

    def __repr__(self) -> str:
        return f"Model({str(self.folder)!r}, type={self.config.model_type!r}, providers={self.providers})"


def _released() -> None:
    """The holder of a runner handed back to the pool (a dead weak reference)."""
    return None


class GeneratorParams:
    """Search options for one generation; unknown option names are refused."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.search = dataclasses.replace(
            model.config.search,
            max_length=min(model.config.search.max_length, model.config.context_length),
        )

    def set_search_options(self, **options: Any) -> None:
        known = {f.name for f in dataclasses.fields(SearchOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidInputError(f"unknown search options {unknown}; known: {sorted(known)}")
        search = validate(dataclasses.replace(self.search, **options))
        vocab = self.model.config.vocab_size
        outside = [token for token, _ in search.logit_bias if token >= vocab]
        if outside:
            raise InvalidInputError(
                f"logit_bias token ids {outside[:5]} are outside the vocabulary of {vocab}"
            )
        if search.max_length > self.model.config.context_length:
            raise InvalidInputError(
                f"max_length {search.max_length} exceeds the model's context length "
                f"{self.model.config.context_length}"
            )
        self.search = search
