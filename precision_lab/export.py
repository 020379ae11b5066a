"""`precision-lab export`: a request bundle plus the float64 reference and its rounding bounds.

The output folder lets an external test suite judge its own program without the lab::

    OUT/request/     the request bundle (docs/design.md, "Exchange format"): feed it to your program
    OUT/reference/   bundle.json (kind "reference") and the float64 results, in the same weight
                     layout and array format as the request: loss, output, conv{k}.weight.grad,
                     conv{k}.bias.grad, and for each of them `<name>.bound`

and the check is element by element: |g − g_ref| ≤ bound. The bound is the error model's
(`precision_lab.errmodel`) for the request's precision plus its float64 bound, because the
reference carries its own float64 rounding (triangle inequality).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

# light imports only: `export --help` and argument errors answer before torch is imported
from . import options
from .errors import LabInputError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .compute import Trace
    from .problem import Problem

EXPORT_PRECISIONS = ("float32", "float64")
CHECK = "for every array X with X.bound: all(|X_yours - X| <= X.bound), elementwise, X in weight_layout"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default=None, help="image size N or HxW (default 1024, the seed scale, or the nearest "
                                                     "the network takes)")
    parser.add_argument("--batch", default="2", help="images per batch (default 2)")
    parser.add_argument("--seed", default="0", help="seed of the synthetic micrographs and weights (default 0)")
    parser.add_argument("--model", default=None,
                        help="model spec (JSON/YAML file, an exported .onnx, or 'seed', the default)")
    parser.add_argument("--layout", default="OIHW", help="weight layout of the bundle: a permutation of OIHW (default OIHW)")
    parser.add_argument("--raw", action="store_true", help="raw column-major .bin files instead of arrays.npz")
    parser.add_argument("--precision", default="float32", choices=EXPORT_PRECISIONS,
                        help="precision of the request and of the bounds (default float32)")
    parser.add_argument("--device", default="auto", help="where the float64 reference and its bounds are computed: "
                                                         "auto, cpu or cuda[:N] (default auto: the GPU when present)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist or be empty)")


def main(args: argparse.Namespace) -> int:
    # the numbers first: a typo is answered before the heavy stages are imported
    asked_size = options.size(args.size, "--size")
    batch = options.positive(args.batch, "--batch")
    seed = options.nonnegative(args.seed, "--seed")
    from . import resources
    from .device import resolve_device
    from .layout import check_layout
    from .model import ModelSpecError, load_model
    from .problem import make_problem

    try:
        check_layout(args.layout)
    except ValueError as exc:
        raise LabInputError(f"--layout: {exc}") from None
    try:
        network = load_model(args.model)
    except ModelSpecError as exc:
        raise LabInputError(f"--model: {exc}") from None
    size = asked_size or network.default_size(1024)
    device = resolve_device(args.device)
    try:
        network.check_size(*size)
    except ModelSpecError as exc:
        raise LabInputError(f"--size: {exc}") from None
    resources.check_fits(network, batch, size[0], size[1], device, "this export")  # before anything is allocated
    problem = make_problem(size, batch, seed, network=network)
    out = export(problem, args.out, args.precision, args.layout, args.raw, device)
    print(f"request bundle:   {out / 'request'}")
    print(f"reference+bounds: {out / 'reference'}  (check: {CHECK})")
    return 0


def export(problem: Problem, out: str | Path, precision: str = "float32", weight_layout: str = "OIHW",
           raw: bool = False, device: str | torch.device = "cpu") -> Path:
    """Write OUT/request and OUT/reference for `problem`; OUT must not exist or be empty.

    Everything is written to a temporary sibling folder first and renamed into place at the end,
    so an interrupted export leaves no half-written OUT.
    """
    from .bundle import write_bundle, write_request
    from .reference import reference

    out = Path(out)
    _refuse_existing(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write_request(problem, staging / "request", precision, weight_layout, raw)
        trace = reference(problem, device)
        write_bundle(staging / "reference", "reference", "float64", weight_layout,
                     reference_arrays(problem, trace, precision, weight_layout), raw, network=problem.network,
                     extra={"bound_precision": precision, "problem": problem.describe(), "check": CHECK,
                            "bound_source": "precision_lab.errmodel (docs/design.md, 'Error-accumulation model') at "
                                            f"{precision} plus its float64 bound for the reference's own rounding"})
        if out.exists():
            out.rmdir()  # empty (checked above): replaced by the finished export
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LabInputError(f"--out {out}: already exists and is not an empty folder; "
                            f"refusing to overwrite it (choose a new folder)")


def quantity_bounds(trace: Trace, precision: str) -> dict[str, np.ndarray]:
    """Per-element bounds at `precision`: loss, output and every parameter gradient."""
    from . import errmodel

    return {name: bound.bound for name, bound in errmodel.error_bounds(trace, precision).items()}


def reference_arrays(problem: Problem, trace: Trace, precision: str, weight_layout: str) -> dict[str, np.ndarray]:
    """Reference results and their bounds, named and laid out as a response would be."""
    import numpy as np

    from .layout import to_layout

    claimed, own = quantity_bounds(trace, precision), quantity_bounds(trace, "float64")
    values = {"loss": np.asarray(trace.loss, np.float64), "output": np.asarray(trace.output, np.float64)}
    values.update({f"{name}.grad": np.asarray(trace.grads[name], np.float64) for name in problem.network.parameter_names})
    arrays = {}
    for name, value in values.items():
        arrays[name] = value
        quantity = name.removesuffix(".grad")
        if quantity in claimed:
            arrays[f"{name}.bound"] = np.asarray(claimed[quantity] + own[quantity], np.float64).reshape(value.shape)
    for name in problem.network.weight_names:
        for key in (f"{name}.grad", f"{name}.grad.bound"):
            arrays[key] = to_layout(arrays[key], weight_layout)
    return arrays


__all__ = ["configure", "export", "main", "quantity_bounds", "reference_arrays"]
