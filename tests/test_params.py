"""Parameters: YAML files and `-p` overrides checked against the notebooks' parameters cells."""
from pathlib import Path

import pytest

from precision_lab import params
from precision_lab.errors import LabInputError
from precision_lab.paths import NOTEBOOKS_DIR

FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"


@pytest.fixture(scope="module")
def declared():
    return {nb.stem: params.notebook_parameters(nb) for nb in sorted(FIXTURES.glob("*.ipynb"))}


def check(values, declared, where="-p"):
    return params.validate(values, {k: f"{where} {k}" for k in values}, declared)


def test_notebook_parameters_reads_literal_defaults(declared):
    gradients = declared["01-fixture-gradients"]
    assert gradients["size"].default == 32
    assert gradients["candidates"].default == ["native"]
    assert gradients["candidate_label"].default is None
    assert gradients["fail"].default is False
    assert declared["02-fixture-sleep"]["sleep_s"].default == 0.0


def test_overrides_are_yaml_literals():
    parsed = params.parse_overrides([["size", "64"], ["sizes", "[64, 128]"], ["lr", "1e-3"], ["device", "cpu"],
                                     ["image", "null"], ["fail", "true"], ["candidate_label", ""]])
    assert parsed == {"size": 64, "sizes": [64, 128], "lr": 1e-3, "device": "cpu", "image": None, "fail": True,
                      "candidate_label": ""}


def test_scientific_notation_is_a_number_in_files_too(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("lr: 1e-3\nadam_lr: 2.5E+2\nname: 1e-3x\n")
    assert params.load_params_file(path) == {"lr": 1e-3, "adam_lr": 250.0, "name": "1e-3x"}


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("size: 64\nseed: 1\n")
    values, sources = params.merge(params.load_params_file(path), {"size": 32}, path)
    assert values == {"size": 32, "seed": 1}
    assert sources["size"] == "-p size" and sources["seed"] == f"{path}: key 'seed'"


def test_valid_values_pass_and_int_becomes_float_where_the_default_is_float(declared):
    values = check({"size": 16, "candidates": ["native"], "sleep_s": 1, "fail": False}, declared)
    assert values["sleep_s"] == 1.0 and isinstance(values["sleep_s"], float)
    assert values["size"] == 16


def test_none_default_accepts_a_string(declared):
    assert check({"candidate_label": "<b>mine</b>"}, declared)["candidate_label"] == "<b>mine</b>"


@pytest.mark.parametrize("values, words", [
    ({"sizee": 16}, ["-p sizee", "unknown parameter 'sizee'", "size"]),
    ({"size": "big"}, ["-p size", "an integer", "32", "01-fixture-gradients"]),
    ({"size": 16.5}, ["-p size", "an integer"]),
    ({"size": True}, ["-p size", "an integer"]),
    ({"fail": 1}, ["-p fail", "a boolean"]),
    ({"sleep_s": "long"}, ["-p sleep_s", "a number"]),
    ({"candidates": "native"}, ["-p candidates", "a list"]),
    ({"candidates": [1]}, ["-p candidates[0]", "a string"]),
    ({"size": {"a": 1}}, ["-p size", "plain literals"]),
    ({"run_dir": "/tmp/x"}, ["-p run_dir", "set by `precision-lab run`"]),
    ({"size": 4}, ["-p size", "≥ 8"]),
    ({"device": "quantum"}, ["-p device", "unknown device 'quantum'"]),
    ({"candidates": ["no-such-candidate"]}, ["-p candidates[0]", "no-such-candidate"]),
])
def test_bad_values_name_the_key_and_the_expectation(declared, values, words):
    with pytest.raises(LabInputError) as caught:
        check(values, declared)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_type_errors_name_the_params_file(tmp_path, declared):
    path = tmp_path / "mine.yaml"
    path.write_text("size: [1, 2]\n")
    values, sources = params.merge(params.load_params_file(path), {}, path)
    with pytest.raises(LabInputError, match=r"mine\.yaml: key 'size': expected an integer"):
        params.validate(values, sources, declared)


@pytest.mark.parametrize("text, words", [
    ("size: [1, 2\n", ["not valid YAML", "line"]),
    ("- size\n- 64\n", ["expected a YAML mapping", "list"]),
    ("1: 64\n", ["key 1 is not a parameter name"]),
])
def test_bad_params_files(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LabInputError) as caught:
        params.load_params_file(path)
    assert str(caught.value).startswith(str(path))
    for word in words:
        assert word in str(caught.value)


def test_missing_params_file_and_empty_file(tmp_path):
    with pytest.raises(LabInputError, match="no such parameters file"):
        params.load_params_file(tmp_path / "absent.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    assert params.load_params_file(tmp_path / "empty.yaml") == {}


def test_each_notebook_gets_only_what_it_declares_plus_run_dir(declared):
    values = {"size": 16, "sleep_s": 2.0}
    assert params.for_notebook(values, declared["02-fixture-sleep"], "/runs/x") == {"sleep_s": 2.0, "run_dir": "/runs/x"}
    assert params.for_notebook(values, declared["01-fixture-gradients"], "/runs/x") == {"size": 16, "run_dir": "/runs/x"}


def test_a_non_literal_default_is_refused(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cell = new_code_cell("size = 2 ** 10")
    cell.metadata["tags"] = ["parameters"]
    path = tmp_path / "derived.ipynb"
    notebook = new_notebook(cells=[cell])
    notebook.metadata["kernelspec"] = {"name": "precision-lab", "display_name": "precision-lab", "language": "python"}
    nbformat.write(notebook, path)
    with pytest.raises(LabInputError, match="literal values only"):
        params.notebook_parameters(path)


def test_the_optimizer_notebooks_trajectory_size_is_null_or_a_valid_size():
    from precision_lab.paths import NOTEBOOKS_DIR

    notebook = NOTEBOOKS_DIR / "01-optimizer-step.ipynb"
    declared = {notebook.stem: params.notebook_parameters(notebook)}
    assert declared[notebook.stem]["trajectory_size"].default is None  # chosen per device at run time
    assert check({"trajectory_size": None}, declared)["trajectory_size"] is None
    assert check({"trajectory_size": 512}, declared)["trajectory_size"] == 512
    with pytest.raises(LabInputError, match=r"-p trajectory_size: expected an integer"):
        check({"trajectory_size": "big"}, declared)
    with pytest.raises(LabInputError, match=r"-p trajectory_size: image size 4 is too small"):
        check({"trajectory_size": 4}, declared)


# ---------------------------------------------------------------------------------------------
# list parameters through papermill's own `-p` (a string) — precision_lab.params.from_papermill


def test_from_papermill_reads_the_text_papermill_p_passes():
    from precision_lab.params import from_papermill

    assert from_papermill(candidates="[native, fortran-replay-flip]") == ["native", "fortran-replay-flip"]
    assert from_papermill(sizes="[64, 128]", candidates=["native"]) == ([64, 128], ["native"])
    assert from_papermill(candidates="native") == ["native"] and from_papermill(sizes=64) == [64]
    with pytest.raises(LabInputError, match=r"parameter 'candidates': '\[native,' is not a list: write it as"):
        from_papermill(candidates="[native,")


def _list_parameters(notebook) -> list[str]:
    import ast
    import json

    cells = json.loads(notebook.read_text())["cells"]
    source = "".join(next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))["source"])
    return [n.targets[0].id for n in ast.parse(source).body
            if isinstance(n, ast.Assign) and isinstance(n.value, (ast.List, ast.Dict))]


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]-*.ipynb")), ids=lambda p: p.stem)
def test_every_list_parameter_is_read_through_from_papermill_before_use(notebook):
    import json

    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    first = "".join(cells[[i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])][0] + 1]
                    ["source"])
    import re

    call = re.search(r"^(.*)= from_papermill\((.*)\)", first, re.M)
    names = _list_parameters(notebook)
    assert call or not names, f"{notebook.name}: {names} are not read through from_papermill"
    for name in names:
        assert f"{name}={name}" in call.group(2), (notebook.name, name)
        code = "\n".join(line for line in first[:call.start()].splitlines() if not line.startswith(("from ", "import ")))
        assert not re.search(rf"\b{name}\b", code), f"{notebook.name}: {name} used before it is read"


@pytest.mark.slow
def test_a_notebook_takes_a_list_from_papermill_p(tmp_path):
    import papermill

    # exactly what `papermill 02-….ipynb out.ipynb -p size 16 -p candidates "[native, fortran-replay-flip]"` passes
    papermill.execute_notebook(str(NOTEBOOKS_DIR / "02-float64-recompilation.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={"size": 16, "candidates": "[native, fortran-replay-flip]",
                                           "device": "cpu", "run_dir": str(tmp_path)},
                               kernel_name="precision-lab", progress_bar=False, log_output=False)
    summary = (tmp_path / "02-float64-recompilation" / "summary.csv").read_text()
    assert "fortran-replay-flip" in summary and "native" in summary


def test_the_notebooks_take_a_probes_parameter_and_refuse_an_unknown_probe():
    real = {nb.stem: params.notebook_parameters(nb) for nb in sorted(NOTEBOOKS_DIR.glob("0[1-5]-*.ipynb"))}
    assert all(declared["probes"].default == "default" for declared in real.values())
    check({"probes": "none"}, real)
    check({"probes": "odd-61x67,seed1-random-targets"}, real)
    with pytest.raises(LabInputError, match=r"-p probes: unknown probe 'sometimes'") as caught:
        check({"probes": "sometimes"}, real)
    assert "\n" not in str(caught.value)
