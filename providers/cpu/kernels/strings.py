"""CPU kernels on string tensors (numpy object arrays of ``str``): StringNormalizer,
StringConcat, StringSplit, RegexFullMatch and ai.onnx.ml LabelEncoder."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
_CASE_ACTIONS = ("NONE", "LOWER", "UPPER")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _strings(ctx: KernelContext, x: Array, name: str) -> Array:
    """``x`` as an object array of ``str`` (bytes decoded as UTF-8), or a clear error."""
    if x.dtype.kind not in "OSU":
        raise ValueError(f"{ctx.node.describe()}: input {name} must be a string tensor")
    return np.array([_text(v) for v in x.reshape(-1)], dtype=object).reshape(x.shape)


def _string_normalizer_check(node: NodeInfo, _types: object = ()) -> str | None:
    action = node.attr("case_change_action", "NONE")
    if action not in _CASE_ACTIONS:
        return f"StringNormalizer case_change_action={action!r} is not one of NONE, LOWER, UPPER"
    locale = node.attr("locale", "")
    if locale and not locale.lower().startswith(("en", "c", "posix")):
        return (
            f"StringNormalizer locale={locale!r} is not supported (case changes follow "
            f"Unicode's default rules, as for 'en_US')"
        )
    return None


@REGISTRY.register("StringNormalizer", since=10, check=_string_normalizer_check)
def string_normalizer(ctx: KernelContext, x: Array) -> Array:
    """Drop ``stopwords`` (case-insensitively unless is_case_sensitive=1), then change case.
    Input [C] or [1, C]; when every string is dropped the result is one empty string."""
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise ValueError(
            f"{ctx.node.describe()}: X has shape {list(x.shape)}; StringNormalizer takes "
            f"[C] or [1, C]"
        )
    words = _strings(ctx, x, "X").reshape(-1).tolist()
    stop = [_text(s) for s in ctx.attr("stopwords", [])]
    if int(ctx.attr("is_case_sensitive", 0)):
        kept = [w for w in words if w not in set(stop)]
    else:
        folded = {s.casefold() for s in stop}
        kept = [w for w in words if w.casefold() not in folded]
    action = ctx.attr("case_change_action", "NONE")
    if action == "LOWER":
        kept = [w.lower() for w in kept]
    elif action == "UPPER":
        kept = [w.upper() for w in kept]
    out = np.array(kept or [""], dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


@REGISTRY.register("StringConcat", since=20)
def string_concat(ctx: KernelContext, x: Array, y: Array) -> Array:
    """Elementwise X + Y with numpy broadcasting."""
    a, b = _strings(ctx, x, "X"), _strings(ctx, y, "Y")
    return np.asarray(np.add(a, b, dtype=object), dtype=object)


@REGISTRY.register("StringSplit", since=20)
def string_split(ctx: KernelContext, x: Array) -> tuple[Array, Array]:
    """Split each string at ``delimiter`` (absent or empty: at runs of whitespace) at most
    ``maxsplit`` times; Y pads the pieces with "" to the longest row, Z counts them."""
    delimiter = ctx.attr("delimiter", "") or None
    maxsplit = ctx.attr("maxsplit")
    limit = -1 if maxsplit is None else int(maxsplit)
    if maxsplit is not None and limit < 1:
        raise ValueError(f"{ctx.node.describe()}: maxsplit={maxsplit} must be >= 1")
    pieces = [s.split(delimiter, limit) for s in _strings(ctx, x, "X").reshape(-1)]
    width = max((len(p) for p in pieces), default=0)
    y = np.full((len(pieces), width), "", dtype=object)
    for row, parts in enumerate(pieces):
        y[row, : len(parts)] = parts
    counts = np.array([len(p) for p in pieces], np.int64).reshape(x.shape)
    return y.reshape(*x.shape, width), counts


def _regex_check(node: NodeInfo, _types: object = ()) -> str | None:
    pattern = node.attr("pattern")
    if pattern is None:
        return "RegexFullMatch needs the pattern attribute"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"RegexFullMatch pattern {pattern!r} does not compile: {exc}"
    return None


@REGISTRY.register("RegexFullMatch", since=20, check=_regex_check)
def regex_full_match(ctx: KernelContext, x: Array) -> Array:
    """Whether each string matches ``pattern`` in full. Patterns run on Python's ``re``,
    which agrees with RE2 on the common syntax (RE2-only constructs fail to compile)."""
    pattern = re.compile(ctx.attr("pattern"))
    flat = _strings(ctx, x, "X").reshape(-1)
    return np.array([pattern.fullmatch(s) is not None for s in flat], bool).reshape(x.shape)


# -- ai.onnx.ml LabelEncoder ---------------------------------------------------------------

_ENCODER_KINDS = ("strings", "int64s", "floats", "tensor")


def _encoder_side(node: NodeInfo, side: str) -> Array | None:
    """The ``keys_*`` or ``values_*`` attribute as an array (strings as ``str``), or None."""
    given = [k for k in _ENCODER_KINDS if node.attr(f"{side}_{k}") is not None]
    if len(given) != 1:
        return None
    kind = given[0]
    raw = node.attr(f"{side}_{kind}")
    if kind == "strings" or (kind == "tensor" and np.asarray(raw).dtype.kind in "OSU"):
        return np.array([_text(v) for v in np.asarray(raw).reshape(-1)], dtype=object)
    dtype = {"int64s": np.int64, "floats": np.float32}.get(kind)
    return np.asarray(raw, dtype=dtype).reshape(-1)


def _label_encoder_check(node: NodeInfo, _types: object = ()) -> str | None:
    keys, values = _encoder_side(node, "keys"), _encoder_side(node, "values")
    if keys is None or values is None:
        return "LabelEncoder needs exactly one keys_* and one values_* attribute"
    if keys.shape != values.shape:
        return f"LabelEncoder has {keys.size} keys but {values.size} values"
    return None


def _encoder_default(node: NodeInfo, values: Array) -> Any:
    tensor = node.attr("default_tensor")
    if tensor is not None:
        flat = np.asarray(tensor).reshape(-1)
        return _text(flat[0]) if values.dtype == object else flat[0]
    if values.dtype == object:
        return _text(node.attr("default_string", "_Unused"))
    if values.dtype.kind in "iu":
        return int(node.attr("default_int64", -1))
    return float(node.attr("default_float", -0.0))


@REGISTRY.register("LabelEncoder", since=1, domain="ai.onnx.ml", check=_label_encoder_check)
def label_encoder(ctx: KernelContext, x: Array) -> Array:
    """Map each element through the keys -> values table; unknown keys get the default."""
    keys = _encoder_side(ctx.node, "keys")
    values = _encoder_side(ctx.node, "values")
    assert keys is not None and values is not None  # guaranteed by the check
    flat: Sequence[Any]
    if keys.dtype == object:
        flat = _strings(ctx, x, "X").reshape(-1).tolist()
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))
    else:
        flat = x.reshape(-1).tolist()
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))
    default = _encoder_default(ctx.node, values)
    mapped = [table.get(v, default) for v in flat]
    return np.array(mapped, dtype=values.dtype).reshape(x.shape)
