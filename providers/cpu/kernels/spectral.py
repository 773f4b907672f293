"""CPU kernels: DFT and STFT (numpy.fft in the input's precision)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import normalize_axis

from ._registry import REGISTRY

Array = np.ndarray


def _complex(ctx: KernelContext, x: Array) -> Array:
    """The signal's last axis (1: real, 2: real and imaginary) as a complex array: complex128
    for float64 input, else complex64 (numpy's FFT then runs in single precision, as
    onnxruntime and the ONNX reference do for float32)."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ValueError(
            f"{ctx.node.describe()}: input {list(x.shape)} must end in an axis of 1 (real) or "
            f"2 (complex) components"
        )
    cdt = np.complex128 if x.dtype == np.float64 else np.complex64
    out = np.empty(x.shape[:-1], cdt)
    out.real = x[..., 0]
    out.imag = x[..., 1] if x.shape[-1] == 2 else 0
    return out


def _stack(y: Array, dtype: np.dtype) -> Array:
    return np.stack([y.real, y.imag], axis=-1).astype(dtype)


@REGISTRY.register("DFT", since=17)
def dft(ctx: KernelContext, x: Array, dft_length: Array | None = None, axis: Array | None = None):
    """Discrete Fourier transform along ``axis`` (an attribute before opset 20, an input from
    20, default -2 of the input / 1 before 20), forward or inverse, full or onesided."""
    if ctx.opset >= 20:
        raw = -2 if axis is None else int(np.asarray(axis).reshape(-1)[0])
    else:
        raw = int(ctx.attr("axis", 1))
    ax = normalize_axis(raw, x.ndim, ctx.node)
    if ax == x.ndim - 1:
        raise ValueError(f"{ctx.node.describe()}: axis {raw} is the component axis")
    n = None if dft_length is None else int(np.asarray(dft_length).reshape(-1)[0])
    if n is not None and n < 1:
        raise ValueError(f"{ctx.node.describe()}: dft_length {n} must be >= 1")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    signal = _complex(ctx, x)
    if inverse and onesided:  # half spectrum in, real signal out
        length = n if n is not None else 2 * (signal.shape[ax] - 1)
        return np.fft.irfft(signal, n=length, axis=ax)[..., None].astype(x.dtype)
    if inverse:
        return _stack(np.fft.ifft(signal, n=n, axis=ax), x.dtype)
    y = np.fft.fft(signal, n=n, axis=ax)
    if onesided:
        y = np.take(y, np.arange(y.shape[ax] // 2 + 1), axis=ax)
    return _stack(y, x.dtype)


@REGISTRY.register("STFT", since=17)
def stft(
    ctx: KernelContext,
    signal: Array,
    frame_step: Array,
    window: Array | None = None,
    frame_length: Array | None = None,
) -> Array:
    """Short-time Fourier transform of [batch, length, 1|2] signals: frames every
    ``frame_step`` samples, each times ``window``; onesided by default."""
    step = int(np.asarray(frame_step).reshape(-1)[0])
    if window is not None:
        length = int(window.shape[0])
        if frame_length is not None and int(np.asarray(frame_length).reshape(-1)[0]) != length:
            raise ValueError(f"{ctx.node.describe()}: frame_length differs from the window's")
    elif frame_length is not None:
        length = int(np.asarray(frame_length).reshape(-1)[0])
    else:
        raise ValueError(f"{ctx.node.describe()}: needs a window or a frame_length")
    x = _complex(ctx, signal)
    if x.ndim != 2 or step < 1 or not 1 <= length <= x.shape[1]:
        raise ValueError(
            f"{ctx.node.describe()}: signal {list(signal.shape)}, frame_step {step} and frame "
            f"length {length} do not make at least one frame"
        )
    frames = (x.shape[1] - length) // step + 1
    starts = np.arange(frames)[:, None] * step + np.arange(length)
    chunks = x[:, starts]
    if window is not None:
        chunks = chunks * window.astype(chunks.real.dtype)
    y = np.fft.fft(chunks, axis=-1)
    if int(ctx.attr("onesided", 1)):
        y = y[..., : length // 2 + 1]
    return _stack(y, signal.dtype)
