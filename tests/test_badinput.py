"""Catalogue of bad inputs across the lab: each must exit 2 with one line naming the file or key and
what was expected, with no traceback, and before anything runs (no run folder appears).

Parameter files, `-p` values, images, bundles and candidate YAML reach the lab through
`precision-lab run` (a bundle or YAML is a candidate: `-p candidates [PATH]`) and through
`precision-lab diagnose --bundle/--candidate`.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from precision_lab import cli
from precision_lab.paths import ROOT

FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder of bad inputs, plus one good static bundle to break in different ways."""
    from precision_lab.bundle import write_static
    from precision_lab.problem import make_problem
    from precision_lab.compute import forward_backward

    folder = tmp_path_factory.mktemp("bad")
    problem = make_problem(size=16, batch=1, seed=0)
    good = write_static(problem, forward_backward(problem), folder / "good-bundle")
    _write_bad_files(folder)
    _write_bad_bundles(folder, Path(good))
    _write_bad_candidates(folder)
    return folder


def _write_bad_files(folder: Path) -> None:
    (folder / "broken.yaml").write_text("size: [64, 128\n")
    (folder / "list.yaml").write_text("- size\n- 64\n")
    (folder / "unknown-key.yaml").write_text("size: 16\nsizze: 32\n")
    (folder / "wrong-type.yaml").write_text("size: sixty-four\n")
    (folder / "run-dir.yaml").write_text("run_dir: /tmp/elsewhere\n")
    (folder / "nested.yaml").write_text("size: {width: 64}\n")
    (folder / "binary.yaml").write_bytes(b"\xff\xfe\x00size")
    np.save(folder / "line.npy", np.arange(10.0))
    np.save(folder / "nan.npy", np.full((32, 32), np.nan))
    np.save(folder / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(folder / "tiny.npy", np.zeros((4, 4)))
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (folder / "garbage.mrc").write_bytes(b"not an mrc file at all" * 4)


def _copy_bundle(good: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(good, target)
    return target


def _rewrite_npz(path: Path, change) -> None:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    change(arrays)
    np.savez(path, **arrays)


def _write_bad_bundles(folder: Path, good: Path) -> None:
    bad_json = _copy_bundle(good, folder / "bundle-bad-json")
    (bad_json / "bundle.json").write_text("{not json")
    wrong_format = _copy_bundle(good, folder / "bundle-wrong-format")
    manifest = json.loads((wrong_format / "bundle.json").read_text())
    (wrong_format / "bundle.json").write_text(json.dumps({**manifest, "format": "someone-else/9"}))
    missing = _copy_bundle(good, folder / "bundle-missing-grad")
    _rewrite_npz(missing / "arrays.npz", lambda a: a.pop("conv2.weight.grad"))
    shape = _copy_bundle(good, folder / "bundle-wrong-shape")
    _rewrite_npz(shape / "arrays.npz", lambda a: a.update({"conv1.weight": np.zeros((16, 1, 5, 5), np.float32)}))
    nan = _copy_bundle(good, folder / "bundle-nan")
    _rewrite_npz(nan / "arrays.npz", lambda a: a["conv3.bias.grad"].fill(np.nan))
    layout = _copy_bundle(good, folder / "bundle-bad-layout")
    manifest = json.loads((layout / "bundle.json").read_text())
    (layout / "bundle.json").write_text(json.dumps({**manifest, "weight_layout": "OIHX"}))
    huge = _copy_bundle(good, folder / "bundle-huge-raw")
    manifest = json.loads((huge / "bundle.json").read_text())
    (huge / "input.bin").write_bytes(b"\0" * 64)
    manifest["arrays"] = {"input": {"file": "input.bin", "dtype": "float32", "shape": [1, 1, 1_000_000, 1_000_000]}}
    (huge / "arrays.npz").unlink()
    (huge / "bundle.json").write_text(json.dumps(manifest))
    pickled = _copy_bundle(good, folder / "bundle-pickled")
    with zipfile.ZipFile(pickled / "arrays.npz", "a") as npz:  # an object array needs pickle to load
        npz.writestr("evil.npy", _npy_object_bytes())


def _npy_object_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([{"code": "os.system"}], dtype=object), allow_pickle=True)
    return buffer.getvalue()


def _write_bad_candidates(folder: Path) -> None:
    (folder / "no-command.yaml").write_text("name: mine\nprecision: float32\n")
    (folder / "float8.yaml").write_text("name: mine\ncommand: [python3, '{request}', '{response}']\nprecision: float8\n")
    (folder / "bad-layout.yaml").write_text("name: mine\ncommand: [python3, '{request}', '{response}']\n"
                                            "weight_layout: OIHX\n")
    (folder / "negative-timeout.yaml").write_text("name: mine\ncommand: [python3, '{request}', '{response}']\n"
                                                  "timeout_s: -1\n")
    (folder / "command-string.yaml").write_text("name: mine\ncommand: ./impl {request} {response}\n")


#: (case, argv after `run` or a full argv, words the one-line message must contain)
RUN_CASES = [
    ("params file missing", ["--params", "{d}/absent.yaml"], ["absent.yaml", "no such parameters file"]),
    ("params file not YAML", ["--params", "{d}/broken.yaml"], ["broken.yaml", "not valid YAML", "line"]),
    ("params file a list", ["--params", "{d}/list.yaml"], ["list.yaml", "expected a YAML mapping"]),
    ("params file unknown key", ["--params", "{d}/unknown-key.yaml"], ["unknown-key.yaml", "'sizze'", "unknown"]),
    ("params file wrong type", ["--params", "{d}/wrong-type.yaml"], ["wrong-type.yaml", "key 'size'", "an integer"]),
    ("params file sets run_dir", ["--params", "{d}/run-dir.yaml"], ["run-dir.yaml", "run_dir"]),
    ("params file nested value", ["--params", "{d}/nested.yaml"], ["nested.yaml", "key 'size'", "plain literals"]),
    ("params file not text", ["--params", "{d}/binary.yaml"], ["binary.yaml"]),
    ("-p unknown name", ["-p", "sise", "64"], ["-p sise", "unknown parameter"]),
    ("-p float for int", ["-p", "size", "64.5"], ["-p size", "an integer"]),
    ("-p size too small", ["-p", "size", "4"], ["-p size", "≥ 8"]),
    ("-p unknown device", ["-p", "device", "tpu"], ["-p device", "unknown device 'tpu'"]),
    ("-p list expected", ["-p", "candidates", "native"], ["-p candidates", "a list"]),
    ("-p unknown candidate", ["-p", "candidates", "[nativ]"], ["-p candidates[0]", "nativ"]),
    ("-p unclosed list", ["-p", "candidates", "[native"], ["-p candidates", "YAML literal"]),
    ("--notebooks none match", ["--notebooks", "09"], ["--notebooks", "'09'"]),
    ("--run-id path", ["--run-id", "../escape"], ["--run-id", "'../escape'"]),
    ("--run-id latest", ["--run-id", "latest"], ["--run-id", "'latest'"]),
    ("image missing", ["-p", "image", "{d}/absent.npy"], ["-p image", "absent.npy", "no such image file"]),
    ("image wrong type", ["-p", "image", "{d}/image.png"], ["-p image", "image.png", ".npy or .mrc"]),
    ("image 1-D", ["-p", "image", "{d}/line.npy"], ["-p image", "line.npy", "2-D"]),
    ("image NaN", ["-p", "image", "{d}/nan.npy"], ["-p image", "nan.npy", "NaN"]),
    ("image pickled objects", ["-p", "image", "{d}/objects.npy"], ["-p image", "objects.npy"]),
    ("image unreadable mrc", ["-p", "image", "{d}/garbage.mrc"], ["-p image", "garbage.mrc", "cannot read"]),
    ("bundle not JSON", ["-p", "candidates", "[{d}/bundle-bad-json]"], ["bundle-bad-json", "bundle.json"]),
    ("bundle wrong format", ["-p", "candidates", "[{d}/bundle-wrong-format]"], ["bundle-wrong-format", "format"]),
    ("bundle missing grad", ["-p", "candidates", "[{d}/bundle-missing-grad]"], ["bundle-missing-grad", "conv2.weight.grad"]),
    ("bundle wrong shape", ["-p", "candidates", "[{d}/bundle-wrong-shape]"], ["bundle-wrong-shape", "conv1.weight", "(16, 1, 3, 3)"]),
    ("bundle NaN", ["-p", "candidates", "[{d}/bundle-nan]"], ["bundle-nan", "conv3.bias.grad"]),
    ("bundle bad layout", ["-p", "candidates", "[{d}/bundle-bad-layout]"], ["bundle-bad-layout", "weight_layout"]),
    ("bundle claims 10^12 elements", ["-p", "candidates", "[{d}/bundle-huge-raw]"], ["bundle-huge-raw", "input"]),
    ("bundle pickled array", ["-p", "candidates", "[{d}/bundle-pickled]"], ["bundle-pickled", "evil"]),
    ("candidate without command", ["-p", "candidates", "[{d}/no-command.yaml]"], ["no-command.yaml", "command"]),
    ("candidate float8", ["-p", "candidates", "[{d}/float8.yaml]"], ["float8.yaml", "precision", "float8"]),
    ("candidate bad layout", ["-p", "candidates", "[{d}/bad-layout.yaml]"], ["bad-layout.yaml", "weight_layout"]),
    ("candidate negative timeout", ["-p", "candidates", "[{d}/negative-timeout.yaml]"], ["negative-timeout.yaml", "timeout_s"]),
    ("candidate command as string", ["-p", "candidates", "[{d}/command-string.yaml]"], ["command-string.yaml", "command"]),
    ("candidate file missing", ["-p", "candidates", "[{d}/absent.yaml]"], ["absent.yaml", "no such candidate file"]),
]


def one_line_error(capsys, argv) -> str:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("precision-lab: error: ") and "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("case, args, words", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_refuses_bad_input_in_one_line_before_running(capsys, tmp_path, inputs, case, args, words):
    argv = ["run", "--notebooks-dir", FIXTURES, "--reports-dir", tmp_path / "reports", "--runs-dir", tmp_path / "runs",
            *[a.replace("{d}", str(inputs)) for a in args]]
    message = one_line_error(capsys, argv)
    for word in words:
        assert word.replace("{d}", str(inputs)) in message, (case, message)
    assert not (tmp_path / "reports").exists() and not (tmp_path / "runs").exists()


def test_existing_run_id_is_refused(capsys, tmp_path):
    (tmp_path / "reports" / "taken").mkdir(parents=True)
    message = one_line_error(capsys, ["run", "--notebooks-dir", FIXTURES, "--reports-dir", tmp_path / "reports",
                                      "--runs-dir", tmp_path / "runs", "--run-id", "taken"])
    assert "'taken'" in message and "never overwrites" in message


def test_rerun_of_a_folder_that_is_not_a_run(capsys, tmp_path):
    message = one_line_error(capsys, ["rerun", tmp_path])
    assert str(tmp_path) in message and "provenance.json" in message


def test_rerun_of_a_corrupt_provenance(capsys, tmp_path):
    (tmp_path / "provenance.json").write_text('{"parameters": [1]}')
    message = one_line_error(capsys, ["rerun", tmp_path])
    assert "provenance.json" in message and "'parameters'" in message


DIAGNOSE_CASES = [
    ("bundle folder missing", ["--bundle", "{d}/no-such-bundle"], ["no-such-bundle"]),
    ("bundle not JSON", ["--bundle", "{d}/bundle-bad-json"], ["bundle-bad-json", "bundle.json"]),
    ("bundle missing grad", ["--bundle", "{d}/bundle-missing-grad"], ["bundle-missing-grad", "conv2.weight.grad"]),
    ("bundle claims 10^12 elements", ["--bundle", "{d}/bundle-huge-raw"], ["bundle-huge-raw", "input"]),
    ("bundle pickled array", ["--bundle", "{d}/bundle-pickled"], ["bundle-pickled", "evil"]),
    ("candidate without command", ["--candidate", "{d}/no-command.yaml"], ["no-command.yaml", "command"]),
    ("candidate float8", ["--candidate", "{d}/float8.yaml"], ["float8.yaml", "float8"]),
    ("candidate negative timeout", ["--candidate", "{d}/negative-timeout.yaml"], ["negative-timeout.yaml", "timeout_s"]),
]


@pytest.mark.parametrize("case, args, words", DIAGNOSE_CASES, ids=[c[0] for c in DIAGNOSE_CASES])
def test_diagnose_refuses_bad_input_in_one_line(capsys, inputs, case, args, words):
    message = one_line_error(capsys, ["diagnose", *[a.replace("{d}", str(inputs)) for a in args], "--size", "16"])
    for word in words:
        assert word.replace("{d}", str(inputs)) in message, (case, message)


def test_the_installed_command_prints_one_line_and_exits_2(tmp_path):
    """The same through the real entry point (a separate process): no traceback reaches the user."""
    done = subprocess.run([sys.executable, "-m", "precision_lab.cli", "run", "--notebooks-dir", str(FIXTURES),
                           "--reports-dir", str(tmp_path), "-p", "size", "huge"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("precision-lab: error: -p size: expected an integer like the default 32 "
                                   "of 01-fixture-gradients, got a string 'huge'")


OPTION_CASES = [
    ("negative seed", ["diagnose", "--candidate", "builtin:native", "--seed", "-3"],
     ["--seed", "non-negative integer", "-3"]),
    ("size without width", ["diagnose", "--candidate", "builtin:native", "--size", "61x"], ["--size", "HxW", "61x"]),
    ("size with three sides", ["export", "--size", "8x8x8", "--out", "{d}/never"], ["--size", "8x8x8"]),
    ("size the linear layer cannot take", ["diagnose", "--candidate", "builtin:native", "--size", "65x64", "--model",
                                           str(ROOT / "examples" / "models" / "lenet-classifier.json")], ["fc1", "300"]),
    ("size a stride cannot divide, export", ["export", "--size", "31", "--out", "{d}/never", "--model",
                                             str(ROOT / "examples" / "models" / "small-unet.json")], ["--size", "31"]),
]


@pytest.mark.parametrize("case, args, words", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_every_numeric_option_names_itself(capsys, tmp_path, case, args, words):
    message = one_line_error(capsys, [a.replace("{d}", str(tmp_path)) for a in args])
    for word in words:
        assert word in message, (case, message)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("command", [["diagnose", "--candidate", "builtin:native"], ["export", "--out", "{d}/never"],
                                     ["bench"]])
def test_a_problem_too_large_for_memory_is_refused_before_it_is_allocated(capsys, tmp_path, command):
    """100000² batch 2 needs tens of TiB: one line with the need, the free amount and a size that fits."""
    # without the guard numpy raises MemoryError allocating 74 GiB: a traceback, not one line
    message = one_line_error(capsys, [a.replace("{d}", str(tmp_path)) for a in command] + ["--size", "100000"])
    assert "100000×100000" in message and "is free" in message and "fits" in message, message
    fits = re.search(r"(\d+)×(\d+) fits", message)
    assert fits and 64 <= int(fits.group(1)) < 100000
    assert not (tmp_path / "never").exists()
