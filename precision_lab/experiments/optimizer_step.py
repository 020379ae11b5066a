"""Experiment 01: single optimizer step comparison (docs/design.md, "The experiments").

The seed proposed "compare weights after one optimizer step". This experiment shows why that
test proves little and what to compare instead:

* **lr masking** — after SGD, w' = w − lr·g, so a gradient error δg moves w' by lr·δg while
  |w'| ≈ |w|: the relative weight difference is the gradient's relative error times
  lr·|g|/|w| (the masking factor), and wherever lr·|δg| is below half a float32 ulp of w' the
  error is rounded away entirely;
* **Adam's first step is sign-only** — with m̂₁ = g and v̂₁ = g² (Kingma & Ba 2015, Alg. 1),
  the update is −lr·g/(|g| + ε) ≈ −lr·sign(g): any gradient with the right signs matches;
* so compare **updates** (Δw), whose relative error equals the gradient's, and run k steps to see
  whether the candidate's trajectory stays inside the envelope spanned by legitimate float32
  implementations around the float64 trajectory.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .. import formats
from ..candidates import Candidate
from ..conclusions import (Conclusion, Finding, Measurement, action_for, judgement_detail, judgement_measurements,
                           judgement_phrase, skipped_notes, unprobed_notes, verdict_groups)
from ..problem import Problem
from ..reference import reference
from ..tables import format_factor, format_number, format_percent, format_range
from ..verdict import judge
from . import cached_reference, progress, summary_row

EXPERIMENT = "01-optimizer-step"

#: an order-of-magnitude margin on the envelope: its edge is the maximum of a few legitimate
#: members, and the sample maximum of a handful of draws underestimates the spread's tail
ENVELOPE_MARGIN = 10.0

#: largest k-step trajectory size on a CPU when none is asked for: 20 steps × 7 members + float64
#: at 1024² take 5–6 minutes on 2 cores (15–17 s a step), which alone would break `make reports`'
#: few-minute budget (README: 5–12 minutes for the six notebooks); a GPU runs them at the problem's own size
CPU_TRAJECTORY_SIZE = 256


def trajectory_size_for(requested: int | None, size: int, device: torch.device) -> int:
    """The size the k-step trajectories run at: `requested` if given, else `size` on a GPU and at
    most CPU_TRAJECTORY_SIZE on a CPU."""
    if requested is not None:
        return requested
    return size if device.type == "cuda" else min(size, CPU_TRAJECTORY_SIZE)


def _sup_rel(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖∞ / ‖b‖∞ in float64 (0 when both vanish)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / scale if scale > 0 else float(np.max(np.abs(a - b)))


def _optimizer_step(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], dtype: torch.dtype,
                    optimizer: str, lr: float) -> dict[str, np.ndarray]:
    """One step of torch.optim.SGD or Adam (default betas, ε) on copies of `params`, in `dtype`."""
    # on the host: parameters are a few thousand numbers, and the step must be the same on every device
    tensors = {name: torch.tensor(np.asarray(value), dtype=dtype, device="cpu") for name, value in params.items()}
    for name, tensor in tensors.items():
        tensor.grad = torch.tensor(np.asarray(grads[name]), dtype=dtype, device="cpu")
    opt_class = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
    with torch.device("cpu"):  # the optimizer's own state (Adam's step count) beside the parameters, whatever the default
        opt_class(list(tensors.values()), lr=lr).step()
    return {name: tensor.detach().numpy() for name, tensor in tensors.items()}


def single_step(problem: Problem, candidates: list[Candidate], device: torch.device,
                lr: float = 0.01, adam_lr: float = 1e-3) -> tuple[pd.DataFrame, dict]:
    """Per candidate × parameter: gradient, weight and update errors after one SGD and one Adam step.

    Returns the table and each candidate's judgement of its gradients (precision_lab.verdict).
    """
    ref = cached_reference(problem, device)
    w0 = problem.params
    ref_sgd = _optimizer_step(w0, ref.grads, torch.float64, "sgd", lr)
    ref_adam = _optimizer_step(w0, ref.grads, torch.float64, "adam", adam_lr)
    rows, judgements = [], {}
    for candidate in progress(candidates, desc="01 one step", unit="candidate"):
        result = candidate.compute(problem, "float32", device)
        judgements[candidate.name] = judge(result, ref, candidate.claimed_precision, candidate.name)
        cand_sgd = _optimizer_step(w0, result.grads, torch.float32, "sgd", lr)
        cand_adam = _optimizer_step(w0, result.grads, torch.float32, "adam", adam_lr)
        for name in problem.network.parameter_names:
            g, g_ref = np.asarray(result.grads[name], np.float64), ref.grads[name]
            w_new, w_new_ref = cand_sgd[name].astype(np.float64), ref_sgd[name]
            # the update as the optimizer forms it (lr·g in the candidate's float32), before it is added
            update = (np.float32(lr) * np.asarray(result.grads[name], np.float32)).astype(np.float64)
            update_ref = lr * g_ref
            # gradient error as it would move the weights, against half a float32 ulp of w'
            half_ulp = np.spacing(np.abs(w_new_ref).astype(np.float32)).astype(np.float64) / 2
            visible = lr * np.abs(g - g_ref) > half_ulp
            adam_update = cand_adam[name].astype(np.float64) - w0[name]
            adam_update_ref = ref_adam[name] - w0[name]
            rows.append({
                "candidate": candidate.name, "parameter": name,
                "grad_rel_err": _sup_rel(g, g_ref),
                "sgd_update_rel_err": _sup_rel(update, update_ref),
                "sgd_weight_rel_err": _sup_rel(w_new, w_new_ref),
                # w' − w read back from stored float32 weights: storage rounding swamps small errors
                "sgd_stored_update_rel_err": _sup_rel(w_new - w0[name], w_new_ref - w0[name]),
                "masking_factor": float(lr * np.max(np.abs(g_ref)) / np.max(np.abs(w_new_ref))),
                "error_visible_in_weights": float(np.mean(visible)),
                "adam_update_rel_err": _sup_rel(adam_update, adam_update_ref),
                # elements whose float64 Adam step is lr·sign(g) to 0.1% (fails only where |g| ≲ 10⁴·ε)
                "adam_sign_only_fraction": float(np.mean(np.abs(np.abs(adam_update_ref) / adam_lr - 1.0) <= 1e-3)),
                # elements whose Adam step matches the reference's to 0.1% of lr, whatever the gradient error
                "adam_identical_fraction": float(np.mean(np.abs(adam_update - adam_update_ref) <= 1e-3 * adam_lr)),
                "sign_agreement": float(np.mean(np.sign(g) == np.sign(g_ref))),
            })
    return pd.DataFrame(rows), judgements


def _trajectory(step_fn, problem: Problem, steps: int, lr: float, dtype: torch.dtype, label: str):
    """Run `steps` SGD steps from the problem's weights; yields (step, loss, weights) before each step."""
    params = {name: np.asarray(v, np.float64 if dtype == torch.float64 else np.float32)
              for name, v in problem.params.items()}
    records = []
    for step in progress(range(steps + 1), desc=f"01 trajectory {label}", unit="step", leave=False):
        result = step_fn(params)
        records.append((step, result.loss, {k: np.asarray(v, np.float64) for k, v in params.items()}))
        if step < steps:
            params = _optimizer_step(params, result.grads, dtype, "sgd", lr)
    return records


#: legitimate programs of each reduced format, at least two arithmetics apiece (stored results or not, every pass or
#: the weight gradient's only, loss-scaled or not): a candidate claimed in the format is judged against them, since a
#: right bfloat16 program leaves the float32 envelope as surely as a slip does
FORMAT_ENVELOPES = {
    "tf32": ("tf32-emulated", "tf32-weight-grad-only", "native-tf32"),
    "bfloat16": ("autocast-bfloat16", "bf16-emulated"),
    "float16": ("autocast-float16", "float16-emulated"),
}


def _float16_emulated() -> Candidate:
    from ..candidates.builtin import emulated

    return Candidate(name="float16-emulated", run=emulated("float16"), claimed_precision="float16",
                     description="float32 arithmetic with every operand rounded to float16 (no loss scale): an "
                                 "envelope member of float16 claims")


def format_envelopes(candidates: list[Candidate], device: torch.device, network=None) -> dict[str, list[Candidate]]:
    """{format: its envelope's members that run here} for every reduced format a candidate claims."""
    from ..candidates import registry

    known = registry() | {"float16-emulated": _float16_emulated()}
    envelopes = {}
    for fmt in dict.fromkeys(c.claimed_precision for c in candidates):
        if fmt in formats.REDUCED_FORMATS:
            members = [known[name] for name in FORMAT_ENVELOPES[fmt] if name in known]
            envelopes[fmt] = [m for m in members if m.supports(device) and (network is None or m.applies_to(network))]
    return envelopes


def trajectories(problem: Problem, candidates: list[Candidate], envelope: list[Candidate],
                 device: torch.device, steps: int = 20, lr: float = 0.01) -> pd.DataFrame:
    """k SGD steps for every candidate and envelope member, against the float64 trajectory.

    `envelope` spans float32's; a candidate claimed in a reduced format brings its format's (FORMAT_ENVELOPES).
    Rows: member × step with loss, loss difference to float64 and the relative weight distance
    ‖w − w_ref‖₂ / ‖w_ref‖₂ over all parameters; `role` says candidate, envelope or both, `envelope` the format
    whose envelope the member spans (empty for a candidate alone), `claim` the member's claimed format.
    """
    def ref_step(params):
        # the float64 trajectory: float64 weights, no rounding to float32 between steps
        return reference(Problem(problem.input, problem.target, params, problem.seed, problem.source, problem.network,
                                 problem.targets, problem.masks), device)

    ref_records = _trajectory(ref_step, problem, steps, lr, torch.float64, "float64")
    spans = {c.name: "float32" for c in envelope}
    extra = {}
    for fmt, members in format_envelopes(candidates, device, problem.network).items():
        for member in members:
            spans.setdefault(member.name, fmt)
            extra.setdefault(member.name, member)
    members = {c.name: c for c in envelope} | extra | {c.name: c for c in candidates}
    candidate_names = {c.name for c in candidates}
    rows = []
    for name, member in progress(members.items(), desc="01 trajectories", unit="member"):
        def cand_step(params, member=member):
            return member.compute(problem.with_params(params), "float32", device)

        records = _trajectory(cand_step, problem, steps, lr, torch.float32, name)
        for (step, loss, weights), (_, ref_loss, ref_weights) in zip(records, ref_records):
            diff = np.sqrt(sum(np.sum((weights[k] - ref_weights[k]) ** 2) for k in ref_weights))
            norm = np.sqrt(sum(np.sum(ref_weights[k] ** 2) for k in ref_weights))
            role = "both" if name in spans and name in candidate_names else (
                "envelope" if name in spans else "candidate")
            rows.append({"member": name, "role": role, "envelope": spans.get(name, ""),
                         "claim": member.claimed_precision, "step": step, "loss": loss, "loss_ref": ref_loss,
                         "loss_diff": loss - ref_loss, "weight_distance": float(diff / norm)})
    return pd.DataFrame(rows)


def envelope_verdicts(traj: pd.DataFrame) -> pd.DataFrame:
    """Is each candidate's trajectory inside the envelope of its claimed format (× ENVELOPE_MARGIN) at every step?
    A format with no member that runs here has no envelope: inside_envelope is then empty (not judged)."""
    spans, claims = traj.envelope, traj.claim
    members = traj[traj.role.isin(["envelope", "both"])]
    rows = []
    for name, group in traj[traj.role.isin(["candidate", "both"])].groupby("member", sort=False):
        claim = claims[group.index[0]]
        own = members[spans[members.index] == claim]
        if own.empty:
            rows.append({"candidate": name, "envelope": claim, "final_weight_distance":
                         float(group.weight_distance.iloc[-1]), "final_envelope_distance": float("nan"),
                         "max_distance_over_envelope": float("nan"), "inside_envelope": None})
            continue
        env = own.groupby("step").agg(envelope_distance=("weight_distance", "max"))
        merged = group.set_index("step").join(env)
        moved = merged.index > 0  # step 0 has identical weights for everyone
        excess = (merged.weight_distance[moved] / merged.envelope_distance[moved].clip(lower=1e-300)).max()
        rows.append({"candidate": name, "envelope": claim, "final_weight_distance": float(merged.weight_distance.iloc[-1]),
                     "final_envelope_distance": float(merged.envelope_distance.iloc[-1]),
                     "max_distance_over_envelope": float(excess),
                     "inside_envelope": bool(excess <= ENVELOPE_MARGIN)})
    return pd.DataFrame(rows)


def lr_masking_summary(step_table: pd.DataFrame) -> pd.DataFrame:
    """One line per candidate: worst gradient error and what the weight and Adam comparisons show of it."""
    grouped = step_table.groupby("candidate", sort=False)
    return pd.DataFrame({
        "grad_rel_err": grouped.grad_rel_err.max(),
        "sgd_update_rel_err": grouped.sgd_update_rel_err.max(),
        "sgd_weight_rel_err": grouped.sgd_weight_rel_err.max(),
        "sgd_stored_update_rel_err": grouped.sgd_stored_update_rel_err.max(),
        "weights_hide_by": grouped.apply(lambda g: float(np.max(g.grad_rel_err) / max(np.max(g.sgd_weight_rel_err), 1e-300)),
                                         include_groups=False),
        "error_visible_in_weights": grouped.error_visible_in_weights.mean(),
        "adam_update_rel_err": grouped.adam_update_rel_err.max(),
        "adam_identical_fraction": grouped.adam_identical_fraction.min(),
        "adam_sign_only_fraction": grouped.adam_sign_only_fraction.min(),
        "sign_agreement": grouped.sign_agreement.min(),
    }).reset_index()


def findings(masking: pd.DataFrame, lr: float, adam_lr: float) -> list[str]:
    """Plain-text sentences putting numbers on the masking, one per candidate."""
    lines = []
    for row in masking.itertuples():
        lines.append(
            f"{row.candidate}: gradient error {format_number(row.grad_rel_err)} (relative); after one SGD step "
            f"(lr = {lr:g}) the weights differ by {format_number(row.sgd_weight_rel_err)}, "
            f"{format_factor(row.weights_hide_by)} less, and the error changes the stored float32 weights in "
            f"{format_percent(row.error_visible_in_weights)} of elements (elsewhere it is under half an ulp of the "
            f"weight and rounds away); the update lr·g differs by {format_number(row.sgd_update_rel_err)}, the "
            f"gradient's own error. Adam's first step (lr = {adam_lr:g}) equals float64's in "
            f"{format_percent(row.adam_identical_fraction)} of elements, because it is lr·sign(g): the signs agree in "
            f"{format_percent(row.sign_agreement)}.")
    return lines


def summarise(decisions: dict, masking: pd.DataFrame, envelope: pd.DataFrame | None) -> pd.DataFrame:
    """One row per candidate for the index: the decided verdict (precision_lab.decision), the update error and
    the trajectory."""
    rows = []
    table = None if envelope is None else envelope.set_index("candidate")
    inside = {} if table is None else table.inside_envelope.to_dict()
    spans = {} if table is None or "envelope" not in table else table.envelope.to_dict()
    for row in masking.itertuples():
        span = spans.get(row.candidate, "float32")
        trajectory = ("" if row.candidate not in inside or inside[row.candidate] is None
                      or pd.isna(inside[row.candidate]) else
                      f"; trajectory inside the {span} envelope" if inside[row.candidate] else
                      f"; trajectory leaves the {span} envelope")
        headline = (f"update error {format_number(row.sgd_update_rel_err)} vs weight error "
                    f"{format_number(row.sgd_weight_rel_err)} (weights hide it {format_factor(row.weights_hide_by)})"
                    f"{trajectory}")
        rows.append(summary_row(row.candidate, EXPERIMENT, decisions[row.candidate], headline,
                                update_rel_err=row.sgd_update_rel_err, weight_rel_err=row.sgd_weight_rel_err,
                                inside_envelope=inside.get(row.candidate)))
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# the conclusion


def conclude(summary, masking, envelope, judgements: dict, lr: float, adam_lr: float, steps: int | None = None,
                   skipped=()) -> Conclusion:
    """01: the gradient verdicts, what one SGD/Adam step shows of each error, and the k-step trajectories."""

    masking = masking.set_index("candidate")
    inside = {} if envelope is None else envelope.set_index("candidate").to_dict("index")
    findings = []
    for row in summary.itertuples():
        judgement, m = judgements[row.candidate], masking.loc[row.candidate]
        text = (f"Its gradients are {judgement_phrase(judgement)}. One SGD step (lr = {lr:g}) carries the gradient "
                f"error unchanged into the update lr·g ({format_number(m.sgd_update_rel_err)} relative, against "
                f"{format_number(m.grad_rel_err)} in the gradient) but shows it {format_factor(m.weights_hide_by)} "
                f"smaller in the weights, where it changes {format_percent(m.error_visible_in_weights)} of the stored "
                "float32 values.")
        measurements = judgement_measurements(judgement)[:2] + [
            Measurement("weights after one SGD step hide the gradient error by", format_factor(m.weights_hide_by),
                        "the update lr·g hides nothing: compare updates")]
        if row.candidate in inside and inside[row.candidate]["inside_envelope"] is not None \
                and not pd.isna(inside[row.candidate]["inside_envelope"]):
            e = inside[row.candidate]
            where = "stay inside" if e["inside_envelope"] else "leave"
            text += (f" Over {steps if steps is not None else 'k'} SGD steps its weights {where} the envelope of "
                     f"legitimate {e.get('envelope', 'float32')} implementations (worst step at "
                     f"{format_factor(e['max_distance_over_envelope'])} the envelope's edge).")
            measurements.append(Measurement("weight distance to float64 ÷ envelope edge, worst step",
                                            format_factor(e["max_distance_over_envelope"]),
                                            f"inside: ≤ {ENVELOPE_MARGIN:g}×"))
        findings.append(Finding(row.candidate, row.verdict, text, measurements, action_for(judgement),
                                judgement_detail(judgement)))
    hide = masking.weights_hide_by
    lead = (f"Comparing weights after one SGD step (lr = {lr:g}) hides a gradient error by "
            f"{format_range(hide.min(), hide.max())}×, and Adam's first step (lr = {adam_lr:g}) is lr·sign(g) in at "
            f"least {format_percent(masking.adam_sign_only_fraction.min())} of elements, so neither comparison tells "
            f"rounding from a bug; judged on the gradients (and the updates, which keep their error): "
            f"{verdict_groups(findings)}.")
    return Conclusion(EXPERIMENT, lead, findings, skipped_notes(skipped) + unprobed_notes(judgements))
