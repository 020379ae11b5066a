"""The doctors: what explains a quantity beyond its bound (docs/design.md, "Explaining a verdict").

Each reads the verdicts so far (the comparisons of precision_lab.compare with the findings before it
applied, a copy) and the float64 reference, and returns `Finding`s (precision_lab.findings): what it
found about which quantity, with the numbers. None edits a judgement; `verdict.decide_problem` makes
the verdict from the comparisons and every finding, by precedence.

* `layouts` — the layout doctor, by buffer: a gradient read as the candidate wrote it (its
  declared layout's shape, C or F order) is tried in every layout it could hold, with every flip
  of H and W; the fix is named in words a Fortran or CUDA programmer can apply.
* `precision` — a coarser format: beyond the claimed bound, the format whose emulated error level
  matches the forward output's; inside it, the precision fingerprint: the correlation of the
  candidate's error with each format's emulated error, per quantity and pass, against the same
  correlation of legitimate float32 orders (the measured null).
* `zero_gradients` — a parameter gradient identically zero where the reference is not: the layer
  received no gradient (left off the tape, not marked trainable), named before any bound is read;
* `defects` — named hypotheses recomputed in float64 and tested against the bound: a constant
  factor, a flatten in (H, W, C) order where the spec flattens (C, H, W), one sample of the batch
  only, a one-pixel shift, a missing activation mask, a pre-activation used for a post-activation, another layer's mask or gradient, stale weights, a
  missing image row, column or tile. The overall cause is a hypothesis that explains every failing
  quantity, never the one that explains most: otherwise the cause is unknown.
* `localise` — with intermediates in the response, each op re-run in float64 on the candidate's
  own inputs against its local bound, the first that fails named; else the earliest failing
  quantity in backprop order.
"""
from __future__ import annotations

from .budget import RECOMPUTE_LIMIT
from .defects import defects, zero_gradients
from .formats import FALLBACK_FORMATS, FINGERPRINT_MIN, FORMAT_MATCH_FACTOR, emulate, name_format, precision
from .layout import layout_fits, layouts, read_buffer, transform_name, transform_parts, transforms
from .localise import localise

__all__ = ["FALLBACK_FORMATS", "FINGERPRINT_MIN", "FORMAT_MATCH_FACTOR", "RECOMPUTE_LIMIT", "defects", "emulate",
           "layout_fits", "layouts", "localise", "name_format", "precision", "read_buffer", "transform_name",
           "transform_parts", "transforms", "zero_gradients"]
