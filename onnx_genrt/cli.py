"""The ``onnx-genrt`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_providers(args: argparse.Namespace) -> int:
    from onnx_genrt.core.registry import get_registry

    registry = get_registry()
    rows = [("provider", "status", "graph slots", "plugin / reason")]
    for info in registry.providers():
        if info.available:
            try:
                slots = ", ".join(sorted(s.value for s in registry.create(info.name).graph_slots))
            except Exception as exc:  # a provider that cannot be built is reported, not fatal
                rows.append((info.name, "broken", "-", f"{type(exc).__name__}: {exc}"))
                continue
            rows.append((info.name, "available", slots or "none", info.plugin))
        else:
            rows.append((info.name, "unavailable", "-", info.reason))
    for err in registry.errors:
        rows.append(("?", "plugin failed", "-", f"{err.plugin}: {err.error}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from onnx_genrt import conformance

    return conformance.main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from onnx_genrt import demo

    return demo.main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    if not args.dispatch:
        from onnx_genrt import llm_bench

        return llm_bench.run_bench(args)
    from onnx_genrt import dispatch_bench

    results = []
    for provider in args.provider:
        print(f"measuring {provider}: {args.nodes} nodes x 50 runs x 5 ...", file=sys.stderr)
        results.append(dispatch_bench.measure(provider, args.nodes, 50))
    print(dispatch_bench.format_table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-genrt",
        description="Run ONNX generative models through pluggable execution providers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from onnx_genrt import generate_cli

    generate_cli.add_parser(sub)

    p = sub.add_parser("providers", help="list execution providers, their availability and why not")
    p.set_defaults(func=_cmd_providers)

    p = sub.add_parser(
        "demo", help="run the bundled demo model in slots PRIMARY and VERIFY, checked against eager"
    )
    p.add_argument("--provider", default="cpu", help="provider name (default: cpu)")
    p.add_argument("--steps", type=int, default=24, help="steps per slot (default: 24)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "bench",
        help="decode speed side by side with onnxruntime-genai and an onnxruntime loop (--dispatch: per-node cost)",
    )
    from onnx_genrt import llm_bench

    llm_bench.add_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("conformance", help="run ONNX's own backend node tests against a provider")
    p.add_argument("--provider", default="cpu", help="provider name (default: cpu)")
    p.add_argument("--op", action="append", default=[], help="only these op types (repeatable)")
    p.add_argument("-k", dest="pattern", default=None, help="only test names containing this text")
    p.add_argument("--failures", action="store_true", help="list every failure with its reason")
    p.add_argument("--timeout", type=float, default=None, help="per-case limit in s (default: 60)")
    p.set_defaults(func=_cmd_conformance)

    from onnx_genrt.testing import runner

    runner.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None) == "bench" and not args.provider:
        args.provider = ["cpu"]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from onnx_genrt.core.errors import OnnxGenrtError

    try:
        return int(args.func(args) or 0)
    except OnnxGenrtError as exc:
        print(f"onnx-genrt {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
