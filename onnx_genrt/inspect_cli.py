"""``onnx-genrt inspect``: where each node of a model runs (provider, kernel, fusion)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from .generate_cli import add_provider_argument, default_model_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show where each node of a model runs: provider, kernel, fusion",
        description="Plan a model on a provider list and print one line per step (node, op, "
        "provider, kernel, whether it fuses several of the model's nodes), then the counts "
        "per provider and the segments a bound run is cut into.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an .onnx file or a model folder (default: the embedded model's decoder)",
    )
    add_provider_argument(p)
    p.add_argument("--no-fallback", action="store_true", help="refuse instead of using the CPU")
    p.set_defaults(func=run)


def model_file(path: Path | None) -> Path:
    """The ONNX file a path names: a file, a folder's genai_config.json decoder, or
    ``model.onnx`` in a folder."""
    from onnx_genrt.engine.config import CONFIG_FILE, load_config

    folder = path if path is not None else default_model_dir()
    if folder.is_dir() and (folder / CONFIG_FILE).is_file():
        return load_config(folder).model_path
    return folder


def run(args: argparse.Namespace) -> int:
    from onnx_genrt.session import InferenceSession

    sess = InferenceSession(
        model_file(args.model), providers=args.provider, cpu_fallback=not args.no_fallback
    )
    rows = [("node", "op", "provider", "kernel", "fused")]
    rows += [
        (p.node, p.op, p.provider, p.kernel, "yes" if p.fused else "") for p in sess.placement()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    counts = Counter(p.provider for p in sess.placement())
    fused = sum(p.fused for p in sess.placement())
    print()
    print(
        "steps: "
        + ", ".join(f"{name} {n}" for name, n in counts.most_common())
        + f"; fused steps {fused}; folded constants {sess.plan.folded}"
    )
    segments = sess.executor.segments
    print(
        f"segments: {len(segments)} ("
        + " | ".join(f"{s.provider.name}:{s.stop - s.start}" for s in segments[:12])
        + (" | ..." if len(segments) > 12 else "")
        + ")"
    )
    return 0
