"""The command line answers `--help` and argument errors before importing torch, pandas or matplotlib.

Importing torch alone costs ~1.3–2.7 s of CPU (docs/benchmarks.md, "Command-line start"); a CLI that
pays it to print its usage, or to say that `--size 3x` is not a size, is slow for no reason.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from precision_lab import cli

HEAVY = ("torch", "pandas", "matplotlib")
#: runs the CLI in a fresh interpreter and reports its exit code, the heavy modules it loaded and its stderr
PROBE = """
import contextlib, io, json, sys
from precision_lab.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules], "stderr": err.getvalue()}))
""" % (HEAVY,)


def _run(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, ""),
    (["diagnose", "--help"], 0, ""),
    (["diagnose", "--candidate", "native", "--no-such-option"], 2, "unrecognized arguments: --no-such-option"),
    (["diagnose", "--candidate", "native", "--size", "3x"], 2, "--size: expected N or HxW"),
    (["diagnose", "--candidate", "native", "--batch", "0"], 2, "--batch: must be a positive integer"),
    (["diagnose", "--candidate", "native", "--probes", "nonsense"], 2, "nonsense"),
    (["run", "--help"], 0, ""),
    (["export", "--help"], 0, ""),
    (["export", "--size", "3x", "--out", "unused"], 2, "--size: expected N or HxW"),
])
def test_help_and_argument_errors_do_not_import_torch(argv, code, says):
    answer = _run(*argv)
    assert answer["code"] == code, answer
    assert says in answer["stderr"]
    assert answer["heavy"] == [], f"{' '.join(argv)} imported {answer['heavy']}"


def test_the_probe_sees_torch_when_a_diagnosis_runs():
    # the check above could pass by never looking: a real diagnosis must show torch as loaded
    answer = _run("diagnose", "--candidate", "native", "--size", "8", "--probes", "none")
    assert answer["code"] == 0 and "torch" in answer["heavy"]


def test_only_the_asked_subcommand_is_configured():
    assert cli.asked_subcommand(["--debug", "diagnose", "--candidate", "run"]) == "diagnose"
    assert cli.asked_subcommand(["--help"]) is None
    parser = cli.build_parser(["export", "--help"])
    assert "--candidate" not in parser.format_help()


def test_a_diagnosis_with_a_float64_build_loads_no_pandas_or_matplotlib():
    # the float64 build's evidence (experiment 02's rows) is read without building its table: pandas costs a
    # diagnosis ~0.3 s of CPU at start-up and nothing it reports needs it
    answer = _run("diagnose", "--candidate", "examples/python/candidate.yaml", "--size", "16", "--probes", "none")
    assert answer["code"] == 0, answer
    assert answer["heavy"] == ["torch"], answer["heavy"]
