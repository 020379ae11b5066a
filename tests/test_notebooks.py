"""Every notebook executed with params/quick.yaml (`precision-lab run`, as `make quick`), asserting what it found."""
import math
import struct

import pandas as pd
import papermill
import pytest
import yaml

from precision_lab.paths import NOTEBOOKS_DIR, PARAMS_DIR
from precision_lab.plots import DPI
from precision_lab.results import figure_caption

NOTEBOOKS = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9][0-9]-*.ipynb"))


@pytest.fixture(scope="module")
def executed(quick_run):
    """Each notebook run once with the quick parameters it declares (conftest.quick_run, shared with the report and
    reproducibility tests); map name → (tables folder, executed notebook)."""
    tmp, done = quick_run
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: (tmp / "runs" / "quick" / name, tmp / "reports" / "quick" / f"{name}.ipynb") for name in NOTEBOOKS}


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_writes_a_summary_and_a_headline_figure(executed, name):
    folder, _ = executed[name]
    summary = pd.read_csv(folder / "summary.csv")
    assert list(summary.columns[:4]) == ["candidate", "experiment", "verdict", "headline"]
    assert len(summary) >= 1 and summary.verdict.isin(["roundoff", "reduced-precision", "layout", "defect", "inconclusive"]).all()
    # one row per candidate, each of this notebook's experiment, each with its headline in words
    assert summary.candidate.is_unique and (summary.experiment == name).all(), summary[["candidate", "experiment"]]
    assert (summary.headline.fillna("").str.strip().str.len() > 0).all(), summary.headline
    png = (folder / "headline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5_000
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk: pixels
    # a plot with axes, labels and a legend, not an empty canvas: at least 6 × 3 inches at the lab's DPI
    assert width >= 6 * DPI and height >= 3 * DPI, (width, height)
    assert figure_caption(folder / "headline.png"), "the headline figure has no caption"


def _verdicts(executed, name):
    return pd.read_csv(executed[name][0] / "summary.csv").set_index("candidate").verdict


@pytest.mark.slow
@pytest.mark.parametrize("name", ["01-optimizer-step", "02-float64-recompilation", "03-size-sweep"])
def test_native_is_roundoff_and_the_replay_slip_is_flagged(executed, name):
    verdicts = _verdicts(executed, name)
    assert verdicts["native"] == "roundoff"
    assert verdicts["fortran-replay"] == "roundoff"
    assert verdicts["fortran-replay-flip"] != "roundoff"
    assert verdicts["tf32-emulated"] != "roundoff"  # claimed float32, computed with TF32 inputs


@pytest.mark.slow
def test_float64_recompilation_ratios(executed):
    ratios = pd.read_csv(executed["02-float64-recompilation"][0] / "ratios.csv")
    params = ratios[ratios.quantity != "loss"].set_index(["candidate", "quantity"]).ratio
    assert params["native"].max() <= 1e-6  # rounding error vanishes with the arithmetic
    flip_weights = params["fortran-replay-flip"].filter(like="weight")
    assert ((flip_weights > 0.5) & (flip_weights < 2)).all()  # the slip stays near 1


@pytest.mark.slow
def test_optimizer_step_masking_numbers(executed):
    masking = pd.read_csv(executed["01-optimizer-step"][0] / "masking.csv").set_index("candidate")
    assert masking.loc["native", "weights_hide_by"] > 10
    assert masking.loc["fortran-replay-flip", "grad_rel_err"] > 0.1
    envelope = pd.read_csv(executed["01-optimizer-step"][0] / "envelope.csv").set_index("candidate")
    assert not envelope.loc["fortran-replay-flip", "inside_envelope"]


@pytest.mark.slow
def test_size_sweep_fits(executed):
    fits = pd.read_csv(executed["03-size-sweep"][0] / "fits.csv")
    native = fits[(fits.candidate == "native") & fits.parameter.str.endswith("weight")]
    assert native.alpha_vs_S.between(-0.5, 1.0).all() and not native.alpha_vs_S.apply(math.isnan).any()


@pytest.mark.slow
def test_noise_floor_members_stay_below_the_bound(executed):
    """Five or more legitimate float32 orders: none may exceed the model's bound (no false alarm)."""
    floor = pd.read_csv(executed["03-size-sweep"][0] / "noise_floor.csv")
    members = floor[floor.member != "ensemble-spread"]
    assert members.member.nunique() >= 5
    assert (members.bound_ratio <= 1.0).all()
    assert (floor[floor.member == "ensemble-spread"].bound_ratio > 0).all()  # they do differ from each other


@pytest.mark.slow
def test_gradient_check_settles_the_kan_candidates(executed):
    """06: the right KAN is roundoff, the planted bugs are defects naming their tensors (float32-only too), within
    budget."""
    summary = pd.read_csv(executed["06-gradient-check"][0] / "summary.csv").set_index("candidate")
    verdicts = summary.verdict.to_dict()
    assert {k: verdicts[k] for k in ("kan", "kan-bug", "kan-bug-float32", "relu-bug", "relu-conv-bug")} == {
        "kan": "roundoff", "kan-bug": "defect", "kan-bug-float32": "defect", "relu-bug": "defect",
        "relu-conv-bug": "defect"}
    # float32 only, behind ReLUs included: settled along the scaling segment
    assert verdicts["kan-no-float64"] == "roundoff" and verdicts["relu"] == "roundoff"
    assert "fc.weight" in summary.headline["relu-bug"] and summary.headline["relu-conv-bug"].startswith("defect in conv.weight (")
    assert "layer2.spline_weight" in summary.headline["kan-bug"]
    assert "spline_weight" in summary.headline["kan-bug-float32"]
    assert (summary.program_calls <= 60).all()
    rates = pd.read_csv(executed["06-gradient-check"][0] / "pass_rates.csv")
    right = rates[rates.candidate == "kan"].set_index("epsilon")
    assert right.pass_rate[1e-5] < 0.5 < right.pass_rate.max()  # the pass rate measures ε, not the gradient
    assert (right.predicted_pass_rate - right.pass_rate).abs().max() < 0.1  # and the measured noise predicts it


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_ends_in_its_conclusion_drawn_from_its_summary(executed, name):
    """The last cell shows the conclusion; its verdicts are the summary's, each with something to do."""
    import nbformat

    folder, notebook_file = executed[name]
    conclusions = pd.read_csv(folder / "conclusions.csv", keep_default_na=False)
    summary = pd.read_csv(folder / "summary.csv")
    assert dict(zip(conclusions.candidate, conclusions.verdict)) == dict(zip(summary.candidate, summary.verdict))
    assert (conclusions.action.str.len() > 0).all() and (conclusions.evidence.str.len() > 0).all()
    notebook = nbformat.read(notebook_file, as_version=4)
    last = notebook.cells[-1]
    shown = "".join(o.get("data", {}).get("text/html", "") for o in last.get("outputs", []))
    assert 'id="conclusion"' in shown and "What to do:" in shown
    printed = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", [])
                      if o.get("output_type") == "stream" and o.get("name") == "stdout")
    assert "{'" not in printed  # no dict printed into the page


@pytest.mark.slow
def test_a_spec_network_runs_through_the_optimizer_step_and_the_size_sweep(tmp_path):
    """params/unet.yaml's network (not the seed's) at quick sizes: its right candidate is roundoff, its
    planted slips are not, in the notebooks' own summaries."""
    unet = yaml.safe_load((PARAMS_DIR / "unet.yaml").read_text())
    for name in ("01-optimizer-step", "03-size-sweep"):
        source = NOTEBOOKS_DIR / f"{name}.ipynb"
        declared = papermill.inspect_notebook(str(source))
        parameters = {k: v for k, v in {**unet, "size": 48, "sizes": [32, 48], "steps": 2,
                                        "trajectory_size": 32}.items() if k in declared}
        parameters["run_dir"] = str(tmp_path)
        papermill.execute_notebook(str(source), str(tmp_path / f"{name}.ipynb"), parameters=parameters,
                                   kernel_name="precision-lab", progress_bar=False, log_output=False)
        verdicts = pd.read_csv(tmp_path / name / "summary.csv").set_index("candidate").verdict
        assert verdicts["native"] == "roundoff", name
        for slip in ("weight-grad-flip-hw", "relu-mask-missing", "upsample-backward-first-only"):
            assert verdicts[slip] != "roundoff", (name, slip)
        context = (tmp_path / f"{name}.ipynb").read_text()
        assert "small-unet" in context  # the run context names the network it judged
