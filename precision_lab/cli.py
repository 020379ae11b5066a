"""`precision-lab` command line: each subcommand lives in the module that does the work.

Every module named here provides `configure(parser)` and `main(args) -> int`. Only the module of
the subcommand asked for is imported (none for `precision-lab --help`), so help and argument
errors answer before torch, pandas or matplotlib load (docs/benchmarks.md, "Command-line start"). Bad input
raises LabInputError (or ValueError/FileNotFoundError subclasses the modules define): printed
on one line, exit code 2; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from .errors import LabInputError

SUBCOMMANDS = {
    "run": ("precision_lab.report", "run the notebooks with papermill and render the HTML reports"),
    "rerun": ("precision_lab.rerun", "repeat an earlier run from its provenance (reports/<run-id>)"),
    "diagnose": ("precision_lab.diagnosis", "judge one candidate against the float64 reference; exit 0 only for roundoff"),
    "export": ("precision_lab.export", "write a request bundle plus the float64 reference and its rounding bounds"),
    "campaign": ("precision_lab.campaign.cli", "run a grid of diagnoses on Dask: one Parquet table, a campaign report, resumable"),
    "bench": ("precision_lab.bench", "print benchmark ratios (float64 reference, cost of a diagnosis, algorithms)"),
}

#: what `precision-lab --help` opens with: the question the lab answers
DESCRIPTION = ("Is your gradients' difference from a float64 reference rounding error, a lower-precision mode, "
               "a layout slip or a bug? `precision-lab COMMAND --help` for each command; docs/ for the rest.")


def asked_subcommand(argv: list[str]) -> str | None:
    """The subcommand `argv` names (the first word that is one), or None."""
    return next((word for word in argv if word in SUBCOMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the subcommand it names is configured (and its module imported)."""
    parser = argparse.ArgumentParser(prog="precision-lab", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    asked = None if argv is None else asked_subcommand(argv)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(module=module)
        if argv is None or name == asked:
            importlib.import_module(module).configure(sub_parser)
    return parser


def one_malloc_arena() -> None:
    """glibc's malloc: one arena for every thread (M_ARENA_MAX = 1). A thread that finds the arena busy gets one of
    its own, up to 8 per core, and what is freed there stays resident: the lab's threads held ~0.2 GB so at 1024²,
    the bounds' peak 2.19 GB where one arena gives 1.92–1.99 GB at the same speed (docs/results.md, "The lab's own
    memory under 2 GB"). Without glibc's mallopt nothing changes."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX, before torch starts any thread


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    one_malloc_arena()
    debug = "--debug" in argv
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 2
        return int(importlib.import_module(args.module).main(args) or 0)
    except KeyboardInterrupt:
        print("precision-lab: interrupted", file=sys.stderr)
        return 130
    except (LabInputError, ValueError, FileNotFoundError, PermissionError) as exc:
        if debug:
            raise
        print(f"precision-lab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
