"""The ``onnx-genrt`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from .cli_args import POSITIVE, POSITIVE_INT, Once, provider_list
from .generate_cli import add_provider_argument


def _cmd_providers(args: argparse.Namespace) -> int:
    """List providers (built with default options to read their graph slots, when available)
    and then the plugins that were refused. Exits 0 even when some plugins are broken."""
    import traceback

    from onnx_genrt.core.errors import OnnxGenrtError
    from onnx_genrt.core.graph_slots import DeviceGraphSlot
    from onnx_genrt.core.registry import get_registry

    registry = get_registry()
    header = ("provider", "status", "API", "graph slots", "distribution")
    rows: list[tuple[tuple[str, ...], str]] = []
    tracebacks: dict[str, str] = {}
    for info in registry.providers():
        cells = (info.name, "unavailable", info.api_version, "-", info.distribution)
        if not info.available:
            rows.append((cells, info.reason))
            continue
        try:
            provider = registry.create(info.name)
            slots, notes = provider.graph_slots, provider.status_notes()
        except Exception as exc:  # one provider that cannot be built is reported, not fatal
            if info.name not in registry.names():  # refused for good: listed with the broken
                continue
            message = (
                str(exc) if isinstance(exc, OnnxGenrtError) else f"{type(exc).__name__}: {exc}"
            )
            tracebacks[info.name] = "".join(traceback.format_exception(exc))
            rows.append(((info.name, "failed", *cells[2:]), message))
            continue
        names = ", ".join(s.value for s in DeviceGraphSlot if s in slots) or "none"
        details = "; ".join((info.description, *notes))
        rows.append(((info.name, "available", info.api_version, names, info.distribution), details))
    widths = [max(len(r[i]) for r in [header, *(c for c, _ in rows)]) for i in range(len(header))]
    for cells, details in [(header, "details"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + "  " + details)
        if args.verbose and cells[0] in tracebacks:
            print(_indent(tracebacks[cells[0]]))
    if registry.errors:
        print(f"\nbroken plugins ({len(registry.errors)}, not used):")
        for err in registry.errors:
            print(f"  {err.plugin}: {err.error}")
            if args.verbose and err.detail:
                print(_indent(err.detail))
    return 0


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.rstrip().splitlines())


def _cmd_conformance(args: argparse.Namespace) -> int:
    from onnx_genrt import conformance

    return conformance.main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from onnx_genrt import demo

    return demo.main(args)


#: Exit codes, one per kind of failure (documented in ``--help`` and README.md).
EXIT_OK = 0
EXIT_USAGE = 2  # a bad flag or option value (argparse, InvalidInputError)
EXIT_MODEL = 3  # the model folder or file cannot be used (missing, malformed, unsupported)
EXIT_RUNTIME = 4  # running failed (a kernel, non-finite logits, out of memory)
EXIT_INTERNAL = 5  # a bug in onnx-genrt: an exception outside its error hierarchy
EXIT_BROKEN_PIPE = 141  # stdout closed early (piped into head); 128 + SIGPIPE, as a shell reports
EXIT_INTERRUPTED = 130  # Ctrl-C

EPILOG = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_USAGE}    usage: a bad flag or option value (an unknown provider name too)
  {EXIT_MODEL}    model: the model folder or file cannot be used (missing, malformed, unsupported op),
       or an installed provider cannot run here (no GPU, a plugin refused)
  {EXIT_RUNTIME}    runtime: running the model failed (a kernel, non-finite logits, out of memory)
  {EXIT_INTERNAL}    internal error (a bug: please report it with the --debug traceback)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_BROKEN_PIPE}  stdout was closed early (for example piped into head); nothing is printed

Errors are one line on stderr; --debug (before or after COMMAND) adds the traceback."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _debug_flag(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks of errors"
    )


def version_text() -> str:
    """``onnx-genrt X.Y.Z (provider API M.m)``: the package and the plugin API it runs."""
    from onnx_genrt import __version__
    from onnx_genrt.core import PROVIDER_API_VERSION

    major, minor = PROVIDER_API_VERSION
    return f"onnx-genrt {__version__} (provider API {major}.{minor})"


class _VersionAction(argparse.Action):
    """``--version``: the text is made when the flag is given (it imports the core, which
    every other command would otherwise pay for while the parser is built)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="onnx-genrt",
        description="Run ONNX generative models through pluggable execution providers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _debug_flag(parser, False)
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the onnx-genrt version and the provider API version, then exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from onnx_genrt import generate_cli

    generate_cli.add_parser(sub)

    p = sub.add_parser(
        "providers",
        help="list execution providers, their availability and why not, and broken plugins",
        description="List every provider with its distribution, provider API version, graph "
        "slots (read from an instance built with default options; unavailable providers are "
        "not built) and availability, then the plugins that were refused and why.",
    )
    p.add_argument("--verbose", action="store_true", help="show the traceback of each failure")
    p.set_defaults(func=_cmd_providers)

    p = sub.add_parser(
        "demo", help="run the bundled demo model in slots PRIMARY and VERIFY, checked against eager"
    )
    add_provider_argument(p)
    p.add_argument("--steps", type=POSITIVE_INT, default=24, help="steps per slot (default: 24)")
    p.set_defaults(func=_cmd_demo)

    from onnx_genrt.tools import llm_bench

    llm_bench.add_parser(sub)

    p = sub.add_parser("conformance", help="run ONNX's own backend node tests against a provider")
    p.add_argument(
        "--provider",
        type=provider_list,
        action=Once,
        default=["cpu"],
        help="the provider under test, then fallbacks, comma-separated (default: cpu); "
        "no CPU fallback beyond the list",
    )
    p.add_argument("--op", action="append", default=[], help="only these op types (repeatable)")
    p.add_argument("-k", dest="pattern", default=None, help="only test names containing this text")
    p.add_argument("--failures", action="store_true", help="list every failure with its reason")
    p.add_argument(
        "--timeout", type=POSITIVE, default=None, help="per-case limit in s (default: 60)"
    )
    p.set_defaults(func=_cmd_conformance)

    from onnx_genrt import inspect_cli
    from onnx_genrt.testing import runner

    inspect_cli.add_parser(sub)
    runner.add_parser(sub)

    from onnx_genrt import chat_cli
    from onnx_genrt.serve import cli as serve_cli

    chat_cli.add_parser(sub)
    serve_cli.add_parser(sub)

    from onnx_genrt.tools import lane_targets, step_cost, step_profile

    step_profile.add_parser(sub)
    step_cost.add_parser(sub)
    lane_targets.add_parser(sub)
    for command in sub.choices.values():
        # Accepted after the command too; SUPPRESS keeps a --debug given before it.
        _debug_flag(command, argparse.SUPPRESS)
        command.epilog = EPILOG
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user errors are one line on stderr and an exit code (see EPILOG)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from onnx_genrt import compile_notice

    try:
        with compile_notice.install():
            return int(args.func(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a code
        code = exit_code(exc)
        if args.debug:
            traceback.print_exc()
        what = "internal error" if code == EXIT_INTERNAL else "error"
        hint = "; rerun with --debug for the traceback" if code == EXIT_INTERNAL else ""
        message = " ".join(str(exc).split()) or type(exc).__name__
        if code == EXIT_INTERNAL or isinstance(exc, MemoryError | OSError):
            message = f"{type(exc).__name__}: {message}"
        print(f"onnx-genrt {args.command}: {what}: {message}{hint}", file=sys.stderr)
        return code


def exit_code(exc: BaseException) -> int:
    """The exit code for an exception that ended a command."""
    from onnx_genrt.core.errors import (
        InvalidInputError,
        ModelLoadError,
        OnnxGenrtError,
        ProviderUnavailableError,
        UnsupportedOpError,
    )

    if isinstance(exc, InvalidInputError):
        return EXIT_USAGE
    if isinstance(exc, ModelLoadError | UnsupportedOpError | ProviderUnavailableError):
        return EXIT_MODEL
    if isinstance(exc, OSError):  # a file named on the command line cannot be read
        return EXIT_MODEL
    if isinstance(exc, OnnxGenrtError | MemoryError):
        return EXIT_RUNTIME
    return EXIT_INTERNAL


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so flushing at exit raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
