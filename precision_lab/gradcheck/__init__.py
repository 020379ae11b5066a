"""Reference-free gradient check: is a program's gradient the derivative of the loss it returns?

For networks the lab has no model of, the only reference is the program's own loss. `check_gradients`
calls the program (an `Oracle`: loss and gradients for given parameters, in its claimed build and
optionally a float64 one) at points it chooses and returns a `GradCheck`: per tensor ``roundoff``,
``defect`` or ``inconclusive``, with the evidence. The method is described in `check`.

Parts:

- `check`: the order of the check and the verdicts (`check_gradients`)
- `program`: the program interface (`Oracle`, `FunctionOracle`, `Evaluation`) and the call budget
- `points`: points on the build's grid, g·Δ along a displacement
- `noise`: the rounding noise fitted at nearby points; Student t tails and quantiles
- `stencils`: directional derivatives from w ± a·Δ at shrinking steps, kinks stepped around
- `localise`: halving a failing direction down to the wrong element
- `builds`: the claimed build against the float64 build
- `segments`: float32-only programs, the loss difference against the gradient integrated along a segment
- `groups`: a layer's tensors scaled together (no kink along the segment), and which member a disagreement names
- `decided`: the check's evidence decided by the lab's one decision (`decision.decide`)
- `results`: `GradCheck` and `TensorVerdict`, as text, JSON and a table
"""
from .check import check_gradients
from .program import Evaluation, FunctionOracle, GradCheckError, Oracle
from .results import GradCheck, TensorVerdict

__all__ = ["check_gradients", "GradCheck", "TensorVerdict", "Oracle", "FunctionOracle", "Evaluation", "GradCheckError"]
