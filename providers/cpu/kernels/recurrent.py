"""CPU kernels: the classic recurrent layers RNN, GRU and LSTM (numpy, one step at a time;
each step is a batched matmul). Forward, reverse and bidirectional, sequence_lens, clip,
layout 0/1, custom activations, GRU's linear_before_reset, LSTM peepholes and input_forget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
Activation = Callable[[Array], Array]

_DEFAULT_ALPHA = {"Affine": 1.0, "LeakyRelu": 0.01, "ThresholdedRelu": 1.0, "ScaledTanh": 1.0,
                  "HardSigmoid": 0.2, "Elu": 1.0}  # fmt: skip
_DEFAULT_BETA = {"Affine": 0.0, "ScaledTanh": 1.0, "HardSigmoid": 0.5}


def _make_activation(name: str, alpha: float, beta: float) -> Activation:
    table: dict[str, Activation] = {
        "Relu": lambda x: np.maximum(x, 0.0),
        "Tanh": np.tanh,
        "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
        "Affine": lambda x: alpha * x + beta,
        "LeakyRelu": lambda x: np.where(x >= 0, x, alpha * x),
        "ThresholdedRelu": lambda x: np.where(x > alpha, x, 0.0),
        "ScaledTanh": lambda x: alpha * np.tanh(beta * x),
        "HardSigmoid": lambda x: np.clip(alpha * x + beta, 0.0, 1.0),
        "Elu": lambda x: np.where(x >= 0, x, alpha * (np.exp(x) - 1.0)),
        "Softsign": lambda x: x / (1.0 + np.abs(x)),
        "Softplus": lambda x: np.log1p(np.exp(x)),
    }
    return table[name]


#: Gate count and default activations (one direction) of each op.
_LAYOUT = {"RNN": (1, ("Tanh",)), "GRU": (3, ("Sigmoid", "Tanh")),
           "LSTM": (4, ("Sigmoid", "Tanh", "Tanh"))}  # fmt: skip
_KNOWN = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh",
          "HardSigmoid", "Elu", "Softsign", "Softplus")  # fmt: skip


def _directions(node: NodeInfo) -> int:
    return 2 if node.attr("direction", "forward") == "bidirectional" else 1


def _recurrent_check(node: NodeInfo, _types: object = ()) -> str | None:
    """Why an RNN / GRU / LSTM node's attributes cannot run, or None."""
    direction = node.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        return f"{node.op_type} direction={direction!r} is not forward, reverse or bidirectional"
    names = node.attr("activations")
    if names is not None:
        per_dir = len(_LAYOUT[node.op_type][1])
        if len(names) != per_dir * _directions(node):
            return (
                f"{node.op_type} needs {per_dir * _directions(node)} activations for direction "
                f"{direction!r}, got {len(names)}"
            )
        unknown = [n for n in names if n not in _KNOWN]
        if unknown:
            return f"{node.op_type} activation {unknown[0]!r} is not one of {', '.join(_KNOWN)}"
    if node.attr("layout", 0) not in (0, 1):
        return f"{node.op_type} layout={node.attr('layout')} must be 0 or 1"
    return None


def _activations(node: NodeInfo) -> list[list[Activation]]:
    """Activations per direction, with their alpha/beta (consumed by position)."""
    per_dir = _LAYOUT[node.op_type][1]
    dirs = _directions(node)
    names = list(node.attr("activations") or per_dir * dirs)
    alphas = list(node.attr("activation_alpha") or [])
    betas = list(node.attr("activation_beta") or [])
    made = []
    for i, name in enumerate(names):
        alpha = alphas[i] if i < len(alphas) else _DEFAULT_ALPHA.get(name, 0.0)
        beta = betas[i] if i < len(betas) else _DEFAULT_BETA.get(name, 0.0)
        made.append(_make_activation(name, float(alpha), float(beta)))
    n = len(per_dir)
    return [made[d * n : (d + 1) * n] for d in range(dirs)]


@dataclass
class _Weights:
    """One direction's weights, float64: W [G*H, I], R [G*H, H], biases [G*H] each."""

    w: Array
    r: Array
    wb: Array
    rb: Array
    peep: Array | None = None


def _prepare(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None,
    seq_lens: Array | None,
    p: Array | None = None,
) -> tuple[Array, list[_Weights], Array, int]:
    """Time-major float64 X, per-direction weights, per-row lengths, hidden size."""
    gates = _LAYOUT[ctx.node.op_type][0]
    dirs = _directions(ctx.node)
    layout = int(ctx.attr("layout", 0))
    xs = np.swapaxes(x, 0, 1) if layout else x
    if xs.ndim != 3:
        raise ValueError(f"{ctx.node.describe()}: X must be rank 3, got {list(x.shape)}")
    seq, batch, _ = xs.shape
    hidden = int(ctx.attr("hidden_size", r.shape[-1]))
    if w.shape != (dirs, gates * hidden, xs.shape[2]) or r.shape != (dirs, gates * hidden, hidden):
        raise ValueError(
            f"{ctx.node.describe()}: W {list(w.shape)} / R {list(r.shape)} do not fit "
            f"{dirs} direction(s), {gates} gate(s), hidden_size {hidden} and input size "
            f"{xs.shape[2]}"
        )
    bias = np.zeros((dirs, 2 * gates * hidden)) if b is None else b.astype(np.float64)
    peep = None if p is None else p.astype(np.float64).reshape(dirs, 3 * hidden)
    weights = [
        _Weights(
            w[d].astype(np.float64),
            r[d].astype(np.float64),
            bias[d, : gates * hidden],
            bias[d, gates * hidden :],
            None if peep is None else peep[d],
        )
        for d in range(dirs)
    ]
    lens = np.full(batch, seq, np.int64) if seq_lens is None else seq_lens.astype(np.int64)
    if lens.shape != (batch,) or lens.min(initial=0) < 0 or lens.max(initial=0) > seq:
        raise ValueError(
            f"{ctx.node.describe()}: sequence_lens must be {batch} values in [0, {seq}]"
        )
    return xs.astype(np.float64), weights, lens, hidden


def _initial(state: Array | None, dirs: int, batch: int, hidden: int, layout: int) -> Array:
    if state is None:
        return np.zeros((dirs, batch, hidden))
    s = np.swapaxes(state, 0, 1) if layout else state
    return s.astype(np.float64)


Step = Callable[[Array, tuple[Array, ...], _Weights, Sequence[Activation]], tuple[Array, ...]]


def _run(
    ctx: KernelContext,
    xs: Array,
    weights: list[_Weights],
    lens: Array,
    states: list[Array],
    step: Step,
) -> tuple[Array, list[Array]]:
    """Run ``step`` over time in each direction; rows past their length keep their state
    and output zeros. Returns Y [seq, dirs, batch, hidden] and the final states."""
    seq, batch = xs.shape[:2]
    hidden = states[0].shape[-1]
    acts = _activations(ctx.node)
    reverse_only = ctx.attr("direction", "forward") == "reverse"
    y = np.zeros((seq, len(weights), batch, hidden))
    finals: list[list[Array]] = [[] for _ in states]
    for d, wd in enumerate(weights):
        backwards = reverse_only or d == 1
        state = tuple(s[d] for s in states)
        for t in range(seq):
            # reverse runs over each row's own valid span, last valid position first
            pos = (lens - 1 - t) if backwards else np.full(batch, t)
            live = (t < lens)[:, None]
            rows = np.clip(pos, 0, seq - 1)
            xt = xs[rows, np.arange(batch)]
            new = step(xt, state, wd, acts[d])
            state = tuple(np.where(live, n, s) for n, s in zip(new, state, strict=True))
            y[rows, d, np.arange(batch)] = np.where(live, state[0], y[rows, d, np.arange(batch)])
        for i, s in enumerate(state):
            finals[i].append(s)
    return y, [np.stack(f) for f in finals]


def _clip(ctx: KernelContext) -> Callable[[Array], Array]:
    limit = ctx.attr("clip")
    if limit is None:
        return lambda a: a
    c = float(limit)
    return lambda a: np.clip(a, -c, c)


def _outputs(ctx: KernelContext, x: Array, y: Array, finals: list[Array]) -> tuple[Array, ...]:
    layout = int(ctx.attr("layout", 0))
    if layout:
        y = np.transpose(y, (2, 0, 1, 3))
        finals = [np.swapaxes(f, 0, 1) for f in finals]
    return tuple(np.ascontiguousarray(a, dtype=x.dtype) for a in (y, *finals))


@REGISTRY.register("RNN", since=7, check=_recurrent_check)
def rnn(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    seq_lens: Array | None = None,
    initial_h: Array | None = None,
) -> tuple[Array, ...]:
    """Ht = f(Xt W^T + Ht-1 R^T + Wb + Rb)."""
    xs, weights, lens, hidden = _prepare(ctx, x, w, r, b, seq_lens)
    layout = int(ctx.attr("layout", 0))
    h0 = _initial(initial_h, len(weights), xs.shape[1], hidden, layout)
    clip = _clip(ctx)

    def step(
        xt: Array, state: tuple[Array, ...], wd: _Weights, acts: Sequence[Activation]
    ) -> tuple[Array, ...]:
        (h,) = state
        return (acts[0](clip(xt @ wd.w.T + h @ wd.r.T + wd.wb + wd.rb)),)

    y, finals = _run(ctx, xs, weights, lens, [h0], step)
    return _outputs(ctx, x, y, finals)


@REGISTRY.register("GRU", since=7, check=_recurrent_check)
def gru(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    seq_lens: Array | None = None,
    initial_h: Array | None = None,
) -> tuple[Array, ...]:
    """Update gate z, reset gate r, candidate h (reset before or after R's matmul)."""
    xs, weights, lens, hidden = _prepare(ctx, x, w, r, b, seq_lens)
    layout = int(ctx.attr("layout", 0))
    h0 = _initial(initial_h, len(weights), xs.shape[1], hidden, layout)
    clip = _clip(ctx)
    before_reset = bool(ctx.attr("linear_before_reset", 0))
    hs = slice(2 * hidden, 3 * hidden)

    def step(
        xt: Array, state: tuple[Array, ...], wd: _Weights, acts: Sequence[Activation]
    ) -> tuple[Array, ...]:
        (h,) = state
        xw = xt @ wd.w.T + wd.wb
        zr = acts[0](clip(xw[:, : 2 * hidden] + h @ wd.r[: 2 * hidden].T + wd.rb[: 2 * hidden]))
        z, rg = zr[:, :hidden], zr[:, hidden:]
        if before_reset:
            cand = xw[:, hs] + rg * (h @ wd.r[hs].T + wd.rb[hs])
        else:
            cand = xw[:, hs] + (rg * h) @ wd.r[hs].T + wd.rb[hs]
        ht = acts[1](clip(cand))
        return ((1.0 - z) * ht + z * h,)

    y, finals = _run(ctx, xs, weights, lens, [h0], step)
    return _outputs(ctx, x, y, finals)


@REGISTRY.register("LSTM", since=7, check=_recurrent_check)
def lstm(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    seq_lens: Array | None = None,
    initial_h: Array | None = None,
    initial_c: Array | None = None,
    p: Array | None = None,
) -> tuple[Array, ...]:
    """Gates i, o, f, cell c (order iofc), optional peepholes P = [Pi, Po, Pf]."""
    xs, weights, lens, hidden = _prepare(ctx, x, w, r, b, seq_lens, p)
    layout = int(ctx.attr("layout", 0))
    batch = xs.shape[1]
    h0 = _initial(initial_h, len(weights), batch, hidden, layout)
    c0 = _initial(initial_c, len(weights), batch, hidden, layout)
    clip = _clip(ctx)
    couple = bool(ctx.attr("input_forget", 0))
    zeros = np.zeros(3 * hidden)

    def step(
        xt: Array, state: tuple[Array, ...], wd: _Weights, acts: Sequence[Activation]
    ) -> tuple[Array, ...]:
        h, c = state
        f_act, g_act, h_act = acts
        pre = xt @ wd.w.T + h @ wd.r.T + wd.wb + wd.rb
        peep = wd.peep if wd.peep is not None else zeros
        pi, po, pf = peep[:hidden], peep[hidden : 2 * hidden], peep[2 * hidden :]
        i = f_act(clip(pre[:, :hidden] + pi * c))
        f = 1.0 - i if couple else f_act(clip(pre[:, 2 * hidden : 3 * hidden] + pf * c))
        cell = g_act(clip(pre[:, 3 * hidden :]))
        c_new = f * c + i * cell
        o = f_act(clip(pre[:, hidden : 2 * hidden] + po * c_new))
        return o * h_act(c_new), c_new

    y, finals = _run(ctx, xs, weights, lens, [h0, c0], step)
    return _outputs(ctx, x, y, finals)
