"""One decision: every verdict the lab gives is decided here, from structured evidence (docs/design.md, "Verdicts").

`diagnose`, each notebook experiment, a campaign cell, `bench` and the HTML page all reach a
candidate's verdict through `decide`. Its evidence, all of it numbers:

* the judgement of the requested problem (precision_lab.verdict.judge: comparisons and doctors),
* the judgements of the probes (precision_lab.probes), each labelled with what really ran,
* the candidate's float64 build, when there is one (`Float64Build`: err64 ÷ err32 per quantity),
* the run-to-run spread, when measured (`Spread`: max spread ÷ bound per quantity),
* the size sweep's scaling, when measured (`Scaling`: error ÷ |g| at every size per quantity).

The reference-free check (`model: opaque`, precision_lab.gradcheck) decides here too: its finite
differences are the requested problem's comparisons, and its claimed-against-float64 build comparison
is a `Float64Build` whose persisting errors are what make a quantity `defect`.

`decide` copies the judgements it is given and never edits them, and reads the evidence in one
fixed order of its own, so the order in which evidence arrives cannot change the outcome:

1. evidence that an error is not rounding, whatever the bound says, makes a quantity `defect`:
   a spread between runs beyond the bound (a race that loses updates), an error that persists
   in the float64 build (it does not shrink with the arithmetic), an error O(1) relative to the
   gradient at every size of a sweep;
2. `inconclusive` quantities are settled where other evidence certifies them (`settle`);
3. the overall verdict is the worst over the requested problem and every probe
   (precision_lab.verdict.SEVERITY), named by the first problem that names it.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from .compare import TOO_LARGE_A_BOUND
from .formats import UNIT_ROUNDOFF
from .jsonable import json_safe
from .verdict import CERTIFIABLE_FRACTION, Judgement, overall, worst

#: the cosine every certified quantity has (‖error‖ ≤ CERTIFIABLE_FRACTION·‖reference‖ gives cos ≥ √(1 − ¼));
#: a quantity settled elsewhere must show it on its own problem too
CERTIFIED_COSINE = math.sqrt(1.0 - CERTIFIABLE_FRACTION ** 2)
#: the kind of a sweep's other size judged beside the requested problem (probes.ProbeRun.of_size)
SWEEP_SIZE = "sweep-size"
#: how a settled quantity's evidence begins (its `settled_by` says by what)
SETTLED = "not certifiable by its bound on this problem; "


# ---------------------------------------------------------------------------------------------
# evidence beyond one problem's comparisons, as numbers


#: experiment 02's finding for an error no larger than the float64 reference's own (compare.reference_accuracy)
REFERENCE_ACCURACY = "within the reference's accuracy"


@dataclass(frozen=True)
class Float64Build:
    """The candidate's float64 build on the requested problem (experiment 02), or on a probe (ProbeRun.float64_build):
    per quantity err32, err64, their ratio and what it shows (`finding`: 'vanishes in float64', 'persists in
    float64', …); `verdict` is the float64 build's own judgement against the float64 reference."""

    quantities: dict  # quantity → {"err32", "err64", "ratio", "expected_ratio_if_rounding", "finding"}
    verdict: str | None
    expected_ratio: float
    threshold: float

    @property
    def persists(self) -> list[str]:
        return [name for name, row in self.quantities.items() if row["finding"] == "persists in float64"]

    @property
    def vanishes(self) -> list[str]:
        return [name for name, row in self.quantities.items() if row["finding"] == "vanishes in float64"]

    def to_json(self) -> dict:
        return json_safe({"verdict": self.verdict, "expected_ratio_if_rounding": self.expected_ratio,
                          "threshold": self.threshold, "persists": self.persists, "quantities": self.quantities})


@dataclass(frozen=True)
class Spread:
    """`runs` runs of the candidate on the requested problem: per quantity the largest run-to-run spread and that
    spread ÷ the quantity's bound (atomics or a racing split-K order: beyond the bound updates were lost)."""

    runs: int
    quantities: dict  # quantity → {"max_spread", "spread_ratio", "identical"}

    @property
    def worst_quantity(self) -> str:
        return max(self.quantities, key=lambda n: self.quantities[n]["spread_ratio"])

    @property
    def worst_ratio(self) -> float:
        return self.quantities[self.worst_quantity]["spread_ratio"]

    @property
    def bitwise_reproducible(self) -> bool:
        return all(entry["identical"] for entry in self.quantities.values())

    def to_json(self) -> dict:
        return json_safe({"runs": self.runs, "quantities": self.quantities, "worst_quantity": self.worst_quantity,
                          "worst_spread_ratio": self.worst_ratio, "bitwise_reproducible": self.bitwise_reproducible})


@dataclass(frozen=True)
class Scaling:
    """A size sweep (experiment 03): per quantity the smallest max|error| ÷ max|g| over the sizes swept, and the
    level `defect_level` no rounding mode reaches (experiments.size_sweep.DEFECT_REL_TO_GRAD)."""

    sizes: tuple[int, ...]
    smallest_rel_err: dict  # quantity → min over sizes of max|error| ÷ max|g|
    defect_level: float

    @property
    def defect_like(self) -> list[str]:
        return [name for name, value in self.smallest_rel_err.items() if value >= self.defect_level]


# ---------------------------------------------------------------------------------------------
# the decision


def decide(requested: Judgement, probes=(), *, float64_build: Float64Build | None = None,
           spread: Spread | None = None, scaling: Scaling | None = None, probed: bool = True,
           probe_note: str | None = None) -> "Diagnosis":
    """The verdict on a candidate from every piece of evidence there is (the module's docstring says how).

    `probes`: (ProbeRun, Judgement) pairs; `probed`: whether the probes were asked for (False: the verdict
    says it is unprobed). Nothing passed in is changed."""
    main = _copy(requested)
    judged = [(run, _copy(judgement)) for run, judgement in probes]
    found = not_rounding(main, float64_build, spread, scaling)
    _not_rounding(main, found)
    found_on = {}
    for run, judgement in judged:  # a probe's own float64 build (diagnosis.judge_probes) is read the same way
        if getattr(run, "float64_build", None) is not None:
            found_on[id(judgement)] = not_rounding(judgement, run.float64_build, None, None)
            _not_rounding(judgement, found_on[id(judgement)])
    settle(main, judged, float64_build)
    overall(main)
    if found and main.cause in {cause for _, cause, _ in found}:
        main.cause_by = "evidence"
    for _, judgement in judged:
        overall(judgement)
        if judgement.cause is not None and judgement.cause in {c for _, c, _ in found_on.get(id(judgement), ())}:
            judgement.cause_by = "evidence"
    return Diagnosis(main, judged, spread, probe_note, float64_build, probed, scaling)


def _not_rounding(judgement: Judgement, found: list[tuple[str, str, str]]) -> None:
    """Each quantity `not_rounding` found becomes a `defect` with its cause and evidence."""
    for name, cause, evidence in found:
        q = judgement.quantities[name]
        q.verdict, q.cause, q.cause_slip, q.cause_layers, q.evidence = "defect", cause, cause, (), evidence
        q.layout_fix, q.format, q.format_bound_ratio = None, None, None  # what named it before no longer does
    if found:
        judgement.cause = None  # re-derived by overall: the new defects may not share the doctors' cause


def not_rounding(main: Judgement, float64_build: Float64Build | None, spread: Spread | None,
                 scaling: Scaling | None) -> list[tuple[str, str, str]]:
    """(quantity, cause, evidence) for every quantity whose error other evidence shows is not rounding.

    A spread beyond the bound is a defect whatever the comparison said; an error that persists in float64 or
    stays O(1) of the gradient at every size is a defect where the bound alone passed it (a quantity already
    named `layout` keeps that name, and one named `reduced-precision` keeps it at every size; the sweep's fixed level does not override the sampled
    bound of a coarser format a quantity is `inconclusive` within, `_within_reduced`)."""
    found = {}
    if spread is not None:
        for name, entry in spread.quantities.items():
            if entry["spread_ratio"] > 1.0 and name in main.quantities:
                found[name] = ("run-to-run spread beyond the bound (a race that loses updates)",
                               f"runs differ by {entry['max_spread']:.3g}, {entry['spread_ratio']:.3g}× the bound")
    open_verdicts = ("roundoff", "inconclusive")
    if float64_build is not None:
        for name in float64_build.persists:
            q = main.quantities.get(name)
            # a format explains an error only if exact arithmetic removes it: a named format persisting is not one
            if q is not None and name not in found and q.verdict in open_verdicts + ("reduced-precision",):
                row = float64_build.quantities[name]
                # the reference-free check states its own comparison of the two builds (gradcheck.builds)
                found[name] = ("the error persists in the float64 build (not rounding error)",
                               row.get("evidence") or f"err64 ÷ err32 = {row['ratio']:.2g}; rounding predicts "
                               f"{float64_build.expected_ratio:.2g}, a defect ≈ 1")
    if scaling is not None:
        for name in scaling.defect_like:
            q = main.quantities.get(name)
            if q is not None and name not in found and q.verdict in open_verdicts and not _within_reduced(main, q):
                found[name] = ("an error O(1) relative to the gradient at every size (not rounding error)",
                               f"max|error| ÷ max|g| ≥ {scaling.smallest_rel_err[name]:.3g} at every size "
                               f"{', '.join(map(str, scaling.sizes))}; no rounding mode reaches "
                               f"{scaling.defect_level:.3g}")
    return [(name, cause, evidence) for name, (cause, evidence) in found.items()]


def _within_reduced(main: Judgement, q) -> bool:
    """Whether a quantity is `inconclusive` inside the sampled bound of a format coarser than float32 (claimed, or
    named by the format doctor): that derived bound, not the sweep's fixed level, says what the format reaches."""
    coarse = q.format or main.claimed_precision
    # only a bound too large to certify (compare.certify, or the format doctor's): not a drift or an unbounded element
    inside = q.format is not None or q.evidence.startswith(TOO_LARGE_A_BOUND)
    return (q.verdict == "inconclusive" and inside and coarse in UNIT_ROUNDOFF
            and UNIT_ROUNDOFF[coarse] > UNIT_ROUNDOFF["float32"])


def settle(main: Judgement, probes: list, float64_build: Float64Build | None = None) -> None:
    """Settle every problem's `inconclusive` quantities where the other evidence certifies them.

    A quantity is `inconclusive` when its bound is too large against it to certify rounding (a deep network's
    |W|·E bound at a size too large to sample, precision_lab.sampled.ELEMENT_LIMIT). On the requested problem it
    becomes `roundoff` when (a) the candidate's float64 build on that problem shows its error vanishing with the
    arithmetic (err64 ÷ err32 below the recompilation's boundary; a probe's own build is run where its bound left a
    quantity open, diagnosis.judge_probes), or (b) every probe certified it `roundoff` and its error
    here leaves the direction a certified quantity keeps (cosine ≥ CERTIFIED_COSINE). A probe's quantity is
    settled the same way by the requested problem and every other probe: a probe's bound cannot certify a
    quantity near zero there by chance (a one-element bias whose gradient is 1/20 of its bound on one probe of
    100 seeds). A quantity is settled on one problem only when it is `roundoff` on every other, so no settled
    verdict is what settles another: the order of the problems does not matter."""
    before = {id(j): {n: q.verdict for n, q in j.quantities.items()} for j in [main] + [j for _, j in probes]}
    problems = [("the requested problem", main)] + [(run.name, j) for run, j in probes]
    builds = {id(main): float64_build, **{id(j): getattr(run, "float64_build", None) for run, j in probes}}
    for label, judgement in problems:
        others = [(name, j) for name, j in problems if j is not judgement]
        build = builds[id(judgement)]
        vanished = set(build.vanishes) if build is not None else set()
        for q in judgement.quantities.values():
            if before[id(judgement)][q.quantity] != "inconclusive":
                continue
            if q.quantity in vanished and q.format is not None:
                # beyond the claimed bound, within a coarser format's, vanishing with the arithmetic: that format
                ratio = build.quantities[q.quantity]["ratio"]
                q.verdict, q.settled_by, q.settled_ratios = ("reduced-precision", "the float64 build",
                                                             {"err64 ÷ err32": ratio})
                q.evidence = (f"{SETTLED}within the {q.format} bound and settled by the float64 build: its error "
                              f"vanishes with the arithmetic (err64 ÷ err32 = {ratio:.2g})")
            elif q.quantity in vanished:
                ratio = build.quantities[q.quantity]["ratio"]
                q.verdict, q.settled_by, q.settled_ratios = "roundoff", "the float64 build", {"err64 ÷ err32": ratio}
                q.evidence = (f"{SETTLED}settled by the float64 build: its error vanishes with the arithmetic "
                              f"(err64 ÷ err32 = {ratio:.2g})")
            elif others and all(q.quantity in j.quantities and before[id(j)][q.quantity] == "roundoff"
                                for _, j in others) and q.cosine >= CERTIFIED_COSINE:
                q.verdict = "roundoff"
                sizes = any(run.kind == SWEEP_SIZE for run, _ in probes)
                q.settled_by = ("every probe" + (" and every other size" if sizes else "") if judgement is main
                                else "the requested problem and every other probe" + (" and size" if sizes else ""))
                q.settled_ratios = {name: j.quantities[q.quantity].bound_ratio for name, j in others}
                q.evidence = (f"{SETTLED}certified on {q.settled_by} (error ÷ bound "
                              + ", ".join(f"{name} {r:.2g}" for name, r in q.settled_ratios.items())
                              + f"), cosine here {q.cosine:.6f}")
            elif q.format is not None and others and all(
                    q.quantity in j.quantities and before[id(j)][q.quantity] == "reduced-precision"
                    and j.quantities[q.quantity].format == q.format for _, j in others):
                # beyond the claimed bound and within the format's, whose bound here was too large to certify: the
                # format each other problem certified names it
                q.verdict = "reduced-precision"
                q.settled_by = "every probe" if judgement is main else "the requested problem and every other probe"
                q.settled_ratios = {name: j.quantities[q.quantity].format_bound_ratio for name, j in others}
                q.evidence = (f"{SETTLED}within the {q.format} bound here, and {q.format} certified on "
                              f"{q.settled_by} (error ÷ {q.format} bound "
                              + ", ".join(f"{name} {r:.2g}" for name, r in q.settled_ratios.items() if r is not None)
                              + ")")


def _copy(judgement: Judgement) -> Judgement:
    """A judgement whose quantities and lists can be changed without touching the caller's."""
    return replace(judgement, quantities={name: copy.copy(q) for name, q in judgement.quantities.items()},
                   notes=list(judgement.notes))


# ---------------------------------------------------------------------------------------------
# the decided verdict


@dataclass
class Diagnosis:
    """A candidate's verdict on the requested problem and on each probe; overall, the worst (made by `decide`)."""

    main: Judgement
    probes: list = field(default_factory=list)  # (ProbeRun, Judgement)
    spread: Spread | None = None
    probe_note: str | None = None  # how the probes were chosen when the network fixes the size
    float64_build: Float64Build | None = None
    probed: bool = True  # False: probes were turned off, the verdict is the requested problem's alone
    scaling: Scaling | None = None

    @property
    def verdict(self) -> str:
        return worst([self.main.verdict] + [j.verdict for _, j in self.probes])

    @property
    def repeats(self) -> dict:
        """The run-to-run spread as the diagnose JSON writes it ({} when not measured)."""
        return self.spread.to_json() if self.spread is not None else {}

    @property
    def candidate(self) -> str:
        return self.main.candidate

    @property
    def claimed_precision(self) -> str:
        return self.main.claimed_precision

    @property
    def quantities(self):
        return self.main.quantities

    def problems(self) -> list[tuple[str, Judgement]]:
        """(label, judgement) of the requested problem and each probe, in that order."""
        return [("requested", self.main)] + [(run.name, j) for run, j in self.probes]

    def deciding(self) -> Judgement:
        """The judgement whose verdict is the overall one: the first (requested problem, then the probes) that
        names a cause, else the first with that verdict. A cause needs a recomputation that the requested
        problem may be too large for (doctors.RECOMPUTE_LIMIT on a CPU); a probe is small enough to name it."""
        chosen = self._chosen()
        same = [j for _, j in self.problems() if j.verdict == self.verdict]
        # a cause must explain every problem where the doctor tested it, not the first that names one
        causes = {j.cause for j in same if getattr(j, "hypotheses", None) and getattr(j, "cause_by", None) != "evidence"}
        if chosen.cause and len(causes) > 1:
            unknown = "cause unknown: the problems name different causes (" + "; ".join(
                sorted(str(c) for c in causes)) + ")"
            return replace(chosen, cause=None, notes=list(chosen.notes) + [unknown])
        return chosen

    def _chosen(self) -> Judgement:
        same = [j for _, j in self.problems() if j.verdict == self.verdict]
        named = [j for j in same if j.layout_fix or j.format or j.cause]
        # a cause a doctor named (a fitted slip, a gradient never computed) says more than "persists in float64"
        by_doctor = [j for j in named if j.cause and getattr(j, "cause_by", None) == "doctor"]
        return (by_doctor or named or same)[0]

    def decided_by(self) -> str:
        chosen = self._chosen()
        return next(label for label, j in self.problems() if j is chosen)

    def judgement(self) -> Judgement:
        """The decision as one judgement: the overall verdict, what names it (from `deciding`), and per quantity
        the worst verdict over every problem (the conclusions and tables read this)."""
        deciding = self.deciding()
        quantities = {}
        for name, q in self.main.quantities.items():
            chosen = q
            for run, j in self.probes:
                other = j.quantities.get(name)
                if other is not None and worst([chosen.verdict, other.verdict]) != chosen.verdict:
                    chosen = replace(other, problem=run.name)
            quantities[name] = chosen
        return replace(deciding, verdict=self.verdict, quantities=quantities, probed=self.probed,
                       notes=list(deciding.notes) + self.notes())

    def notes(self) -> list[str]:
        """What the decision read beside the problems' judgements, in words: the spread, the float64 build."""
        notes = []
        if self.spread is not None:
            notes.append(self.spread_text())
        if self.float64_build is not None:
            build = self.float64_build
            ratios = ", ".join(f"{name} {row['ratio']:.2g}" for name, row in build.quantities.items())
            notes.append(f"float64 build: {build.verdict or 'computed'} against the float64 reference; err64 ÷ err32 "
                         f"{ratios} (rounding predicts {build.expected_ratio:.2g}, a defect ≈ 1; boundary "
                         f"{build.threshold:.2g}): " + (f"persists in {', '.join(build.persists)}" if build.persists
                                                        else "vanishes everywhere"))
        if not self.probed:
            notes.append("unprobed: judged on the requested problem alone (probes off); boundary and indexing slips "
                         "that hide under this problem's bound are not ruled out")
        hidden = self.hidden_scale()
        if hidden is not None:
            name, scale = hidden
            fmt = self.main.quantities[name].format or self.claimed_precision
            notes.append(f"resolution: a slip that scales or drops part of a gradient by less than {scale:.2g} of its "
                         f"norm ({name}) hides in {fmt} rounding on this problem; the float64 build "
                         f"of the same program (command_float64) shows one, as an error that persists")
        return notes

    def hidden_scale(self) -> tuple[str, float] | None:
        """(quantity, along-bound ÷ ‖g‖) of the coarsest gradient within a reduced format's bound (claimed, or named by
        the format doctor), judged without a float64 build: the size of a slip along the gradient that the format's
        own error could hide (compare.along, doctors.formats)."""
        if self.float64_build is not None:
            return None
        seen = [(q.along_resolution, name) for name, q in self.main.quantities.items()
                if q.along_resolution is not None and q.verdict in ("roundoff", "inconclusive", "reduced-precision")]
        if not seen:
            return None
        scale, name = max(seen)
        return name, scale

    def spread_text(self) -> str | None:
        if self.spread is None:
            return None
        return (f"{self.spread.runs} runs, largest run-to-run spread ÷ bound {self.spread.worst_ratio:.3g} "
                f"({self.spread.worst_quantity}), "
                + ("bitwise reproducible" if self.spread.bitwise_reproducible else "not bitwise reproducible"))

    def float64_text(self) -> str | None:
        build = self.float64_build
        if build is None:
            return None
        # NaN: err32 = 0; an error within the reference's own accuracy has no ratio to read
        ratios = [(row["ratio"], name) for name, row in build.quantities.items()
                  if row.get("ratio") is not None and row["ratio"] == row["ratio"]
                  and row["finding"] != REFERENCE_ACCURACY]
        largest = max(ratios, default=None)
        at_accuracy = [name for name, row in build.quantities.items() if row["finding"] == REFERENCE_ACCURACY]
        return ((f"{build.verdict} against the float64 reference; " if build.verdict else "")
                + "largest err64 ÷ err32 " + (f"{largest[0]:.2g} ({largest[1]})" if largest else "n/a")
                + f" (rounding predicts {build.expected_ratio:.2g}, a defect ≈ 1): "
                + (f"the error persists in {', '.join(build.persists)}" if build.persists else "the error vanishes")
                + (f"; {', '.join(at_accuracy)}: within the float64 reference's own accuracy (zero by structure)"
                   if at_accuracy else ""))

    def probe_rows(self) -> list[dict]:
        """One row per probe: what ran (size, batch, seed, targets), its verdict, what names it, its worst quantity."""
        rows = []
        for run, j in self.probes:
            top = max(j.quantities.values(), key=lambda q: q.bound_ratio)
            rows.append({"candidate": self.candidate, "probe": run.name, "image": f"{run.height}×{run.width}",
                         "batch": run.batch, "seed": run.seed, "targets": run.targets, "verdict": j.verdict,
                         "named": j.layout_fix or j.format or j.cause, "worst_quantity": top.quantity,
                         "worst_bound_ratio": top.bound_ratio})
        return rows

    def to_json(self) -> dict:
        deciding = self.deciding()
        main = self.main.to_json()
        probes = []
        for run, judgement in self.probes:
            entry = judgement.to_json()
            entry.update(name=run.name, probe=run.kind, why=run.why)
            build = getattr(run, "float64_build", None)  # the probe's own, where its bound left a quantity open
            entry["float64_build"] = build.to_json() if build is not None else None
            probes.append(entry)
        parameters = {}
        for name, entry in main["parameters"].items():
            chosen, where = entry, "requested"
            for run, judgement in self.probes:
                other = judgement.to_json()["parameters"].get(name)
                if other and worst([chosen["verdict"], other["verdict"]]) != chosen["verdict"]:
                    chosen, where = other, run.name
            parameters[name] = dict(chosen, problem=where)
            if self.float64_build is not None:
                parameters[name]["float64_build"] = json_safe(self.float64_build.quantities.get(name))
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "layout_fix": deciding.layout_fix, "layout_advice": deciding.layout_advice, "format": deciding.format,
                "cause": deciding.cause, "localisation": deciding.localisation, "decided_by": self.decided_by(),
                "probed": self.probed, "problem": main["problem"], "parameters": parameters,
                "forward": main["forward"], "evidence": main["evidence"] + self.notes(), "main": main,
                "probes": probes, "probe_note": self.probe_note,
                "float64_build": self.float64_build.to_json() if self.float64_build is not None else None,
                "repeats": self.repeats}

    def summary(self) -> "Summary":
        """What this diagnosis says, once: the text verdict and the HTML page are both written from it."""
        deciding = self.deciding()
        named = deciding.layout_fix or deciding.format or deciding.cause or deciding.localisation
        label = {id(self.main): "the requested problem"}
        label.update({id(j): f"probe {run.name}" for run, j in self.probes})
        failing = [(label[id(self.main)], q) for q in self.main.quantities.values() if q.verdict != "roundoff"]
        chosen = self._chosen()
        if not failing and self.verdict != "roundoff":  # only a probe fails: show where
            failing = [(label[id(chosen)], q) for q in deciding.quantities.values() if q.verdict != "roundoff"]
        probes = [(run.name, run.text(), j.verdict, j.layout_fix or j.format or j.cause or j.localisation)
                  for run, j in self.probes]
        settled = [q.quantity for q in self.main.quantities.values() if q.settled_by]
        off = self.verdict != "roundoff"
        return Summary(candidate=self.candidate, claimed_precision=self.claimed_precision, verdict=self.verdict,
                       named=named if off else None, decided_by=label[id(chosen)],
                       cause=deciding.cause if off else None, first_failing=deciding.localisation if off else None,
                       fix=deciding.layout_advice if off else None, failing=failing,
                       within=[q.quantity for q in self.main.quantities.values()
                               if q.verdict == "roundoff" and q.quantity not in settled],
                       settled=settled, probes=probes, repeats=self.spread_text(),
                       worst_within=_worst_within(self.main, settled), probe_note=self.probe_note,
                       float64_build=self.float64_text(), probed=self.probed)

    def to_text(self, verbose: bool = False) -> str:
        """The verdict, what names it, the fix, and only what fails; `verbose`: every quantity of every problem."""
        if not verbose:
            return self.summary().to_text()
        lines = [self.main.to_text()]
        lines += [f"  - {line}" for line in self.notes()]
        if self.probe_note:
            lines.append(f"probes: {self.probe_note}")
        for run, judgement in self.probes:
            lines.append(f"probe {run.name} ({run.text()}): {judgement.headline()}")
            if judgement.verdict != "roundoff":
                lines += [f"  - {line}" for line in judgement.evidence[:6]]
        lines.append(f"overall verdict: {self.summary().headline}")
        return "\n".join(lines)


def _named(q) -> str | None:
    return q.layout_fix or q.format or q.cause


def _worst_within(judgement, settled=()) -> str | None:
    within = [q for q in judgement.quantities.values() if q.verdict == "roundoff" and q.quantity not in settled]
    if not within:
        return None
    top = max(within, key=lambda q: q.bound_ratio)
    return f"{top.bound_ratio:.3g}, {top.quantity}"


@dataclass
class Summary:
    """A diagnosis in the words both the text verdict and the HTML page use (one source for both)."""

    candidate: str
    claimed_precision: str
    verdict: str
    named: str | None  # the transform, format, cause or first failing op that names the verdict
    decided_by: str  # "the requested problem" or "probe NAME": the judgement that names it
    cause: str | None  # a defect's named cause
    first_failing: str | None  # the first failing op, or the earliest failing quantity in backprop order
    fix: str | None  # the layout fix in words
    failing: list = field(default_factory=list)  # (problem label, QuantityVerdict) beyond the bound
    within: list[str] = field(default_factory=list)  # quantities of the requested problem within the bound
    probes: list = field(default_factory=list)  # (name, problem in words, verdict, what names it)
    repeats: str | None = None
    worst_within: str | None = None  # "0.0123, conv2.weight": how much of the bound the closest quantity uses
    probe_note: str | None = None  # how the probes were chosen when the network fixes the size
    float64_build: str | None = None  # the command_float64 build in words: err64 ÷ err32, vanishes or persists
    settled: list[str] = field(default_factory=list)  # requested-problem quantities settled by the probes or build
    probed: bool = True

    @property
    def headline(self) -> str:
        """'layout (flip HW)', 'defect (act2 backward: mask missing)', 'roundoff'."""
        return self.verdict + (f" ({self.named})" if self.named else "")

    def to_text(self) -> str:
        lines = [f"candidate {self.candidate}  (claimed {self.claimed_precision})",
                 f"verdict: {self.headline}" + (f", named on {self.decided_by}"
                                                if self.named and self.decided_by != "the requested problem" else "")]
        if self.cause and self.cause != self.named:
            lines.append(f"  cause: {self.cause}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.first_failing:
            lines.append(f"  where: {self.first_failing}")
        if self.repeats:
            lines.append(f"  repeats: {self.repeats}")
        if self.float64_build:
            lines.append(f"  float64 build: {self.float64_build}")
        if self.failing:
            lines.append(f"  beyond the bound on {self.failing[0][0]}:")
            lines += [f"    {q.quantity:<13} {q.verdict:<17} max|err| {q.max_abs_err:9.3g}  err/bound {q.bound_ratio:9.3g}"
                      + (f"  ({_named(q)})" if _named(q) and _named(q) != self.named else "")
                      for _, q in self.failing]
        if self.within:
            lines.append(f"  within the bound: {', '.join(self.within)}"
                         + (f" (worst error ÷ bound {self.worst_within})" if self.worst_within else ""))
        if self.settled:
            lines.append(f"  settled elsewhere (too large a bound here to certify rounding): {', '.join(self.settled)} "
                         "— certified on every probe or by the float64 build (--verbose says which)")
        said = {verdict + (f" ({named})" if named else "") for _, _, verdict, named in self.probes}
        if len(said) == 1 and len(self.probes) > 1:  # the usual case: every probe agrees
            lines.append(f"  probes: all {len(self.probes)} {said.pop()} "
                         f"({', '.join(name for name, _, _, _ in self.probes)})")
        elif self.probes:
            lines.append("  probes: " + "; ".join(f"{name} {verdict}" + (f" ({named})" if named else "")
                                                 for name, _, verdict, named in self.probes))
        if not self.probed:
            lines.append("  unprobed: probes off, judged on the requested problem alone")
        if self.probe_note:
            lines.append(f"  probes: {self.probe_note}")
        if self.verdict != "roundoff" or self.probes:
            lines.append("  (every quantity's evidence, and each probe's: --verbose)")
        return "\n".join(lines)
