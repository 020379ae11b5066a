"""What a check returns: a verdict per tensor and for the program, with its evidence, as text, JSON or a table."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from ..jsonable import json_safe

if TYPE_CHECKING:  # annotations only
    from ..decision import Diagnosis
    from .builds import BuildComparison
    from .groups import Share
    from .localise import Located
    from .noise import Noise
    from .segments import Segment
    from .stencils import Direction

VERDICTS = ("roundoff", "defect", "inconclusive")


@dataclass
class TensorVerdict:
    """One parameter tensor: verdict, the numbers the diagnose JSON needs, and the evidence."""

    name: str
    shape: tuple[int, ...]
    verdict: str = "inconclusive"
    max_abs_err: float = math.nan
    bound_ratio: float = math.nan
    evidence: list[str] = field(default_factory=list)
    directions: list[Direction] = field(default_factory=list)
    comparison: BuildComparison | None = None
    located: list[Located] = field(default_factory=list)
    settle: str = ""
    segment: "Segment | None" = None  # the float32-only check's segment
    shares: list["Share"] = field(default_factory=list)  # its parts of group scaling segments (float32-only)

    def summary(self) -> dict:
        evidence = [x for x in [self.segment, *self.shares, *self.directions] if x is not None and x.deciding is not None]
        # a defect states its finest disagreement; a roundoff or open tensor its finest agreement, not a group that
        # another member failed
        wanted = "disagree" if self.verdict == "defect" else "agree"
        evidence = [x for x in evidence if x.outcome == wanted] or evidence
        deciding = min(evidence, key=lambda x: x.resolution if x.outcome == wanted else math.inf, default=None)
        return {"verdict": self.verdict, "max_abs_err": self.max_abs_err, "bound_ratio": self.bound_ratio,
                "layout_fix": None, "shape": list(self.shape),
                "directional_error": deciding.relative_error if deciding else None,
                "resolution": deciding.resolution if deciding else None,
                "evidence": list(self.evidence), "located": [vars(x) for x in self.located],
                "what_would_settle_it": self.settle or None,
                "directions": [d.summary() for d in self.directions],
                "segment": self.segment.summary() if self.segment else None,
                "scaling_segments": [x.summary() for x in self.shares],
                "build_comparison": self.comparison.summary() if self.comparison else None}


@dataclass
class GradCheck:
    """The result of a reference-free gradient check."""

    candidate: str
    claimed_precision: str
    has_float64: bool
    verdict: str
    tensors: dict[str, TensorVerdict]
    whole: list[Direction]
    loss: BuildComparison | None
    noise: dict[str, Noise]
    calls: dict[str, int]
    budget: int
    wall_s: float
    program_s: float
    seed: int
    notes: list[str] = field(default_factory=list)
    #: sets of tensors one of which is wrong, where the check cannot tell which (a scaling segment of several)
    defect_in_one_of: list[list[str]] = field(default_factory=list)
    #: the lab's one decision on this evidence (precision_lab.decision.Diagnosis, via gradcheck.decided)
    decision: "Diagnosis | None" = None

    @property
    def causes(self) -> dict[str, str]:
        """Each defect quantity's cause as the decision named it (e.g. an error persisting in the float64 build)."""
        if self.decision is None:
            return {}
        return {name: q.cause for name, q in self.decision.main.quantities.items()
                if q.verdict == "defect" and q.cause}

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def headline(self) -> str:
        bad = [t for t in self.tensors.values() if t.verdict == self.verdict and self.verdict != "roundoff"]
        if self.verdict == "defect":
            names = [t.name for t in bad] + [f"one of {' or '.join(group)}" for group in self.defect_in_one_of]
            return f"defect in {', '.join(names) or 'the whole gradient'}"
        if self.verdict == "inconclusive":
            return f"inconclusive for {', '.join(t.name for t in bad)}: {bad[0].settle}" if bad else "inconclusive"
        resolution = max((t.summary()["resolution"] for t in self.tensors.values()
                          if t.summary()["resolution"] is not None), default=math.nan)
        return f"roundoff: every gradient is the derivative of the loss (to {resolution:.2g} relative or better)"

    def cost(self) -> str:
        parts = [f"{n} {build}" for build, n in self.calls.items() if n]
        return (f"{self.total_calls} program calls ({', '.join(parts)}; budget {self.budget}), "
                f"wall time {self.wall_s:.1f} s ({self.program_s:.1f} s inside the program)")

    def to_text(self) -> str:
        lines = [f"candidate {self.candidate}  (opaque; claimed {self.claimed_precision}; "
                 f"float64 build: {'yes' if self.has_float64 else 'no'})",
                 f"verdict: {self.headline()}"]
        for tensor in self.tensors.values():
            resolution = tensor.summary()["resolution"]
            reached = (f"  {'to' if tensor.verdict == 'roundoff' else 'resolution'} {resolution:.2g} relative"
                       if resolution is not None and math.isfinite(resolution) else "")
            lines.append(f"  {tensor.name:<24} {tensor.verdict:<13} max|err| {tensor.max_abs_err:9.3g}  "
                         f"err/bound {tensor.bound_ratio:9.3g}{reached}")
            lines += [f"      {text}" for text in tensor.evidence]
        for direction in self.whole:
            lines.append(f"  whole gradient: {direction.evidence()}")
        if self.loss is not None:
            lines.append(f"  loss: {self.claimed_precision} − float64 build: {self.loss.max_abs_err:.3g} at the base point, "
                         f"repeating part {self.loss.persistent:.3g} (err/bound {self.loss.bound_ratio:.3g})")
        for build, noise in self.noise.items():
            info = noise.summary()
            lines.append(f"  noise ({build} build, {noise.precision}): σ_loss = {noise.loss_sigma:.3g} "
                         f"= {info['loss_sigma_in_u']:.3g}·u·|loss| (measured, {noise.dof} dof)")
        lines += [f"  - {note}" for note in self.notes]
        lines.append(f"cost: {self.cost()}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return json_safe({
            "candidate": self.candidate, "kind": "opaque", "verdict": self.verdict,
            "claimed_precision": self.claimed_precision, "has_float64": self.has_float64,
            "headline": self.headline(),
            "parameters": {name: t.summary() for name, t in self.tensors.items()},
            "whole_gradient": [d.summary() for d in self.whole],
            "forward": {"loss": self.loss.summary() if self.loss else None},
            "noise": {build: n.summary() for build, n in self.noise.items()},
            "cost": {"calls": self.total_calls, "calls_by_build": dict(self.calls), "budget": self.budget,
                     "wall_s": self.wall_s, "program_s": self.program_s},
            "seed": self.seed, "notes": list(self.notes), "causes": self.causes,
            "defect_in_one_of": [list(g) for g in self.defect_in_one_of]})

    def to_frame(self):
        import pandas as pd

        rows = []
        for tensor in self.tensors.values():
            summary = tensor.summary()
            rows.append({"candidate": self.candidate, "tensor": tensor.name, "verdict": tensor.verdict,
                         "max_abs_err": tensor.max_abs_err, "bound_ratio": tensor.bound_ratio,
                         "directional_error": summary["directional_error"], "resolution": summary["resolution"],
                         "located": "; ".join(x.region for x in tensor.located),
                         "evidence": " | ".join(tensor.evidence)})
        return pd.DataFrame(rows)
