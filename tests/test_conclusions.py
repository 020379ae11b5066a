"""Conclusions in words (precision_lab.conclusions): drawn from the numbers, naming the fix, never fixed text."""
import re

import pandas as pd
import pytest
import torch

from precision_lab import conclusions
from precision_lab.candidates import get_builtin, resolve
from precision_lab.problem import make_problem
from precision_lab.experiments import (algorithms, decide_all, decided_judgements, float64_recompilation, motivating,
                                       optimizer_step, size_sweep)
from precision_lab.tables import format_number
from precision_lab.verdict import Judgement, QuantityVerdict, judge

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def judged(small_problem, small_reference):
    """Judgements of a legitimate, a layout, a reduced-precision and a defect candidate at 64²."""
    trace = small_reference
    out = {}
    for name in ("native", "fortran-replay-flip", "tf32-emulated", "relu-mask-missing", "weight-grad-swapped-in-out"):
        candidate = resolve(name)
        out[name] = judge(candidate.compute(small_problem, "float32", CPU), trace, candidate.claimed_precision, name)
    return out


def test_roundoff_says_nothing_to_fix_and_quotes_its_worst_ratio(judged):
    j = judged["native"]
    assert j.verdict == "roundoff"
    c = conclusions.from_judgement(j)
    assert c.findings[0].action == "The difference is rounding: nothing to fix."
    worst = max(j.quantities.values(), key=lambda q: q.bound_ratio)
    assert f"error ÷ bound {format_number(worst.bound_ratio)}" in c.findings[0].finding
    assert worst.quantity in c.findings[0].finding
    assert c.findings[0].measurements[0].against == "rounding at float32: ≤ 1"


def test_a_flip_names_the_flip_and_the_quantities_beyond_the_bound(judged):
    j = judged["fortran-replay-flip"]
    assert j.verdict == "layout" and j.layout_fix == "flip HW"
    finding = conclusions.from_judgement(j).findings[0]
    assert finding.detail == "flip HW" and finding.verdict_text == "layout (flip HW)"
    assert "flip H and W where the gradient is converted" in finding.action
    assert "flipped in H and W" in finding.finding
    layout_quantities = [q.quantity for q in j.quantities.values() if q.verdict == "layout"]
    assert all(name in finding.finding for name in layout_quantities)
    worst = max(j.quantities.values(), key=lambda q: q.bound_ratio)
    beyond = next(m for m in finding.measurements if m.label.startswith("elements of"))
    assert beyond.value == f"{worst.exceeding} of {worst.size}"


def test_a_swapped_layout_says_which_layout_to_convert_from(judged):
    j = judged["weight-grad-swapped-in-out"]
    assert j.verdict == "layout" and j.layout_fix.startswith("layout IOHW")
    action = conclusions.action_for(j)
    assert "transpose it from IOHW to the layout it is declared in before writing" in action
    assert "weight_layout" not in action  # re-declaring also changes how the weights arrive: not equivalent


def test_tf32_says_turn_it_off_or_compare_against_a_tf32_bound(judged):
    j = judged["tf32-emulated"]
    assert j.verdict == "reduced-precision" and j.format == "tf32"
    finding = conclusions.from_judgement(j).findings[0]
    assert finding.action.startswith("TF32 is on: set torch.backends.cudnn.allow_tf32 = False")
    assert "compare against a TF32 bound" in finding.action
    assert any(m.label.startswith("max error ÷ tf32 bound") and float(m.value) <= 1 for m in finding.measurements)


def test_a_defect_names_each_quantity_and_how_far_beyond_the_bound(judged):
    j = judged["relu-mask-missing"]
    assert j.verdict == "defect"
    action = conclusions.action_for(j)
    assert action.startswith("Find the bug")
    for q in j.quantities.values():
        if q.verdict == "defect":
            assert f"{q.quantity} (error ÷ bound {format_number(q.bound_ratio)}, {q.exceeding} of {q.size}" in action
    first = re.search(r"Start with (\S+),", action).group(1)
    defects = [q.quantity for q in j.quantities.values() if q.verdict == "defect"]
    assert first in defects and "nothing to fix" not in action


def test_per_quantity_layout_fixes_give_one_instruction_each():
    action = conclusions.layout_action([("conv1.weight", "flip H"), ("conv2.weight", "layout OIWH")],
                                       {"flip H": (("flip", "H"),), "layout OIWH": (("layout", "OIWH"),)})
    assert action.startswith("Conv1.weight: the gradient matches once flipped in H")
    assert "conv2.weight: the gradient matches once read as OIWH" in action
    assert "transpose it from OIWH" in action


# ---------------------------------------------------------------------------------------------
# each experiment's conclusion, from the experiment's own tables at a tiny size


def test_optimizer_step_conclusion_quotes_the_masking_and_the_envelope(small_problem):
    chosen = [get_builtin("native"), get_builtin("fortran-replay-flip")]
    step_table, judgements = optimizer_step.single_step(small_problem, chosen, CPU)
    masking = optimizer_step.lr_masking_summary(step_table)
    traj = optimizer_step.trajectories(make_problem(32, 2, 0), chosen, [get_builtin("native"), get_builtin("micro-batched"),
                                                      get_builtin("conv-direct")], CPU, steps=2)
    envelope = optimizer_step.envelope_verdicts(traj)
    decisions = decide_all(small_problem, chosen, CPU, judgements, probes="none")
    summary = optimizer_step.summarise(decisions, masking, envelope)
    c = optimizer_step.conclude(summary, masking, envelope, decided_judgements(decisions), lr=0.01, adam_lr=0.001, steps=2,
                                   skipped=["native-tf32: needs cuda, this run is on cpu"])
    hide = masking.set_index("candidate").weights_hide_by
    assert f"hides a gradient error by {format_number(hide.min())}–{format_number(hide.max())}×" in c.lead
    flip = next(f for f in c.findings if f.candidate == "fortran-replay-flip")
    assert "leave the envelope" in flip.finding and flip.verdict == "layout"
    native = next(f for f in c.findings if f.candidate == "native")
    assert "stay inside the envelope" in native.finding
    assert c.notes[0] == "Not run here: native-tf32: needs cuda, this run is on cpu."
    assert c.notes[1].startswith("Unprobed: native, fortran-replay-flip")  # decided with probes="none" here
    frame = c.to_frame()
    assert list(frame.columns[:3]) == ["candidate", "experiment", "verdict"]
    assert (frame.set_index("candidate").verdict == summary.set_index("candidate").verdict).all()


def test_recompilation_conclusion_separates_what_vanishes_from_what_stays(small_problem):
    chosen = [get_builtin("native"), get_builtin("fortran-replay-flip")]
    table, decisions, _ = float64_recompilation.recompilation_table(small_problem, chosen, CPU, probes="none")
    summary = float64_recompilation.summarise(table, decisions)
    c = float64_recompilation.conclude(summary, table, decided_judgements(decisions))
    assert "the error vanishes with the arithmetic for native" in c.lead
    assert "it stays for fortran-replay-flip, which is therefore not rounding" in c.lead
    flip = next(f for f in c.findings if f.candidate == "fortran-replay-flip")
    worst = table[(table.candidate == "fortran-replay-flip") & (table.quantity != "loss")].ratio.max()
    assert flip.measurements[0].value == format_number(worst)
    assert "vanishes: ≤ 4.32×10⁻⁵" in flip.measurements[0].against


def test_size_sweep_conclusion_names_the_transform_from_the_sweep_table():
    chosen = [get_builtin("native"), get_builtin("fortran-replay-flip")]
    table, decisions = size_sweep.sweep([16, 32], chosen, CPU, probes="none")
    fits = size_sweep.signature(size_sweep.fit_exponents(table))
    summary = size_sweep.summarise(table, fits, decisions)
    c = size_sweep.conclude(summary, table, fits, decisions=decisions)
    flip = next(f for f in c.findings if f.candidate == "fortran-replay-flip")
    assert flip.detail == "flip HW" and "flip H and W" in flip.action
    native = next(f for f in c.findings if f.candidate == "native")
    assert native.action == conclusions.NOTHING_TO_FIX and "within the float32 bound at every size from 16 to 32" in native.finding


def test_motivating_conclusion_answers_the_seeds_question_with_the_seeds_own_figures():
    problem = make_problem(32, 2, 0)
    table, decisions = motivating.replay(problem, CPU, probes="none")
    summary = motivating.summarise(table, decisions)
    c = motivating.conclude(summary, table, decided_judgements(decisions))
    assert c.lead.startswith("The seed's weight-gradient differences (0.049–0.29) were not floating-point accumulation")
    assert "(flip HW)" in c.lead
    headline = summary.set_index("candidate").headline
    assert "(seed: 0.049–0.29)" in headline["fortran-replay-flip"]  # the seed's figures as it wrote them
    assert "0-0" not in headline["fortran-replay"] and "–0 " not in headline["fortran-replay"]


def test_algorithm_conclusion_changes_with_the_numbers():
    """The same code says something else when an algorithm exceeds the bound: the text is not fixed."""
    rows = []
    for algorithm, ratio in (("native", 0.006), ("winograd-f2x3", 0.002), ("winograd-f4x3", 0.014)):
        for size in (32, 64):
            rows.append({"algorithm": algorithm, "size": size, "batch": 2, "quantity": "conv2.weight", "n_terms": 2 * size * size,
                         "bound_ratio": ratio, "max_abs_err": 1e-7, "verdict": "roundoff", "overall": "roundoff",
                         "seconds": 0.1})
    table = pd.DataFrame(rows)
    fine = _decided("native", "roundoff", **{"winograd-f2x3": "roundoff", "winograd-f4x3": "roundoff"})
    c = algorithms.conclude(algorithms.summary(table, fine), table, fine)
    assert c.lead.startswith("3 of 3 algorithms are legitimate float32 implementations")
    assert "Winograd F(4,3) uses more of it than F(2,3) (1.40% against 0.200%), as the larger tile's" in c.lead
    broken = table.copy()
    broken.loc[broken.algorithm == "winograd-f4x3", ["bound_ratio", "verdict", "overall"]] = [3.5, "defect", "defect"]
    flagged = _decided("native", "roundoff", **{"winograd-f2x3": "roundoff", "winograd-f4x3": "defect"})
    c2 = algorithms.conclude(algorithms.summary(broken, flagged), broken, flagged)
    assert c2.lead.startswith("2 of 3 algorithms") and "(not: winograd-f4x3)" in c2.lead
    f4 = next(f for f in c2.findings if f.candidate == "winograd-f4x3")
    assert f4.verdict == "defect" and "error ÷ bound 3.50" in f4.finding


def test_the_index_summary_groups_candidates_and_keeps_disagreements():
    frame = pd.DataFrame([
        {"candidate": "native", "experiment": "01-optimizer-step", "verdict": "roundoff", "detail": "", "action": "x"},
        {"candidate": "native", "experiment": "03-size-sweep", "verdict": "roundoff", "detail": "", "action": "x"},
        {"candidate": "mine", "experiment": "01-optimizer-step", "verdict": "layout", "detail": "flip HW",
         "action": "Flip it."},
        {"candidate": "mine", "experiment": "03-size-sweep", "verdict": "defect", "detail": "", "action": "Find the bug."},
    ])
    summary = conclusions.run_summary(frame, None)
    assert summary["lead"] == "2 implementations judged in 2 experiments: 1 within rounding in every experiment, 1 not (mine)."
    mine = next(line for line in summary["lines"] if line["candidates"] == "mine")
    assert mine["verdict"] == "defect" and mine["action"] == "Find the bug."
    assert mine["text"] == "defect — layout (flip HW) in 01; defect in 03"


def test_conclusion_html_is_escaped_and_carries_its_anchor():
    j = Judgement("<b>x</b>", "float32", "roundoff",
                  {"loss": QuantityVerdict("loss", "roundoff", 1e-8, 1e-8, 1e-8, 0.01, 1.0, 1.0, 1.0, size=1)})
    html = conclusions.from_judgement(j).html()
    assert 'id="conclusion"' in html and "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html


def _sweep_rows(candidate, ratios, overall, fmt=None, err_over_grad=1e-3):
    """A hand-made 03 sweep table: `ratios` maps size → error ÷ bound of each weight gradient."""
    rows = []
    for size, ratio in ratios.items():
        for parameter in ("conv1.weight", "conv2.weight", "conv1.bias"):
            rows.append({"size": size, "n": 2 * size * size, "candidate": candidate, "parameter": parameter,
                         "max_abs_err": 1e-6, "err_over_uS": 10.0 * (size / 64) ** -0.1, "err_over_grad": err_over_grad,
                         "bound_ratio": ratio, "verdict": "roundoff" if ratio <= 1 else "reduced-precision",
                         "overall_verdict": overall})
    return rows


def _decided(candidate, verdict, fmt=None, **more):
    """A decision with one quantity (the output) of that verdict: what a hand-made table's verdict came from."""
    from precision_lab.decision import Diagnosis

    q = QuantityVerdict("output", verdict, 1e-6, 1e-7, 1e-3, 0.5 if verdict == "roundoff" else 3.0, 4.0, 0.99, 1.0,
                        format=fmt, size=100, exceeding=0 if verdict == "roundoff" else 7)
    decided = {candidate: Diagnosis(Judgement(candidate, "float32", verdict, {"output": q}, format=fmt))}
    for name, other in more.items():
        decided.update(_decided(name, other))
    return decided


def test_size_sweep_conclusion_when_only_the_loss_or_output_is_beyond_at_the_largest_size():
    """tf32 at the seed scale: gradients beyond the bound at small sizes only, the output beyond at 1024."""
    table = pd.DataFrame(_sweep_rows("tf32-emulated", {64: 3.2, 256: 1.4, 1024: 0.748}, "reduced-precision", "tf32"))
    fits = size_sweep.signature(size_sweep.fit_exponents(table))
    decisions = _decided("tf32-emulated", "reduced-precision", "tf32")
    c = size_sweep.conclude(size_sweep.summarise(table, fits, decisions), table, fits, decisions=decisions)
    finding = c.findings[0]
    assert finding.verdict_text == "reduced-precision (tf32)"
    assert finding.action == conclusions.precision_action("tf32")
    assert "worst: conv1.weight at 64 pixels, error ÷ bound 3.20; at 1024 pixels 0.748" in finding.finding
    assert "At 1024 pixels its gradients are within the bound, but the decision" in finding.finding
    assert "Find the bug" not in finding.action


def test_size_sweep_defect_without_a_name_says_where_to_look_not_an_empty_list():
    table = pd.DataFrame(_sweep_rows("mine", {64: 0.5, 1024: 0.6}, "defect"))
    fits = size_sweep.signature(size_sweep.fit_exponents(table))
    decisions = _decided("mine", "defect")
    finding = size_sweep.conclude(size_sweep.summarise(table, fits, decisions), table, fits,
                                     decisions=decisions).findings[0]
    assert finding.verdict == "defect" and "Find the bug" in finding.action
    assert ": are" not in finding.action


def test_algorithm_flagged_only_outside_its_gradients_says_so():
    rows = [{"algorithm": "odd", "size": size, "batch": 2, "quantity": "conv2.weight", "n_terms": 2 * size * size,
             "bound_ratio": 0.3, "max_abs_err": 1e-7, "verdict": "roundoff",
             "overall": "reduced-precision" if size == 64 else "roundoff", "seconds": 0.1} for size in (32, 64)]
    table = pd.DataFrame(rows)
    decisions = _decided("odd", "reduced-precision", "tf32")
    finding = algorithms.conclude(algorithms.summary(table, decisions), table, decisions).findings[0]
    assert finding.verdict == "reduced-precision"
    assert "within the float32 bound at every size" in finding.finding
    assert "finds it reduced-precision on the requested problem" in finding.finding
    assert "Beyond the float32 bound in 0" not in finding.finding


def test_an_unprobed_run_says_so_in_its_conclusion(small_problem):
    chosen = [get_builtin("native")]
    _, judgements = optimizer_step.single_step(small_problem, chosen, CPU)
    for probes, said in (("none", True), ("default", False)):
        decisions = decide_all(small_problem, chosen, CPU, judgements, probes=probes)
        table, decided, _ = float64_recompilation.recompilation_table(small_problem, chosen, CPU, probes=probes)
        c = float64_recompilation.conclude(float64_recompilation.summarise(table, decided), table,
                                              decided_judgements(decided))
        assert any(note.startswith("Unprobed: native") for note in c.notes) == said
        summary = float64_recompilation.summarise(table, decided).set_index("candidate")
        assert summary.loc["native", "probes"] == ("unprobed" if said else "3 probes")
        assert decisions["native"].probed is not said
