"""The GPU lane's target table: each speed target of issues 17 and 19 beside the figure the
lane measured, whether it is met, and the anchor the issue compares it with; and issue 17's
batched rows that did not give the single sequence's tokens (none may).

Reads the logs ``scripts/gpu_lane.sh bench`` and ``scripts/gpu_long_bench.sh`` leave in one
folder (``bench-fp16.txt``, ``step-int4.txt``, ``hf_bench.txt``, ``long.txt``, ...); a target
whose log is missing says "not measured". Each target has a per-op step profile the lane
writes beside them (``profile-*.txt``: ``onnx-genrt profile`` of the step the target times),
which shows where the time goes; an unmet target names it, or says the lane left none.

    onnx-genrt lane-targets LOGDIR
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from onnx_genrt.core.errors import InvalidInputError

#: A bench table row: label, prefill ms, decode tok/s (``onnx-genrt bench``'s format).
_BENCH_ROW = re.compile(r"^(?P<label>\S.*?\])\s+(?P<prefill>[\d.]+|-)\s+(?P<tok>[\d.]+)\s+[\d.]+%")
#: A bench row's "same tokens" column, after the spread, vs genai and vs ort loop columns.
_SAME_TOKENS = re.compile(r"%\s+\S+\s+\S+\s+(?P<same>yes|NO)\b")
#: The label of a batched row of ``onnx-genrt bench --streams`` (without --compare-serial's).
_STREAMS_LABEL = re.compile(r"^onnx-genrt\[[^\]]*,\d+ streams\]$")
#: ``onnx-genrt step-cost``: the verify / decode ratio, and the verify + MTP chain's.
_STEP_RATIO = re.compile(r"verify/decode (?P<x>[\d.]+)x")
#: The draft vocabulary a ``step-{prec}-draft.txt`` was measured with (its first line).
_DRAFT_IDS = re.compile(r"draft vocab (\d+)")
_CHAIN_RATIO = re.compile(r"verify \+ MTP chain of \d+ [\d.]+ ms \((?P<x>[\d.]+)x decode\)")
#: ``scripts/hf_bench.py``: config, decode tok/s, TTFT ms, ids.
_HF_ROW = re.compile(r"^(?P<config>[a-z][\w:+-]*)\s+(?P<tok>[\d.]+)\s+(?P<ttft>[\d.]+)\s+\S+")
#: ``scripts/hf_batch_bench.py``: batch, cache, TTFT ms, decode tok/s, vs batch 1.
_HF_BATCH_ROW = re.compile(r"^\s*(?P<batch>\d+)\s+\w+\s+[\d.]+\s+(?P<tok>[\d.]+)\s+[\d.]+x")
#: ``scripts/gpu_long_bench.sh``'s section headers in ``long.txt``.
_LONG_HEADER = re.compile(r"^== (?P<p>\d+) prompt tokens, \d+ new, (?P<setting>\S+)")
_LONG_HF_HEADER = re.compile(r"^== HF transformers.*?, (?P<p>\d+) prompt tokens")
#: ``onnx-genrt bench --provider cuda``'s roofline line: MB a token, the bandwidth floor.
_ROOFLINE = re.compile(r"^roofline: (?P<mb>[\d.]+) MB .* ceiling is (?P<floor>\d+) tok/s")
#: ``onnx-genrt profile``'s first line, and its rows by op: op, nodes, ms, share.
_PROFILE_HEAD = re.compile(r"^step (?P<step>[\d.]+) ms \| graph replay alone (?P<replay>[\d.]+) ms")
_PROFILE_OP = re.compile(r"^(?P<op>[A-Za-z][\w.:]*)\s+(?P<nodes>\d+)\s+[\d.]+\s+(?P<share>[\d.]+)%")
#: ``scripts/gpu_scale_bench.sh``'s logs: ``bench-<shape>-<precision>.txt``.
_SCALE_LOG = re.compile(r"^bench-(?P<shape>[\d.]+b)-(?P<prec>\w+)\.txt$")

#: Anchors that are not measured in the lane (shared/notes/anchors.md): megakernel-class
#: decoders reach about 78% of HBM bandwidth at batch 1; the 0.5B fp16 weights are 0.99 GB.
MEGAKERNEL_0_5B_FP16 = "megakernel-class ~3800 tok/s (78% of 4.8 TB/s; anchors.md)"


@dataclass
class Target:
    """One row: what is measured, its figure (None: not measured), the bound, the anchor."""

    name: str
    issue: int
    figure: float | None
    bound: float
    at_least: bool  # True: the figure must reach the bound; False: stay under it
    unit: str = ""
    anchor: str = ""
    profile: str = ""  # the step profile that shows where the time goes
    profile_summary: str = ""  # its step, replay and largest ops, read where the lane wrote it

    @property
    def met(self) -> bool | None:
        if self.figure is None:
            return None
        return self.figure >= self.bound if self.at_least else self.figure <= self.bound

    def line(self) -> str:
        fig = "not measured" if self.figure is None else f"{self.figure:.2f}{self.unit}"
        bound = f"{'>=' if self.at_least else '<='} {self.bound:g}{self.unit}"
        met = {None: "-", True: "yes", False: "NO"}[self.met]
        notes = [self.anchor] if self.anchor else []
        if self.met is False and self.profile:
            notes.append(
                f"where the time goes: {self.profile} ({self.profile_summary})"
                if self.profile_summary
                else f"no step profile ({self.profile} not written)"
            )
        return f"{self.name:<40}{fig:>14}  {bound:<10}{met:>4}  {self.issue:>5}  {'; '.join(notes)}"


def profile_summary(text: str, ops: int = 3) -> str:
    """One line of an ``onnx-genrt profile`` log: the step and its graph replay, and the
    ops with the largest share of the nodes' time (or why the profile has none)."""
    lines = text.splitlines()
    head = next(filter(None, map(_PROFILE_HEAD.match, lines)), None)
    if head is None:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "empty")
        return f"no profile in it: {last[:120]}"
    shares = [m for m in map(_PROFILE_OP.match, lines) if m][:ops]
    top = ", ".join(f"{m['op']} {m['share']}% ({m['nodes']} nodes)" for m in shares)
    return f"step {head['step']} ms, replay {head['replay']} ms" + (f"; {top}" if top else "")


def bench_rows(text: str) -> dict[str, tuple[float | None, float]]:
    """``onnx-genrt bench`` rows by label: (prefill ms or None, decode tok/s)."""
    rows = {}
    for line in text.splitlines():
        m = _BENCH_ROW.match(line)
        if m:
            prefill = None if m["prefill"] == "-" else float(m["prefill"])
            rows[m["label"]] = (prefill, float(m["tok"]))
    return rows


def stream_rows_parting(text: str) -> tuple[int, int] | None:
    """Among the bench's batched rows (``N streams``): how many said ``same tokens: NO``
    (a row whose tokens are not the single sequence's), and how many there are; None
    without any."""
    parting = total = 0
    for line in text.splitlines():
        row, same = _BENCH_ROW.match(line), _SAME_TOKENS.search(line)
        if row and same and _STREAMS_LABEL.match(row["label"]):
            total += 1
            parting += same["same"] == "NO"
    return (parting, total) if total else None


def step_ratios(text: str) -> tuple[float | None, float | None]:
    """``onnx-genrt step-cost``'s verify / decode and verify + MTP chain / decode."""
    verify, chain = _STEP_RATIO.search(text), _CHAIN_RATIO.search(text)
    return (float(verify["x"]) if verify else None, float(chain["x"]) if chain else None)


def hf_best(text: str) -> tuple[str, float, float] | None:
    """HF transformers' fastest decoding config: (config, tok/s, TTFT ms)."""
    rows = [m for m in map(_HF_ROW.match, text.splitlines()) if m and m["config"] != "roofline"]
    if not rows:
        return None
    best = max(rows, key=lambda m: float(m["tok"]))
    return best["config"], float(best["tok"]), float(best["ttft"])


def hf_batch(text: str) -> dict[int, float]:
    """HF transformers' batched decode tok/s by batch size."""
    return {
        int(m["batch"]): float(m["tok"]) for m in map(_HF_BATCH_ROW.match, text.splitlines()) if m
    }


def long_rows(text: str) -> tuple[dict[tuple[int, str], tuple[float, float]], dict[int, float]]:
    """``long.txt``: our (prefill ms, decode tok/s) by (prompt tokens, setting), and HF's
    fastest TTFT by prompt tokens."""
    ours: dict[tuple[int, str], tuple[float, float]] = {}
    hf: dict[int, float] = {}
    key: tuple[int, str] | None = None
    hf_prompt: int | None = None
    for line in text.splitlines():
        if m := _LONG_HEADER.match(line):
            key, hf_prompt = (int(m["p"]), m["setting"]), None
        elif m := _LONG_HF_HEADER.match(line):
            key, hf_prompt = None, int(m["p"])
        elif key is not None and (row := _BENCH_ROW.match(line)) and row["prefill"] != "-":
            ours[key] = (float(row["prefill"]), float(row["tok"]))
        elif hf_prompt is not None and (row := _HF_ROW.match(line)) and row["config"] != "roofline":
            ttft = float(row["ttft"])
            hf[hf_prompt] = min(ttft, hf.get(hf_prompt, ttft))
    return ours, hf


def _read(folder: Path, name: str) -> str:
    path = folder / name
    return path.read_text(errors="replace") if path.is_file() else ""


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(folder: Path) -> list[Target]:
    """Every target with the figure ``folder``'s logs give for it."""
    out: list[Target] = []
    hf = hf_best(_read(folder, "hf_bench.txt"))
    hf_note = f"HF {hf[0]} {hf[1]:.1f} tok/s, TTFT {hf[2]:.2f} ms (same run)" if hf else ""
    for prec, bound in (("fp16", 2200.0), ("int4", 3000.0)):
        bench = _read(folder, f"bench-{prec}.txt")
        rows = bench_rows(bench)
        graphed = rows.get("onnx-genrt[cuda]")
        anchor = hf_note + (f"; {MEGAKERNEL_0_5B_FP16}" if prec == "fp16" else "")
        profile = f"profile-{prec}.txt"
        out.append(
            Target(
                f"0.5B {prec} graphed greedy, tok/s",
                19,
                graphed and graphed[1],
                bound,
                True,
                anchor=anchor,
                profile=profile,
            )  # fmt: skip
        )
        verify, chain = step_ratios(_read(folder, f"step-{prec}.txt"))
        out.append(
            Target(
                f"0.5B {prec} verify (M=5) / decode",
                19,
                verify,
                1.25,
                False,
                "x",
                profile=f"profile-verify-{prec}.txt",
            )  # fmt: skip
        )
        out.append(Target(f"0.5B {prec} verify + MTP chain / decode", 19, chain, 1.6, False, "x",
                          profile=f"profile-chain-{prec}.txt"))  # fmt: skip
        draft = _read(folder, f"step-{prec}-draft.txt")
        if draft:  # the same chain drafting over the first ids only (gpu_llm_bench.sh)
            ids = _DRAFT_IDS.search(draft)
            label = (
                f"0.5B {prec} verify + MTP chain, {ids[1] if ids else 'a'}-id draft vocab / decode"
            )
            out.append(Target(label, 19, step_ratios(draft)[1], 1.6, False, "x",
                              profile=f"profile-chain-{prec}.txt"))  # fmt: skip
        one, many = rows.get("onnx-genrt[cuda,1 streams]"), rows.get("onnx-genrt[cuda,32 streams]")
        batch = hf_batch(_read(folder, "hf_batch.txt")) if prec == "fp16" else {}
        hf_scale = _ratio(batch.get(32), batch.get(1))
        out.append(
            Target(
                f"0.5B {prec} 32 streams / 1 stream",
                17,
                _ratio(many and many[1], one and one[1]),
                15.0,
                True,
                "x",
                anchor=f"HF static cache {hf_scale:.1f}x ({batch[32]:.1f} tok/s at 32)"
                if hf_scale
                else "",
                profile=f"profile-rows32-{prec}.txt",
            )  # fmt: skip
        )
        parting = stream_rows_parting(bench)
        out.append(
            Target(
                f"0.5B {prec} stream rows unlike alone",
                17,
                parting and parting[0],
                0,
                False,
                anchor=f"rows saying `same tokens: NO`, of {parting[1]} batched rows"
                if parting
                else "",
            )  # fmt: skip
        )
        if prec == "fp16":
            prompt = graphed[0] if graphed else None
            ttft = f"HF TTFT {hf[2]:.2f} ms" if hf else ""
            out.append(Target("0.5B fp16 prefill 32 tokens, ms", 19, prompt, 3.0, False,
                              anchor=ttft, profile="profile-prefill-32-fp16.txt"))  # fmt: skip
            long_prompt = bench_rows(_read(folder, "prompts-512-fp16.txt")).get("onnx-genrt[cuda]")
            out.append(Target("0.5B fp16 prefill 512 tokens, ms", 19,
                              long_prompt and long_prompt[0], 8.0, False,
                              profile="profile-prefill-512-fp16.txt"))  # fmt: skip
    out += _long_targets(_read(folder, "long.txt"))
    default = bench_rows(_read(folder, "bench-default.txt"))
    greedy, mtp = default.get("onnx-genrt[cuda]"), default.get("onnx-genrt[cuda,mtp]")
    out.append(
        Target(
            "embedded model MTP / graphed greedy",
            19,
            _ratio(mtp and mtp[1], greedy and greedy[1]),
            2.0,
            True,
            "x",
            profile="profile-default.txt",
        )  # fmt: skip
    )
    for target in out:
        if target.profile and (path := folder / target.profile).is_file():
            target.profile_summary = profile_summary(path.read_text(errors="replace"))
    return out


def _long_targets(text: str) -> list[Target]:
    ours, hf = long_rows(text)

    def default(prompt: int) -> tuple[float, float] | None:
        return ours.get((prompt, "default"))

    base = default(256)
    out = []
    for p in (8192, 30000):
        row = default(p)
        share = _ratio(row and row[1], base and base[1])
        out.append(Target(f"decode after {p} tokens / after 256", 19,
                          None if share is None else 100 * share, 70.0, True, "%",
                          profile=f"profile-long-{p}.txt"))  # fmt: skip
    for p, bound in ((8192, 25.0), (30000, 130.0)):
        row = default(p)
        anchor = f"HF TTFT {hf[p]:.2f} ms" if p in hf else ""
        out.append(Target(f"prefill {p} tokens, ms", 19, row and row[0], bound, False,
                          anchor=anchor, profile=f"profile-prefill-{p}.txt"))  # fmt: skip
    return out


def scale_rows(folder: Path) -> list[str]:
    """Issue 19's scale rows (no bound: how cost grows with size), one per
    ``scripts/gpu_scale_bench.sh`` log: graphed greedy tok/s against the weight floor."""
    lines = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if not (name := _SCALE_LOG.match(path.name)):
            continue
        text = path.read_text(errors="replace")
        graphed = bench_rows(text).get("onnx-genrt[cuda]")
        roof = next(filter(None, map(_ROOFLINE.match, text.splitlines())), None)
        label = f"{name['shape']} {name['prec']} graphed greedy"
        if graphed is None or roof is None:
            lines.append(f"{label:<40}{'not measured':>14}")
            continue
        floor = float(roof["floor"])
        lines.append(
            f"{label:<40}{graphed[1]:>10.1f} tok/s  {100 * graphed[1] / floor:.0f}% of the "
            f"floor ({roof['mb']} MB a token, {floor:.0f} tok/s)"
        )
    return lines


def report(folder: Path) -> str:
    rows = targets(folder)
    head = f"{'target':<40}{'figure':>14}  {'bound':<10}{'met':>4}  issue  anchor"
    met = sum(t.met is True for t in rows)
    unmeasured = sum(t.met is None for t in rows)
    lines = [head, *(t.line() for t in rows)]
    lines.append(f"{met} of {len(rows)} targets met; {unmeasured} not measured in {folder}")
    scale = scale_rows(folder)
    if scale:
        lines += ["scale (issue 19: tok/s and share of the bandwidth floor by model size)", *scale]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``onnx-genrt lane-targets LOGDIR``: print the table."""
    if not args.logdir.is_dir():
        raise InvalidInputError(f"{args.logdir} is not a folder (the lane's log folder)")
    print(report(args.logdir))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lane-targets",
        help="the GPU lane's speed targets (issues 17 and 19) beside its measured figures",
        description=__doc__,
    )
    p.add_argument("logdir", type=Path, help="the lane's log folder ($OUT of scripts/gpu_lane.sh)")
    p.set_defaults(func=run)
