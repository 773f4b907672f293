"""Kernel registry: find the implementation of (domain, op_type) for a model's opset."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .errors import GraphCaptureError

if TYPE_CHECKING:  # onnx is imported where a model is read, not with the engine
    import onnx

ONNX_DOMAIN = ""
MS_DOMAIN = "com.microsoft"
#: Domain of the runtime's own ops (SiluMul, ArgMaxProb, NormMatMul, MTPAccept, ...), each
#: declared in ``core.genrt_ops``.
GENRT_DOMAIN = "onnx_genrt"


def normalize_domain(domain: str) -> str:
    """``ai.onnx`` and the empty string are one domain: the empty string."""
    return "" if domain in ("", "ai.onnx") else domain


@dataclass
class NodeInfo:
    """What a kernel knows of the node it runs: op, name, attributes and opset."""

    op_type: str
    name: str
    domain: str
    opset: int
    attrs: dict[str, Any]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, node: onnx.NodeProto, opset: int) -> NodeInfo:
        """The node of ``node`` at ``opset``, attributes decoded."""
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        return cls(
            node.op_type,
            node.name,
            normalize_domain(node.domain),
            opset,
            attrs,
            tuple(node.input),
            tuple(node.output),
        )

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value (``default`` when absent)."""
        return self.attrs.get(name, default)

    def describe(self) -> str:
        """``node 'name' (domain::Op, opset N)``, for error messages."""
        dom = self.domain or "ai.onnx"
        return f"node {self.name or '<unnamed>'!r} ({dom}::{self.op_type}, opset {self.opset})"


def _attr_value(attr: onnx.AttributeProto) -> Any:
    from onnx import AttributeProto, helper, numpy_helper

    if attr.type == AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    if attr.type == AttributeProto.GRAPH:
        return attr.g
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if attr.type == AttributeProto.STRINGS:
        return [v.decode("utf-8") for v in value]
    return value


@dataclass(eq=False)
class KernelContext:
    """What a kernel is handed with its inputs: the node, its planned output buffers and the
    provider's services (stream, scratch, host values of small inputs, output allocation).

    The session builds one per kernel instance when it plans a layout, so a launch costs no
    construction; kernels read these members instead of reaching into their provider.
    ``state`` is the kernel instance's own cache (a prebuilt step, say), kept between calls.
    """

    node: NodeInfo
    provider: ExecutionProviderLike | None = None
    planned: Sequence[Any | None] = ()
    state: dict[str, Any] = field(default_factory=dict)
    #: The provider's stream (the queue its work goes on), or None for a synchronous one.
    stream: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stream = getattr(self.provider, "stream", None)

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value (``default`` when absent)."""
        return self.node.attrs.get(name, default)

    @property
    def opset(self) -> int:
        """The opset of the node's domain."""
        return self.node.opset

    def option(self, name: str, default: Any = None) -> Any:
        """The provider's option ``name`` (a kernel variant switch, see
        ``ProviderOption``); ``default`` without a provider or when it has no such option."""
        options = getattr(self.provider, "OPTIONS", ())
        if any(o.name == name for o in options):
            return self.provider.option(name)
        return default

    @property
    def capturing(self) -> bool:
        """Whether the provider is recording a graph now."""
        return self.provider is not None and self.provider.capturing is not None

    @property
    def recording_addresses(self) -> bool:
        """Whether a device graph is recording, which replays on fixed addresses: no output
        or scratch may be allocated, and no host read made, until it ends."""
        return self.capturing and not self.provider.CAPTURE_EXECUTES

    def out(self, index: int, shape: Sequence[int], dtype: Any) -> Any:
        """The planned buffer for output ``index`` when it fits (shape, dtype, C-contiguous),
        else a new array of the provider (numpy without one). While a device graph records,
        a missing planned buffer is an error: memory allocated inside a capture returns to
        the pool afterwards and a replay would write into someone else's bytes."""
        shape = tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        if index < len(self.planned):
            buf = self.planned[index]
            if (
                buf is not None
                and buf.shape == shape
                and buf.dtype == dt
                and getattr(getattr(buf, "flags", None), "c_contiguous", True)
            ):
                return buf
        if self.provider is None:
            return np.empty(shape, dt)
        if self.recording_addresses:
            raise GraphCaptureError(
                f"{self.node.describe()}: output {index} {list(shape)} {dt} has no planned "
                "buffer; allocating cannot run inside a device graph"
            )
        return self.provider.empty(shape, dt)

    def scratch(self, nbytes: int) -> Any:
        """``nbytes`` of scratch memory (a 1-D uint8 array of the provider) from its
        workspace, which stays at its address while captured graphs use it. Contents are
        undefined; the next kernel may reuse them."""
        if self.provider is None:
            return np.empty(max(int(nbytes), 1), np.uint8)
        return self.provider.workspace.acquire(nbytes, frozen=self.recording_addresses)

    def host_value(self, value: Any) -> np.ndarray | None:
        """The host copy of a small input (a shape, axes, slice bounds) when one is known
        without reading the device: a host array as it is, or the copy the provider kept
        when it uploaded the value; None otherwise (the kernel then reads it back, which a
        device graph cannot record)."""
        if value is None:
            return None
        if isinstance(value, np.ndarray | np.generic | int | float | list | tuple):
            return np.asarray(value)
        if self.provider is None:
            return None
        return self.provider.host_value(value)


class ExecutionProviderLike(Protocol):
    """The provider members a :class:`KernelContext` uses (``core.provider.ExecutionProvider``
    has them all)."""

    CAPTURE_EXECUTES: bool
    capturing: Any
    workspace: Any

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Any: ...

    def host_value(self, array: Any) -> np.ndarray | None: ...


@dataclass(frozen=True)
class TensorType:
    """What placement knows of a value before running: its element type and shape (None
    where unknown; a dimension is an int, a symbolic name or None)."""

    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None


Kernel = Callable[..., Any]
#: ``check(node, input_types)``: why this kernel cannot run ``node`` (None when it can);
#: ``input_types`` has a :class:`TensorType` or None (absent or unknown) per input.
SupportCheck = Callable[[NodeInfo, Sequence["TensorType | None"]], str | None]
#: ``prepack(provider, node, input_index, host_array)``: a constant input in the layout the
#: kernel prefers (a transposed weight, say), made once when the session is built; None
#: keeps the plain array. The kernel then receives whatever prepack returned.
Prepack = Callable[[Any, NodeInfo, int, np.ndarray], Any]
#: ``bind(ctx, inputs, out)``: a prebound zero-argument call that computes the node from
#: these very ``inputs`` into ``out`` (the output buffer, or the tuple of them), for a
#: provider that records calls when it captures a graph (the CPU provider); None keeps the
#: generic call.
Bind = Callable[[KernelContext, Sequence[Any], Any], Callable[[], Any] | None]


@dataclass(frozen=True, eq=False)
class TransposedWeight:
    """A constant MatMul weight [K, N] prepacked as its contiguous transpose ``t`` [N, K]
    (a provider's array), so each output column is one contiguous row of ``t``."""

    t: Any

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical shape [K, N]."""
        return (int(self.t.shape[1]), int(self.t.shape[0]))

    @property
    def dtype(self) -> np.dtype:
        """The weight's element type."""
        return self.t.dtype

    @property
    def ndim(self) -> int:
        """Always 2."""
        return 2


@dataclass(frozen=True)
class KernelDef:
    """One registered implementation, valid from opset ``since`` on."""

    domain: str
    op_type: str
    since: int
    fn: Kernel
    check: SupportCheck | None = None
    prepack: Prepack | None = None
    bind: Bind | None = None


class KernelRegistry:
    """Kernels keyed by (domain, op_type), each with the opset it is valid from."""

    def __init__(self) -> None:
        self._defs: dict[tuple[str, str], list[KernelDef]] = {}

    def register(
        self,
        op_type: str | Iterable[str],
        since: int = 1,
        domain: str = ONNX_DOMAIN,
        check: SupportCheck | None = None,
        prepack: Prepack | None = None,
        bind: Bind | None = None,
    ) -> Callable[[Kernel], Kernel]:
        """Decorator: register ``fn`` for ``op_type`` (or several) from opset ``since``, with
        its optional ``check``, ``prepack`` and ``bind`` (see their types)."""
        names = [op_type] if isinstance(op_type, str) else list(op_type)

        def deco(fn: Kernel) -> Kernel:
            for name in names:
                kdef = KernelDef(normalize_domain(domain), name, since, fn, check, prepack, bind)
                self.add(kdef)
            return fn

        return deco

    def add(self, kdef: KernelDef) -> None:
        """Register ``kdef``; one kernel per (domain, op, since)."""
        defs = self._defs.setdefault((kdef.domain, kdef.op_type), [])
        if any(d.since == kdef.since for d in defs):
            raise ValueError(
                f"kernel {kdef.domain}::{kdef.op_type} since {kdef.since} registered twice"
            )
        bisect.insort(defs, kdef, key=lambda d: d.since)

    def lookup(self, domain: str, op_type: str, opset: int) -> KernelDef | None:
        """The kernel with the greatest ``since`` not above ``opset``."""
        defs = self._defs.get((normalize_domain(domain), op_type))
        if not defs:
            return None
        best = None
        for d in defs:
            if d.since <= opset:
                best = d
        return best

    def ops(self) -> list[tuple[str, str]]:
        """Every (domain, op_type) with a kernel."""
        return sorted(self._defs)

    def versions(self, domain: str, op_type: str) -> list[int]:
        """The ``since`` opsets registered for an op, ascending."""
        return [d.since for d in self._defs.get((normalize_domain(domain), op_type), [])]

    def __contains__(self, key: tuple[str, str]) -> bool:
        return (normalize_domain(key[0]), key[1]) in self._defs

    def __len__(self) -> int:
        return len(self._defs)


def opset_map(model: onnx.ModelProto) -> Mapping[str, int]:
    """Domain -> opset version imported by the model."""
    return {normalize_domain(o.domain): o.version for o in model.opset_import}
