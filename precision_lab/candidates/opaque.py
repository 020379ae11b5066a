"""Opaque command candidates: a program that answers loss and gradients of a network the lab has no
model of (docs/external.md §5).

The candidate YAML is a command candidate with ``model: opaque`` and ``start: DIR``::

    name: my-kan
    model: opaque
    start: start/                       # the start bundle (relative to this file)
    command: ["{python}", kan.py, "{request}", "{response}"]
    command_float64: ["{python}", kan.py, "{request}", "{response}"]   # optional
    precision: float32
    timeout_s: 60

The start bundle is a request bundle whose model is ``{"opaque": true, "parameters": [...]}``
and whose arrays are everything the program reads (npz, or raw binaries in C or F order; any
shapes, any number of parameter tensors). The lab sends copies with the listed parameters
perturbed, in the same format (float arrays in the build's dtype), and reads back ``loss`` and
``<param>.grad`` for each listed parameter. Everything else about a call (no shell, temporary
folder, timeout, environment, placeholders) is the command protocol's (`command.py`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import formats
from ..bundle import (FORMAT, MANIFEST, NPZ, BundleError, array_entries, check_memory, expect_field, load_arrays,
                      load_manifest, manifest_text, write_raw_array)
from ..gradcheck import Evaluation, GradCheck, check_gradients
from ..gradcheck.program import check_evaluation, exact_cast, storage_dtype
from ..layout import check_layout
from . import Candidate, CandidateError
from .command import CommandCandidateError, CommandProgram, _argv, _choice, _extra_env, _timeout, _worker

#: keys of an opaque model object in bundle.json
MODEL_KEYS = ("opaque", "parameters", "description")
#: YAML keys an opaque candidate accepts (weight_layout has no meaning without a model, but is allowed)
YAML_KEYS = ("name", "description", "model", "start", "command", "command_float64", "precision", "timeout_s",
             "request_format", "env", "weight_layout", "worker")


@dataclass
class StartBundle:
    """The start bundle: the arrays every request carries, which of them are parameters, its format."""

    path: Path
    manifest: dict
    arrays: dict[str, np.ndarray]  # values as the lab sends them: floats rounded to the claimed storage
    parameters: list[str]
    raw: dict[str, dict] | None  # raw binaries: name → {"file", "order"}; None for arrays.npz
    rounded: list[str] = field(default_factory=list)  # float64 arrays the claimed build cannot hold exactly

    def parameter_values(self) -> dict[str, np.ndarray]:
        return {name: self.arrays[name].astype(np.float64) for name in self.parameters}


def read_start_bundle(directory: str | Path, claimed_precision: str) -> StartBundle:
    """Read and check a start bundle; float arrays are rounded to the claimed build's storage dtype
    (both builds then compute on exactly the same values: the float64 requests hold them cast)."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise BundleError(f"{directory}: no such start bundle directory (expected a folder with {MANIFEST} and "
                          f"{NPZ} or raw binaries)")
    manifest = load_manifest(manifest_path, f"a start bundle is a folder with {MANIFEST} and {NPZ} or raw binaries")
    expect_field(manifest_path, manifest, "format", FORMAT)
    if manifest.get("kind") != "request":
        raise BundleError(f"{manifest_path}: key 'kind' is {manifest.get('kind')!r}, expected 'request' "
                          f"(a start bundle is the request the lab copies and perturbs)")
    if manifest.get("precision") not in formats.PRECISIONS:
        raise BundleError(f"{manifest_path}: key 'precision' is {manifest.get('precision')!r}, expected one of "
                          f"{', '.join(formats.PRECISIONS)}")
    if "weight_layout" in manifest:
        try:
            check_layout(manifest["weight_layout"])
        except ValueError as exc:
            raise BundleError(f"{manifest_path}: key 'weight_layout': {exc} (or leave it out: an opaque model has none)") from None
    parameters = _parameters(manifest_path, manifest.get("model"))
    entries = array_entries(directory, manifest)
    if not entries:
        raise BundleError(f"{manifest_path}: the bundle holds no arrays (expected the parameters "
                          f"{', '.join(parameters)} and whatever else the program reads)")
    for name in parameters:
        if name not in entries:
            raise BundleError(f"{manifest_path}: parameter {name!r} (listed in model.parameters) is not among the "
                              f"arrays ({', '.join(sorted(entries))})")
        entry = entries[name]
        if entry.dtype.kind != "f":
            raise BundleError(f"{entry.file}: parameter {name!r} has dtype {entry.dtype}; parameters must be "
                              f"float32 or float64 (the lab perturbs them)")
        if math.prod(entry.shape) == 0:
            raise BundleError(f"{entry.file}: parameter {name!r} has shape {entry.shape} with no elements")
        if name.endswith(".grad") or name == "loss":
            raise BundleError(f"{manifest_path}: parameter {name!r}: the names 'loss' and '*.grad' belong to the "
                              f"response; rename the parameter")
    for name, entry in entries.items():
        if entry.dtype.kind not in "fiub":
            raise BundleError(f"{entry.file}: array {name!r} has dtype {entry.dtype}; expected numbers "
                              f"(float, integer or boolean)")
    check_memory(directory, entries)
    arrays = load_arrays(directory, entries, list(entries))
    claimed_storage = np.dtype(formats.STORAGE_DTYPE[claimed_precision])
    rounded = []
    for name, value in arrays.items():
        if value.dtype.kind == "f" and value.dtype != claimed_storage:
            cast = value.astype(claimed_storage)
            if not np.array_equal(cast.astype(value.dtype), value):
                rounded.append(name)
            if not np.all(np.isfinite(cast)):
                raise BundleError(f"{entries[name].file}: {name!r} overflows {claimed_storage} (the claimed "
                                  f"{claimed_precision} build's storage)")
            arrays[name] = cast
    raw = None
    if "arrays" in manifest:
        raw = {name: {"file": spec["file"], "order": spec.get("order", "C")} for name, spec in manifest["arrays"].items()}
    return StartBundle(directory, manifest, arrays, parameters, raw, rounded)


def _parameters(manifest_path: Path, model) -> list[str]:
    example = '{"opaque": true, "parameters": ["rbf.centers", "head.weight"]}'
    if not isinstance(model, dict) or model.get("opaque") is not True:
        raise BundleError(f"{manifest_path}: key 'model' is {json.dumps(model)}; an opaque start bundle needs "
                          f"{example}")
    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise BundleError(f"{manifest_path}: key 'model.{unknown[0]}' is not part of an opaque model "
                          f"(expected keys {', '.join(MODEL_KEYS)})")
    parameters = model.get("parameters")
    if (not isinstance(parameters, list) or not parameters
            or not all(isinstance(p, str) and p.strip() for p in parameters)):
        raise BundleError(f"{manifest_path}: key 'model.parameters' must be a non-empty list of array names, "
                          f"e.g. {example}")
    duplicates = sorted({p for p in parameters if parameters.count(p) > 1})
    if duplicates:
        raise BundleError(f"{manifest_path}: key 'model.parameters' lists {duplicates[0]!r} twice")
    return list(parameters)


# ---------------------------------------------------------------------------------------------
# calling the program


class OpaqueProgram:
    """The oracle the gradient check asks: writes a perturbed copy of the start bundle, runs the
    command (through CommandProgram: no shell, timeout, environment), reads loss and gradients."""

    def __init__(self, program: CommandProgram, start: StartBundle, claimed_precision: str, raw_override: bool | None):
        self.program, self.start = program, start
        self.name, self.claimed_precision = program.name, claimed_precision
        self.has_float64 = program.commands["float64"] is not None
        self.raw_override = raw_override
        self.shapes = {name: start.arrays[name].shape for name in start.parameters}

    def evaluate(self, build: str, params: dict[str, np.ndarray]) -> Evaluation:
        dtype = storage_dtype(build, self.claimed_precision)
        exchange = "float64" if build == "float64" else self.claimed_precision
        key = "float64" if build == "float64" else "float32"
        with tempfile.TemporaryDirectory(prefix="precision-lab-opaque-") as tmp:
            workdir = Path(tmp)
            request, response = workdir / "request", workdir / "response"
            self.write_request(request, exchange, dtype, params)
            response.mkdir()
            wall_s, _ = self.program.exchange(key, workdir, request, response, exchange)
            where = f"candidate {self.name} ({self.program.yaml_path}): {build} build"
            try:
                evaluation = read_response(response, exchange, dtype, self.shapes)
            except BundleError as exc:
                raise CommandCandidateError(f"{where}: bad response: "
                                            f"{str(exc).replace(str(workdir) + os.sep, '')}") from None
        evaluation.wall_s = wall_s
        return check_evaluation(where, evaluation, self.shapes)

    def write_request(self, directory: Path, exchange: str, dtype: np.dtype, params: dict[str, np.ndarray]) -> None:
        """The start bundle with `params` in place, floats in the build's dtype, in the start's format."""
        directory.mkdir(parents=True)
        arrays = {}
        for name, value in self.start.arrays.items():
            value = params[name] if name in params else value
            arrays[name] = exact_cast(value, dtype, name) if value.dtype.kind == "f" else value
        manifest = {key: value for key, value in self.start.manifest.items() if key != "arrays"}
        manifest["precision"] = exchange
        raw = self.start.raw is not None if self.raw_override is None else self.raw_override
        if raw:
            specs = self.start.raw or {}
            manifest["arrays"] = {name: write_raw_array(directory, name, value, specs.get(name, {}).get("order", "F"),
                                                        specs.get(name, {}).get("file"))
                                  for name, value in arrays.items()}
        else:
            np.savez(directory / NPZ, **{name: np.ascontiguousarray(value) for name, value in arrays.items()})
        (directory / MANIFEST).write_text(manifest_text(manifest))


def read_response(directory: Path, exchange: str, dtype: np.dtype, shapes: dict[str, tuple[int, ...]]) -> Evaluation:
    """`loss` (shape ()) and `<param>.grad` for every parameter, in the request's dtype, all finite."""
    manifest_path = directory / MANIFEST
    manifest = load_manifest(manifest_path, "the program must write bundle.json and its arrays there")
    for key, expected in (("format", FORMAT), ("kind", "response"), ("precision", exchange)):
        if manifest.get(key) != expected:
            raise BundleError(f"{manifest_path}: key {key!r} is {manifest.get(key)!r}, expected {expected!r}"
                              + (" as in the request" if key == "precision" else ""))
    entries = array_entries(directory, manifest)
    expected = {"loss": (), **{f"{name}.grad": shape for name, shape in shapes.items()}}
    for name, shape in expected.items():
        if name not in entries:
            raise BundleError(f"{manifest_path}: the response has no {name!r} (expected shape {shape} {dtype})")
        entry = entries[name]
        if entry.shape != tuple(shape):
            raise BundleError(f"{entry.file}: {name!r} has shape {entry.shape}, expected {tuple(shape)}"
                              + (f" (the shape of parameter {name[:-5]!r})" if name != "loss" else ""))
        if entry.dtype.newbyteorder("=") != dtype:
            raise BundleError(f"{entry.file}: {name!r} has dtype {entry.dtype}, expected {dtype} "
                              f"(precision {exchange} exchanges {dtype})")
    check_memory(directory, {name: entries[name] for name in expected})
    arrays = load_arrays(directory, entries, list(expected))
    return Evaluation(float(arrays["loss"]), {name: arrays[f"{name}.grad"].astype(np.float64) for name in shapes})


# ---------------------------------------------------------------------------------------------
# the candidate


@dataclass
class OpaqueCandidate(Candidate):
    """A command candidate with `model: opaque`: judged by the reference-free gradient check only."""

    start: StartBundle | None = None
    program: OpaqueProgram | None = None

    def check(self, seed: int = 0, max_calls: int | None = None, progress: bool = False) -> GradCheck:
        """Run the reference-free gradient check on this program at its start bundle's parameters."""
        self.program.program.allow_calls()
        try:
            return check_gradients(self.program, self.start.parameter_values(), seed=seed, max_calls=max_calls,
                                   progress=progress)
        except BaseException:
            self.program.program.cancel()  # Ctrl-C or a failed call: no worker is left running
            raise
        finally:
            self.program.program.close()


def load_opaque_candidate(path: Path, spec: dict) -> OpaqueCandidate:
    """An OpaqueCandidate from a command YAML with `model: opaque` (every key checked here)."""
    unknown = sorted(set(map(str, spec)) - set(YAML_KEYS))
    if unknown:
        raise CommandCandidateError(f"{path}: unknown key {unknown[0]!r} for an opaque candidate: expected keys among "
                                    f"{', '.join(YAML_KEYS)}")
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise CommandCandidateError(f"{path}: key 'name' must be a non-empty string")
    precision = _choice(path, spec, "precision", "float32", formats.PRECISIONS)
    start_value = spec.get("start")
    if not isinstance(start_value, str) or not start_value:
        raise CommandCandidateError(f"{path}: key 'start' must name the start bundle folder (model: opaque needs one), "
                                    f"e.g. start: start/")
    start_dir = Path(start_value) if Path(start_value).is_absolute() else path.parent / start_value
    if "weight_layout" in spec:
        try:
            check_layout(spec["weight_layout"])
        except ValueError as exc:
            raise CommandCandidateError(f"{path}: key 'weight_layout': {exc}") from None
    start = read_start_bundle(start_dir, precision)
    request_format = spec.get("request_format")
    raw = None if request_format is None else _choice(path, spec, "request_format", "npz", ("npz", "raw")) == "raw"
    program = CommandProgram(
        yaml_path=path, name=name, claimed=precision, weight_layout=spec.get("weight_layout", "OIHW"),
        commands={"float32": _argv(path, spec, "command"), "float64": _argv(path, spec, "command_float64")},
        timeout_s=_timeout(path, spec), raw=bool(raw), env=_extra_env(path, spec), worker=_worker(path, spec))
    for key in ("command", "command_float64"):  # resolve the program now: a missing one is bad input, before any call
        if program.commands["float32" if key == "command" else "float64"] is not None:
            program.argv(program.commands["float32" if key == "command" else "float64"], start_dir, start_dir, key)
    oracle = OpaqueProgram(program, start, precision, raw)
    description = spec.get("description") or f"opaque program {' '.join(program.commands['float32'])}"
    return OpaqueCandidate(name=name, description=str(description), run=_not_a_model(name, path),
                           claimed_precision=precision, weight_layout="", family="command",
                           has_float64=oracle.has_float64, meta={"yaml": str(path), "opaque": True,
                                                                 "start": str(start_dir)},
                           start=start, program=oracle)


def _not_a_model(name: str, path: Path):
    def run(problem, precision, device):
        raise CandidateError(f"candidate {name} ({path}) is opaque (model: opaque): the model-based experiments "
                             f"cannot run it; judge it with `precision-lab diagnose --candidate {path}` or notebook 06")

    return run


# ---------------------------------------------------------------------------------------------
# `precision-lab diagnose --candidate OPAQUE.yaml`


def run_diagnose(candidate: OpaqueCandidate, args: argparse.Namespace) -> GradCheck:
    """Check the candidate and print the verdict; precision_lab.diagnosis.main writes --json and exits."""
    ignored = [f"--{flag}" for flag in ("size", "batch") if getattr(args, flag, None) is not None]
    if ignored:
        print(f"note: {candidate.name} is opaque: its start bundle fixes the problem; {', '.join(ignored)} ignored",
              file=sys.stderr)
    if candidate.start.rounded:
        print(f"note: {', '.join(candidate.start.rounded)} rounded to {formats.STORAGE_DTYPE[candidate.claimed_precision]} "
              f"(both builds get the values the {candidate.claimed_precision} build can hold)", file=sys.stderr)
    from ..options import nonnegative

    # the command line hands the seed over as text: numpy's SeedSequence needs an integer
    seed = nonnegative(getattr(args, "seed", None), "--seed") or 0
    result = candidate.check(seed=seed, max_calls=getattr(args, "max_calls", None), progress=True)
    print(result.to_text())
    return result
