"""precision-lab: is a gradient that differs from PyTorch's rounding error, a lower-precision mode, a
layout slip, or a bug?

The public surface, for a notebook or a script (docs/design.md maps the rest)::

    from precision_lab import diagnose, load_model, make_problem
    from precision_lab.candidates import resolve

    network = load_model("examples/models/small-unet.json")
    problem = make_problem(128, batch=2, seed=0, network=network)
    diagnosis = diagnose(resolve("builtin:native"), problem)
    print(diagnosis.to_text())  # "roundoff", and why

* `diagnose(candidate, problem)` → `Diagnosis`: the verdict from every piece of evidence (the
  requested problem, the probes, the float64 build, the run-to-run spread);
* `check_gradients(oracle)` → `GradCheck`: the reference-free check of a program that computes a loss
  and its gradient, for networks the lab has no model of;
* `load_model(spec)` and `from_module(module)` → `Network`; `make_problem(size, batch, seed, network=)`
  → `Problem`; `ModelSpecError` for a spec the lab cannot take.

Names are imported when first used, so `import precision_lab` stays light (the command line answers
--help without loading torch).
"""
from __future__ import annotations

import importlib

#: public name → the module that defines it
_HOMES = {"diagnose": "diagnosis", "Diagnosis": "decision", "check_gradients": "gradcheck", "GradCheck": "gradcheck",
          "load_model": "model", "from_module": "modules", "Network": "model", "ModelSpecError": "model",
          "make_problem": "problem", "Problem": "problem"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'precision_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
