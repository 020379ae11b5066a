"""Candidates: implementations under test. Each maps a Problem to a Result (docs/design.md, "Candidates").

A candidate computes one forward + backward of a problem (any network the problem carries) in
its own precision and weight layout and returns the gradients in the canonical layout (OIHW,
OI), converted with the layout it *declares*: a layout slip survives the conversion, as it would
in real code. A built-in candidate says which networks it applies to (`applies`): a convolution
algorithm needs a 3×3 convolution, a missing-mask defect needs a ReLU.

`resolve(spec)` turns what a user writes into a candidate:
``builtin:NAME`` or ``NAME`` (the registry), ``path/to/candidate.yaml`` (a command candidate),
or a bundle directory (a static bundle).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..compute import Result
from ..problem import Problem

#: families, in the order reports list them
FAMILIES = ("builtin", "legitimate", "defect", "bundle", "command")


class CandidateError(ValueError):
    """A candidate could not be resolved or failed to run: the message says which and why."""


@dataclass
class Candidate:
    """An implementation under test.

    `compute(problem, precision, device)` runs it: `precision` is "float32" for the build as
    claimed (its `claimed_precision`, e.g. float32 or tf32) and "float64" for the recompiled
    build (experiment 02); `has_float64` says whether the latter exists.
    `expected` is the verdict a zoo candidate must receive (None for real implementations).
    """

    name: str
    description: str
    run: Callable[[Problem, str, torch.device], Result]
    claimed_precision: str = "float32"
    weight_layout: str = "OIHW"
    family: str = "builtin"
    expected: str | None = None
    expected_detail: str | None = None  # the format or transform a zoo verdict must name
    has_float64: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda")
    meta: dict = field(default_factory=dict)
    applies: Callable | None = None  # network → bool: whether this candidate means anything for it
    network: object | None = None  # the network an external candidate computes (None: whatever the problem says)
    loss_scale: float = 1.0  # a float16 program's loss scale (its gradients are rounded scaled: formats, roundoff)

    def compute(self, problem: Problem, precision: str = "float32", device: str | torch.device = "cpu") -> Result:
        if precision not in ("float32", "float64"):
            raise CandidateError(f"candidate {self.name}: precision must be float32 or float64, got {precision!r}")
        if precision == "float64" and not self.has_float64:
            raise CandidateError(f"candidate {self.name} has no float64 build")
        if self.network is not None and problem.network.spec != self.network.spec:
            raise CandidateError(f"candidate {self.name} computes the network {self.network.name!r} "
                                 f"({self.network.summary()}), but the problem is {problem.network.name!r}: "
                                 f"run it on its own model (the `model` parameter or --model)")
        device = torch.device(device)
        from ..conv.backends import native_flags

        # a candidate computes what it claims: TF32 on a GPU only where its own run asks for it (native-tf32); a
        # program's arithmetic is its own, and its runs overlap (precision_lab.diagnosis): the global flags stay put
        with native_flags(fp32_precision="ieee") if self.family != "command" else contextlib.nullcontext():
            result = self.run(problem, precision, device)
        result.meta.setdefault("candidate", self.name)
        result.meta.setdefault("claimed_precision", self.claimed_precision if precision == "float32" else "float64")
        if precision == "float32" and self.loss_scale != 1.0:
            result.meta.setdefault("loss_scale", self.loss_scale)
        return result

    def supports(self, device: str | torch.device) -> bool:
        return torch.device(device).type in self.devices

    def accepts(self, verdict: str) -> bool:
        """Whether `verdict` is right for this zoo candidate: its expected one, or `inconclusive` for an honest
        reduced-format claim, whose worst-case operand bound may exceed half a gradient and then certifies nothing
        (compare.certify) — never a defect, layout or format."""
        from ..formats import REDUCED_FORMATS

        return verdict == self.expected or (verdict == "inconclusive" and self.family == "legitimate"
                                            and self.claimed_precision in REDUCED_FORMATS)

    def applies_to(self, network) -> bool:
        """Whether this candidate has a meaning for `network` (a slip needs the layer it slips in)."""
        if self.network is not None and self.network.spec != network.spec:
            return False
        return self.applies is None or bool(self.applies(network))

    def describe(self) -> dict:
        return {"name": self.name, "description": self.description, "family": self.family,
                "claimed_precision": self.claimed_precision, "weight_layout": self.weight_layout,
                "has_float64": self.has_float64, "expected": self.expected, "loss_scale": self.loss_scale,
                "expected_detail": self.expected_detail, **self.meta}


_REGISTRY: dict[str, Candidate] = {}


def register(candidate: Candidate) -> Candidate:
    """Add a built-in candidate under its name (names are unique)."""
    if candidate.name in _REGISTRY:
        raise ValueError(f"candidate {candidate.name!r} registered twice")
    _REGISTRY[candidate.name] = candidate
    return candidate


def _load_builtins() -> None:
    # imported for their register() side effects; zoo and conv variants live in their own modules
    from . import builtin  # noqa: F401
    from . import zoo  # noqa: F401


def registry() -> dict[str, Candidate]:
    """Every built-in candidate, by name."""
    _load_builtins()  # always: one of the modules imported on its own (builtin) registers only its own candidates
    return dict(_REGISTRY)


def get_builtin(name: str) -> Candidate:
    candidates = registry()
    if name not in candidates:
        raise CandidateError(f"unknown built-in candidate {name!r}: choose from {', '.join(sorted(candidates))}")
    return candidates[name]


def resolve(spec: str | Candidate, base_dir: str | Path | None = None) -> Candidate:
    """A candidate from `builtin:NAME`, `NAME`, a command YAML path or a static bundle directory."""
    if isinstance(spec, Candidate):
        return spec
    if not isinstance(spec, str) or not spec:
        raise CandidateError(f"candidate must be a name, a YAML path or a bundle directory, got {spec!r}")
    if spec.startswith("builtin:"):
        return get_builtin(spec.removeprefix("builtin:"))
    path = Path(spec)
    if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).exists():
        path = Path(base_dir) / path
    if path.suffix.lower() in (".yaml", ".yml"):
        from .command import _read_yaml, load_command_candidate

        spec_yaml = _read_yaml(path.resolve())
        if spec_yaml.get("model") == "opaque":  # a network the lab has no model of: the reference-free check
            from .opaque import load_opaque_candidate

            return load_opaque_candidate(path.resolve(), spec_yaml)
        return load_command_candidate(path)
    if path.is_dir():
        from .static import BundleCandidate

        return BundleCandidate.from_dir(path)
    if "/" in spec or spec.endswith((".json", ".npz")):
        raise CandidateError(f"{spec}: not a candidate YAML file or a bundle directory")
    return get_builtin(spec)
