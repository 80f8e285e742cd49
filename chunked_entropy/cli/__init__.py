"""The ``chunked-entropy`` command (also ``python -m chunked_entropy``).

Subcommands:

* ``demo``: reproduces the in-place failure this library fixes, the clone
  workaround and its memory, and this library's answer, with its gradients
  checked against float64 and the peak memory of each approach.
* ``bench``: peak memory and time of each approach over a sweep of shapes,
  each case in a fresh process; CSV, JSON and a plot.
* ``plan``: the memory each approach needs for a model and batch, and the
  ``chunk_size`` to use.

The command imports the library as a user would (its public API only).
Mistakes on the command line give a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

PROG = "chunked-entropy"


class UsageError(Exception):
    """A user mistake found after parsing: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_list(text: str) -> list:
    """``"256,512,1024"`` -> ``[256, 512, 1024]`` (positive integers)."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def name_list(text: str) -> list:
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return parts


def _plain(doc: str) -> str:
    """A module docstring as --help text: without reST roles and double backticks."""
    import re

    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    from . import bench, demo, plan

    formatter = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog=PROG,
        description="Memory-efficient chunked log-probs and entropy: see the failure it fixes, "
                    "measure it, and plan chunk_size for your model.",
        epilog="Run '%(prog)s COMMAND --help' for each command's options. "
               "Start with '%(prog)s demo'.",
        formatter_class=formatter,
    )
    from chunked_entropy import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    d = sub.add_parser(
        "demo", help="reproduce the in-place failure, the clone workaround, and this library's fix",
        description=_plain(demo.__doc__), formatter_class=formatter,
    )
    demo.add_arguments(d, positive_int)

    b = sub.add_parser(
        "bench", help="measure peak memory and time of each approach over a sweep (CSV, JSON, plot)",
        description=_plain(bench.__doc__), formatter_class=formatter,
    )
    bench.add_arguments(b, positive_int, int_list, name_list)

    pl = sub.add_parser(
        "plan", help="memory each approach needs for your shapes, and the chunk_size to use",
        description=_plain(plan.__doc__), formatter_class=formatter,
    )
    plan.add_arguments(pl, positive_int, int_list)
    p.subcommands = {"demo": d, "bench": b, "plan": pl}
    return p


def main(argv=None) -> int:
    """Entry point of the ``chunked-entropy`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_case":  # internal: one benchmark case, run by bench and demo
        from ._process import run_case_main

        return run_case_main(argv[1:])
    if argv and argv[0] == "_serve":  # internal: forks a fresh process per benchmark case
        from ._process import serve_main

        return serve_main()
    parser = build_parser()
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(f"unrecognized arguments: {argv[0]} (a command comes first: demo, bench or plan)")
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, which names itself in the message
        parser.subcommands[args.command].error("unrecognized arguments: " + " ".join(extra))
    args.argv = argv
    from . import bench, demo, plan

    runner = {"demo": demo.run, "bench": bench.run, "plan": plan.run}[args.command]
    try:
        return runner(args)
    except (UsageError, bench.BenchError, demo.DemoError) as e:
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG} {args.command}: interrupted\n")
        return 130
