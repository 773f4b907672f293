"""Errors raised by onnx-genrt. Each names the node, op, input or file at fault."""

from __future__ import annotations


class OnnxGenrtError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelLoadError(OnnxGenrtError):
    """The model file is missing, malformed or refers to data outside its folder."""


class UnsupportedOpError(OnnxGenrtError):
    """No provider in the session can run a node."""


class KernelError(OnnxGenrtError):
    """A kernel failed while running a node; the message names the node and op."""


class InvalidInputError(OnnxGenrtError, ValueError):
    """A feed or binding has the wrong name, dtype or shape."""


class UnsupportedGraphSlot(OnnxGenrtError):
    """A provider was asked to use a graph slot it does not declare."""


class GraphCaptureError(OnnxGenrtError):
    """Capturing a device graph failed; the slot stays latched until it is reset."""


class ProviderUnavailableError(OnnxGenrtError):
    """A provider was requested that is not installed or cannot run here."""


class UnknownProviderError(ProviderUnavailableError, InvalidInputError):
    """No provider of the requested name is installed: the name is wrong (a usage error)."""


class NonFiniteError(OnnxGenrtError, FloatingPointError):
    """A tensor that must be finite (for example logits) holds NaN or infinity."""


class ConcurrentUseError(OnnxGenrtError, RuntimeError):
    """An object that serves one thread at a time (a Generator) was entered by a second."""
