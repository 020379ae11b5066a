"""data/: the shipped sample micrographs (reproducible, used by params/sample-mrc.yaml) and the seed's figures."""
import importlib.util
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from precision_lab import params as run_params
from precision_lab.candidates import get_builtin
from precision_lab.experiments import motivating
from precision_lab.paths import DATA_DIR, NOTEBOOKS_DIR, PARAMS_DIR, ROOT
from precision_lab.problem import load_micrograph, make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

SCRIPT = DATA_DIR / "make_sample_micrographs.py"
SAMPLES = DATA_DIR / "micrographs"


def _script():
    spec = importlib.util.spec_from_file_location("make_sample_micrographs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samples_are_small_and_regenerate_byte_for_byte():
    files = sorted(SAMPLES.glob("*.mrc"))
    assert [p.name for p in files] == sorted(_script().SAMPLES)
    assert sum(p.stat().st_size for p in files) <= 10 * 1024 * 1024
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "byte-identical" in done.stderr


def test_the_readme_states_each_files_digest():
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    script = _script()
    for path in SAMPLES.glob("*.mrc"):
        assert script.sha256(path) in readme, path.name
        side, seed, _ = script.SAMPLES[path.name]
        assert f"synthetic_micrograph({side}, {seed})" in readme


def test_samples_are_the_generator_counts_as_int16():
    import mrcfile

    script = _script()
    for name, (side, seed, rows) in script.SAMPLES.items():
        with mrcfile.open(SAMPLES / name) as mrc:
            data = np.asarray(mrc.data)
            assert mrc.header.mode == 1 and data.dtype == np.int16
        assert np.array_equal(data, script.sample_counts(side, seed, rows))
    assert load_micrograph(SAMPLES / "synthetic-512x768-seed102.mrc").shape == (512, 768)


def test_sample_params_file_validates_and_points_at_a_shipped_file(monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in params files are relative to where the lab runs
    values = run_params.load_params_file(PARAMS_DIR / "sample-mrc.yaml")
    declared = {nb.stem: run_params.notebook_parameters(nb) for nb in sorted(NOTEBOOKS_DIR.glob("*.ipynb"))}
    merged, sources = run_params.merge(values, {}, str(PARAMS_DIR / "sample-mrc.yaml"))
    checked = run_params.validate(merged, sources, declared)
    assert (ROOT / checked["image"]).is_file() and checked["image"].startswith("data/micrographs/")
    assert load_micrograph(ROOT / checked["image"]).shape == (checked["size"], checked["size"])


def test_a_sample_file_is_judged_like_the_synthetic_problem():
    """The lab on a shipped file: native is rounding, the flip slip is a layout, at 64² crops."""
    problem = make_problem(64, 2, 0, image=SAMPLES / "synthetic-256-seed103.mrc")
    assert problem.source.endswith("synthetic-256-seed103.mrc")
    assert not np.array_equal(problem.input[0], problem.input[1])  # elements are shifted crops
    trace = reference(problem)
    cpu = torch.device("cpu")
    verdicts = {name: judge(get_builtin(name).compute(problem, "float32", cpu), trace, "float32", name)
                for name in ("native", "fortran-replay-flip")}
    assert verdicts["native"].verdict == "roundoff"
    assert verdicts["fortran-replay-flip"].verdict == "layout" and verdicts["fortran-replay-flip"].layout_fix == "flip HW"


def test_seed_reported_figures_are_the_design_table():
    table = motivating.seed_reported().set_index("quantity")
    assert table.loc["conv1.weight", "seed_max_abs"] == 0.049 and table.loc["conv2.weight", "seed_max_abs"] == 0.290
    assert table.loc["conv3.weight", "seed_mean_abs"] == 0.067 and table.loc["conv2.bias", "seed_max_abs"] == 8.2e-5
    assert np.isnan(table.loc["loss", "seed_mean_abs"])
    assert motivating.seed_estimate() == 3.6e-4
    raw = pd.read_csv(DATA_DIR / "seed-reported.csv").set_index("quantity")
    first, second = (float(v) for v in raw.loc["loss", "reported_values"].split(" vs "))
    # the reported loss difference is the two reported losses' difference, to the digit the seed gave
    assert abs(abs(second - first) - raw.loc["loss", "max_abs_diff"]) < 0.05e-6


def test_notebook_04_reads_the_csv_not_constants(tmp_path):
    edited = tmp_path / "seed.csv"
    frame = pd.read_csv(DATA_DIR / "seed-reported.csv")
    frame.loc[frame.quantity == "conv2.weight", "max_abs_diff"] = 0.5
    frame.to_csv(edited, index=False)
    assert motivating.seed_reported(edited).set_index("quantity").loc["conv2.weight", "seed_max_abs"] == 0.5
    with pytest.raises(Exception, match="cannot read the seed's reported figures"):
        motivating.seed_reported(tmp_path / "missing.csv")
    source = (NOTEBOOKS_DIR / "04-motivating-case.ipynb").read_text(encoding="utf-8")
    assert "seed-reported.csv" in source and "SEED_TABLE" not in source


def test_gitignore_keeps_data_tracked_and_runs_ignored():
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    assert ignored("data/runs/some-run/summary.csv")
    for path in ("data/README.md", "data/seed-reported.csv", "data/micrographs/synthetic-256-seed103.mrc",
                 "params/sample-mrc.yaml"):
        assert not ignored(path), path
    assert yaml.safe_load((PARAMS_DIR / "sample-mrc.yaml").read_text())["image"].endswith(".mrc")
