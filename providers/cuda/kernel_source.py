"""The ``__global__`` kernels of a CUDA source as text: each one's parameters and body, and
whether it waits on the previous grid (``GRID_WAIT()``, ``kernels/_common.DEVICE_COMMON``)
before it touches memory, which is what makes it safe to launch with programmatic dependent
launch (``launch.Kernel``). The kernels' own sources are regular enough for this: comments
are dropped, macros without arguments expanded (``GQA_PARAMS``), braces counted.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

#: Where a kernel waits for the grid before it (griddepcontrol.wait on sm_90+).
WAIT = "GRID_WAIT();"
#: What a kernel may call before WAIT (``pdl_prefetch``, ``pdl_prefetch_bytes``): an L2
#: prefetch of its weights, which changes no value any load returns (a hint; the L2 is where
#: all SMs' writes meet).
PREFETCH = r"pdl_prefetch\w*"

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_MACRO = re.compile(r"^[ \t]*#define[ \t]+([A-Za-z_]\w*)[ \t]+((?:[^\n\\]|\\\n)*)$", re.MULTILINE)
_KERNEL = re.compile(
    r"__global__\s+void\s+(?:(?:__launch_bounds__|__cluster_dims__)\s*\([^)]*\)\s*)*"
    r"([A-Za-z_]\w*)\s*\("
)
_POINTER = re.compile(r"\*\s*(?:__restrict__\s*)?([A-Za-z_]\w*)\s*$")


@dataclass(frozen=True)
class KernelText:
    """One ``__global__`` function: its name, parameter declarations and body (no braces)."""

    name: str
    params: tuple[str, ...]
    body: str

    @property
    def pointer_params(self) -> tuple[str, ...]:
        """Names of the parameters that are pointers (what a kernel reads or writes)."""
        names = (_POINTER.search(p.strip()) for p in self.params)
        return tuple(m.group(1) for m in names if m)

    def before_wait(self) -> str | None:
        """The body up to its first GRID_WAIT(), or None when it has none."""
        at = self.body.find(WAIT)
        return None if at < 0 else self.body[:at]


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_}{close} from offset {start}")


def _expand(text: str) -> str:
    """``text`` with comments dropped and object-like macros expanded (one level)."""
    text = _COMMENT.sub("", text)
    macros = {m.group(1): m.group(2).replace("\\\n", " ") for m in _MACRO.finditer(text)}
    text = _MACRO.sub("", text)
    for name, value in macros.items():
        text = re.sub(rf"\b{name}\b(?!\s*\()", lambda _m, v=value: v, text)
    return text


@functools.cache
def kernels(source: str) -> dict[str, KernelText]:
    """Every ``__global__`` kernel of ``source`` by name."""
    text = _expand(source)
    found: dict[str, KernelText] = {}
    for m in _KERNEL.finditer(text):
        open_paren = m.end() - 1
        close_paren = _matching(text, open_paren, "(", ")")
        brace = text.index("{", close_paren)
        end = _matching(text, brace, "{", "}")
        params = tuple(
            p.strip() for p in text[open_paren + 1 : close_paren].split(",") if p.strip()
        )
        found[m.group(1)] = KernelText(m.group(1), params, text[brace + 1 : end])
    return found


def base_name(name: str) -> str:
    """``gemv_nk`` of ``gemv_nk<half_t, 1, 1, 0, 0>``."""
    return name.split("<", 1)[0].strip()


def has_wait(source: str, name: str) -> bool:
    """Whether kernel ``name`` (a template instance is fine) of ``source`` has a GRID_WAIT()
    (``pre_wait_problems`` checks, in the tests, that nothing before it touches memory)."""
    kernel = kernels(source).get(base_name(name))
    return kernel is not None and kernel.before_wait() is not None


def pre_wait_problems(kernel: KernelText, weights: tuple[str, ...] = ()) -> list[str]:
    """Why ``kernel`` is not safe to launch early: no GRID_WAIT(), or before it a return, a
    barrier, a pointer parameter used other than as a ``pdl_prefetch`` address, or a
    prefetch of a pointer that is not one of its ``weights`` (an activation is not ready)."""
    head = kernel.before_wait()
    if head is None:
        return [f"{kernel.name}: no {WAIT}"]
    problems = []
    for word in ("return", "__syncthreads", "atomic", "asm"):
        if re.search(rf"\b{word}", head):
            problems.append(f"{kernel.name}: '{word}' before {WAIT}")
    rest, prefetched, at = [], [], 0
    for m in re.finditer(rf"\b{PREFETCH}\s*\(", head):  # set the prefetch calls apart
        rest.append(head[at : m.start()])
        at = _matching(head, m.end() - 1, "(", ")") + 1
        prefetched.append(head[m.end() : at - 1])
    rest.append(head[at:])
    remaining, prefetched_text = "".join(rest), " ".join(prefetched)
    for name in kernel.pointer_params:
        if _uses(name, remaining):
            problems.append(f"{kernel.name}: pointer '{name}' used before {WAIT}")
        if _uses(name, prefetched_text) and name not in weights:
            problems.append(f"{kernel.name}: prefetches '{name}', which is not a weight")
    return problems


def _uses(name: str, text: str) -> bool:
    """Whether ``text`` names the variable ``name`` (not a member of that name: threadIdx.x)."""
    return re.search(rf"(?<![\w.])(?<!->){name}\b", text) is not None
