"""The exchange format (DESIGN.md, "Exchange format"): request, response and static bundles.

A bundle is a directory holding `bundle.json` and either `arrays.npz` (C order, loaded with
``allow_pickle=False``) or raw binaries listed in `bundle.json` under ``"arrays"``
(``{"name": {"file", "dtype", "shape", "order"}}``; little-endian; ``order`` "C" or "F",
"C" when absent). Everything read is validated *before* it is allocated: names, shapes,
dtypes, file sizes and the memory the arrays would take; then every value must be finite.
Every error is one line naming the file, the key and what was expected (`BundleError`).
"""
from __future__ import annotations

import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import formats
from .candidates import Candidate, CandidateError
from .errors import LabInputError
from .layout import check_layout, from_layout, shape_in_layout, to_layout
from .problem import CHANNELS, KERNEL_SIZE, PADDING, PARAM_NAMES, WEIGHT_NAMES, Problem, Result, param_shape

FORMAT = "precision-lab/bundle-1"
MODEL = {"channels": list(CHANNELS), "kernel_size": KERNEL_SIZE, "padding": PADDING,
         "activation": "relu", "loss": "mse"}
KINDS = ("request", "response", "static")
MANIFEST = "bundle.json"
NPZ = "arrays.npz"
GRAD_NAMES = tuple(f"{name}.grad" for name in PARAM_NAMES)
RAW_DTYPES = ("float32", "float64")
#: a bundle may take at most this share of the memory available now: the lab still needs room
#: for the float64 reference (twice the float32 bytes) and its intermediates
MEMORY_SHARE = 0.25


class BundleError(LabInputError):
    """A bundle that does not follow the exchange format: the message names file, key and expectation."""


@dataclass
class Bundle:
    """A bundle as read: its manifest fields and its arrays (logical shapes, C-contiguous)."""

    path: Path
    kind: str
    precision: str
    weight_layout: str
    arrays: dict[str, np.ndarray]
    manifest: dict = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.arrays["input"].shape)


# ---------------------------------------------------------------------------------------------
# writing


def write_bundle(directory: str | Path, kind: str, precision: str, weight_layout: str,
                 arrays: dict[str, np.ndarray], raw: bool = False, extra: dict | None = None) -> Path:
    """Write `arrays` (already in their exchange shapes and dtypes) as a bundle; returns the directory.

    With `raw`, each array goes to `<name>.bin` in Fortran (column-major) order, listed in
    bundle.json, for programs that read binaries directly; otherwise to arrays.npz (C order).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "kind": kind, "model": MODEL, "precision": precision,
                "weight_layout": weight_layout, **(extra or {})}
    if raw:
        manifest["arrays"] = {name: write_raw_array(directory, name, value) for name, value in arrays.items()}
    else:
        np.savez(directory / NPZ, **{name: np.array(value, order="C") for name, value in arrays.items()})
    (directory / MANIFEST).write_text(manifest_text(manifest))
    return directory


def write_raw_array(directory: Path, name: str, value: np.ndarray, order: str = "F", file: str | None = None) -> dict:
    """Write one array as a little-endian raw binary in `order`; returns its bundle.json entry."""
    value = np.asarray(value)
    file = file or f"{name}.bin"
    # ravel(order="F") writes column-major bytes: a Fortran program declares the same shape
    value.ravel(order=order).astype(value.dtype.newbyteorder("<"), copy=False).tofile(Path(directory) / file)
    return {"file": file, "dtype": value.dtype.name, "shape": list(value.shape), "order": order}


def manifest_text(manifest: dict) -> str:
    """bundle.json text: one line per key and per raw array, lists on one line (easy to scan from Fortran)."""
    lines = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in manifest.items() if key != "arrays"]
    if "arrays" in manifest:
        entries = [f"  {json.dumps(name)}: {json.dumps(spec)}" for name, spec in manifest["arrays"].items()]
        lines.append(' "arrays": {\n' + ",\n".join(entries) + "}")
    return "{\n" + ",\n".join(lines) + "}\n"


def request_arrays(problem: Problem, precision: str, weight_layout: str) -> dict[str, np.ndarray]:
    """The request arrays of `problem`: float32 values cast exactly to the precision's storage dtype."""
    dtype = _storage_dtype(precision, "precision")
    check_layout(weight_layout)
    arrays = {"input": problem.input.astype(dtype), "target": problem.target.astype(dtype)}
    for name in PARAM_NAMES:
        value = problem.params[name].astype(dtype)
        arrays[name] = to_layout(value, weight_layout) if name in WEIGHT_NAMES else value
    return arrays


def response_arrays(result: Result, precision: str, weight_layout: str) -> dict[str, np.ndarray]:
    """The response arrays of a Result (gradients in OIHW) in the exchange layout and dtype."""
    dtype = _storage_dtype(precision, "precision")
    arrays = {"loss": np.asarray(result.loss, dtype)}
    for name in PARAM_NAMES:
        grad = np.asarray(result.grads[name], dtype)
        arrays[f"{name}.grad"] = to_layout(grad, weight_layout) if name in WEIGHT_NAMES else grad
    if result.output is not None:
        arrays["output"] = np.asarray(result.output, dtype)
    return arrays


def write_request(problem: Problem, directory: str | Path, precision: str = "float32",
                  weight_layout: str = "OIHW", raw: bool = False) -> Path:
    """Write the request bundle a candidate reads: the problem in its layout and precision."""
    return write_bundle(directory, "request", precision, weight_layout,
                        request_arrays(problem, precision, weight_layout), raw)


def write_response(result: Result, directory: str | Path, precision: str = "float32",
                   weight_layout: str = "OIHW", raw: bool = False) -> Path:
    """Write a response bundle (what a candidate writes) from a Result with OIHW gradients."""
    return write_bundle(directory, "response", precision, weight_layout,
                        response_arrays(result, precision, weight_layout), raw)


def write_static(problem: Problem, result: Result, directory: str | Path, precision: str = "float32",
                 weight_layout: str = "OIHW", raw: bool = False) -> Path:
    """Write a static bundle: the request arrays and the response arrays together."""
    arrays = {**request_arrays(problem, precision, weight_layout), **response_arrays(result, precision, weight_layout)}
    return write_bundle(directory, "static", precision, weight_layout, arrays, raw)


# ---------------------------------------------------------------------------------------------
# reading: manifest


def _storage_dtype(precision, where: str) -> str:
    if precision not in formats.STORAGE_DTYPE:
        raise BundleError(f"{where}: unknown precision {precision!r}: expected one of {', '.join(formats.PRECISIONS)}")
    return formats.STORAGE_DTYPE[precision]


def read_manifest(directory: str | Path, kinds: tuple[str, ...] = KINDS) -> dict:
    """bundle.json of `directory`, checked field by field against the exchange format."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise BundleError(f"{directory}: no such bundle directory (expected a folder with {MANIFEST})")
    if not path.is_file():
        raise BundleError(f"{path}: missing (a bundle is a folder with {MANIFEST} and {NPZ} or raw binaries)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    _expect_field(path, manifest, "format", FORMAT)
    if manifest.get("kind") not in kinds:
        raise BundleError(f"{path}: key 'kind' is {manifest.get('kind')!r}, expected {' or '.join(map(repr, kinds))}")
    if manifest["kind"] in ("request", "static"):
        _check_model(path, manifest.get("model"))
    _storage_dtype(manifest.get("precision"), f"{path}: key 'precision'")
    try:
        check_layout(manifest.get("weight_layout"))
    except ValueError as exc:
        raise BundleError(f"{path}: key 'weight_layout': {exc}") from None
    return manifest


def _expect_field(path: Path, manifest: dict, key: str, expected) -> None:
    if manifest.get(key) != expected:
        raise BundleError(f"{path}: key {key!r} is {manifest.get(key)!r}, expected {expected!r}")


def _check_model(path: Path, model) -> None:
    if not isinstance(model, dict):
        raise BundleError(f"{path}: key 'model' missing or not an object (expected {json.dumps(MODEL)})")
    for key, expected in MODEL.items():
        if model.get(key) != expected:
            raise BundleError(f"{path}: key 'model.{key}' is {model.get(key)!r}: this lab judges the seed "
                              f"network only (expected {expected!r})")


# ---------------------------------------------------------------------------------------------
# reading: array headers (shape and dtype before any data is read)


@dataclass(frozen=True)
class ArrayEntry:
    """One array as declared: where it lives, its logical shape and dtype, how to read it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    order: str = "C"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _npz_entries(path: Path) -> dict[str, ArrayEntry]:
    """Headers of every .npy member of an .npz, read without loading data; pickles refused."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = {}
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[:-4]
                with archive.open(info) as member:
                    shape, fortran, dtype = _npy_header(member)
                if dtype.hasobject:
                    raise BundleError(f"{path}: array {name!r} holds Python objects (a pickle); "
                                      f"expected float32 or float64 numbers (arrays load with allow_pickle=False)")
                entries[name] = ArrayEntry(name, path, shape, dtype, "F" if fortran else "C")
            return entries
    except zipfile.BadZipFile:
        raise BundleError(f"{path}: not a valid .npz (zip) file (write it with numpy.savez)") from None


def _npy_header(member) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    return np.lib.format.read_array_header_2_0(member)


def _raw_entries(directory: Path, manifest_path: Path, declared) -> dict[str, ArrayEntry]:
    """The "arrays" map of bundle.json, each entry checked against its file's size."""
    if not isinstance(declared, dict):
        raise BundleError(f"{manifest_path}: key 'arrays' must map names to {{file, dtype, shape, order}}")
    entries = {}
    for name, spec in declared.items():
        key = f"arrays.{name}"
        if not isinstance(spec, dict):
            raise BundleError(f"{manifest_path}: key {key!r} must be an object with file, dtype, shape, order")
        file = _raw_file(directory, manifest_path, key, spec.get("file"))
        if spec.get("dtype") not in RAW_DTYPES:
            raise BundleError(f"{manifest_path}: key '{key}.dtype' is {spec.get('dtype')!r}, expected one of {RAW_DTYPES}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BundleError(f"{manifest_path}: key '{key}.shape' is {shape!r}, expected a list of non-negative integers")
        order = spec.get("order", "C")
        if order not in ("C", "F"):
            raise BundleError(f"{manifest_path}: key '{key}.order' is {order!r}, expected \"C\" or \"F\"")
        entry = ArrayEntry(name, file, tuple(shape), np.dtype(spec["dtype"]).newbyteorder("<"), order)
        size = file.stat().st_size
        if size != entry.nbytes:
            raise BundleError(f"{file}: holds {size} bytes but '{key}' declares shape {tuple(shape)} "
                              f"{spec['dtype']}, which needs {entry.nbytes} bytes")
        entries[name] = entry
    return entries


def _raw_file(directory: Path, manifest_path: Path, key: str, file) -> Path:
    if not isinstance(file, str) or not file:
        raise BundleError(f"{manifest_path}: key '{key}.file' must name a file in the bundle folder")
    path = (directory / file).resolve()
    if not path.is_relative_to(directory.resolve()):
        raise BundleError(f"{manifest_path}: key '{key}.file' is {file!r}: files must lie inside the bundle folder")
    if not path.is_file():
        raise BundleError(f"{manifest_path}: key '{key}.file': {path} does not exist")
    return path


def array_entries(directory: Path, manifest: dict) -> dict[str, ArrayEntry]:
    """Declared arrays of a bundle, from arrays.npz or from bundle.json's raw "arrays" map."""
    manifest_path = directory / MANIFEST
    npz = directory / NPZ
    if "arrays" in manifest:
        if npz.exists():
            raise BundleError(f"{manifest_path}: key 'arrays' lists raw binaries but {npz} exists too: keep one of them")
        return _raw_entries(directory, manifest_path, manifest["arrays"])
    if not npz.is_file():
        raise BundleError(f"{npz}: missing (or list raw binaries under key 'arrays' of {manifest_path})")
    return _npz_entries(npz)


# ---------------------------------------------------------------------------------------------
# reading: expectations


def expected_shapes(kind: str, weight_layout: str, input_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Required arrays of a bundle kind and their shapes, given the input's (N, 1, H, W)."""
    batch, _, height, width = input_shape
    request = {"input": input_shape, "target": (batch, CHANNELS[-1], height, width)}
    response = {"loss": ()}
    for name in PARAM_NAMES:
        shape = param_shape(name)
        shape = shape_in_layout(shape, weight_layout) if name in WEIGHT_NAMES else shape
        request[name] = shape
        response[f"{name}.grad"] = shape
    return {"request": request, "response": response, "static": {**request, **response}}[kind]


def _describe_expected(name: str, shape: tuple[int, ...], weight_layout: str) -> str:
    in_layout = f" in layout {weight_layout}" if ".weight" in name else ""
    return f"expected shape {shape}{in_layout}"


def _input_shape(where: Path, entries: dict[str, ArrayEntry]) -> tuple[int, ...]:
    if "input" not in entries:
        raise BundleError(f"{where} has no 'input' (expected shape (N, 1, H, W))")
    shape = entries["input"].shape
    if len(shape) != 4 or shape[1] != CHANNELS[0] or min(shape) < 1:
        raise BundleError(f"{where}: 'input' has shape {shape}, expected (N, {CHANNELS[0]}, H, W) with N, H, W ≥ 1")
    return shape


def check_entries(where: Path, entries: dict[str, ArrayEntry], kind: str, precision: str,
                  weight_layout: str, input_shape: tuple[int, ...]) -> None:
    """Every required array present with its shape and the precision's dtype; the output optional."""
    dtype = np.dtype(formats.STORAGE_DTYPE[precision])
    expected = expected_shapes(kind, weight_layout, input_shape)
    if kind != "request":
        expected_output = (input_shape[0], CHANNELS[-1], *input_shape[2:])
    for name, shape in expected.items():
        if name not in entries:
            raise BundleError(f"{where} has no {name!r} ({_describe_expected(name, shape, weight_layout)})")
        _check_entry(where, entries[name], shape, dtype, precision, weight_layout)
    if kind != "request" and "output" in entries:
        _check_entry(where, entries["output"], expected_output, dtype, precision, weight_layout)


def _check_entry(where: Path, entry: ArrayEntry, shape: tuple[int, ...], dtype: np.dtype,
                 precision: str, weight_layout: str) -> None:
    if entry.shape != shape:
        raise BundleError(f"{where}: {entry.name!r} has shape {entry.shape}, "
                          f"{_describe_expected(entry.name, shape, weight_layout)}")
    if entry.dtype.newbyteorder("=") != dtype:
        raise BundleError(f"{where}: {entry.name!r} has dtype {entry.dtype}, expected {dtype} "
                          f"(precision {precision} exchanges {dtype})")


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable, else free physical pages), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(where: Path, entries: dict[str, ArrayEntry]) -> None:
    """Refuse arrays whose declared size would not fit in memory, before allocating any."""
    total = sum(entry.nbytes for entry in entries.values())
    available = available_memory()
    if available is not None and total > MEMORY_SHARE * available:
        largest = max(entries.values(), key=lambda entry: entry.nbytes)
        raise BundleError(f"{where}: arrays declare {total / 2**30:.3g} GiB (largest {largest.name!r} with shape "
                          f"{largest.shape}); refusing more than {MEMORY_SHARE:.0%} of the "
                          f"{available / 2**30:.3g} GiB of memory available")


# ---------------------------------------------------------------------------------------------
# reading: data


def _load(entry: ArrayEntry, npz_file) -> np.ndarray:
    try:
        if npz_file is not None:
            value = npz_file[entry.name]
        else:
            value = np.fromfile(entry.file, dtype=entry.dtype, count=math.prod(entry.shape))
            value = value.reshape(entry.shape, order=entry.order)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BundleError(f"{entry.file}: cannot read array {entry.name!r} ({exc})") from None
    return np.array(value, dtype=entry.dtype.newbyteorder("="), order="C")


def _check_finite(entry: ArrayEntry, value: np.ndarray) -> None:
    bad = ~np.isfinite(value)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0]) if value.ndim else ()
        raise BundleError(f"{entry.file}: {entry.name!r} holds {int(bad.sum())} NaN or infinite values "
                          f"(first at index {first}); expected finite numbers")


def load_arrays(directory: Path, entries: dict[str, ArrayEntry], names) -> dict[str, np.ndarray]:
    """Load the named arrays (already validated), each checked for non-finite values."""
    npz = directory / NPZ
    npz_file = np.load(npz, allow_pickle=False) if any(entries[n].file == npz for n in names) else None
    try:
        arrays = {}
        for name in names:
            arrays[name] = _load(entries[name], npz_file if entries[name].file == npz else None)
            _check_finite(entries[name], arrays[name])
        return arrays
    finally:
        if npz_file is not None:
            npz_file.close()


def read_bundle(directory: str | Path, kinds: tuple[str, ...] = KINDS,
                input_shape: tuple[int, ...] | None = None) -> Bundle:
    """Read and validate a bundle; `input_shape` (a response's request) fixes the expected shapes."""
    directory = Path(directory)
    manifest = read_manifest(directory, kinds)
    kind, precision, weight_layout = manifest["kind"], manifest["precision"], manifest["weight_layout"]
    entries = array_entries(directory, manifest)
    where = next(iter(entries.values())).file if entries and "arrays" not in manifest else directory / MANIFEST
    if kind == "response" and input_shape is None:
        raise BundleError(f"{directory}: a response bundle is read against its request (give input_shape)")
    if kind != "response":
        input_shape = _input_shape(where, entries)
    check_entries(where, entries, kind, precision, weight_layout, input_shape)
    names = list(expected_shapes(kind, weight_layout, input_shape))
    names += ["output"] if kind != "request" and "output" in entries else []
    check_memory(where, {name: entries[name] for name in names})
    arrays = load_arrays(directory, entries, names)
    return Bundle(directory, kind, precision, weight_layout, arrays, manifest)


def read_response(directory: str | Path, precision: str, weight_layout: str,
                  input_shape: tuple[int, ...]) -> Bundle:
    """Read a candidate's response to a request with this precision, layout and input shape."""
    manifest = read_manifest(directory, ("response",))
    for key, expected in (("precision", precision), ("weight_layout", weight_layout)):
        if manifest[key] != expected:
            raise BundleError(f"{Path(directory) / MANIFEST}: key {key!r} is {manifest[key]!r}, "
                              f"expected {expected!r} as in the request")
    return read_bundle(directory, ("response",), input_shape)


# ---------------------------------------------------------------------------------------------
# bundles as the lab's objects


def problem_from_bundle(bundle: Bundle) -> Problem:
    """The Problem a request or static bundle describes (float32 values, OIHW weights).

    The reference starts from float32 values (DESIGN.md), so float64 arrays must hold exactly
    float32-representable numbers; anything else is refused rather than silently rounded.
    """
    arrays = {}
    for name in ("input", "target", *PARAM_NAMES):
        value = bundle.arrays[name]
        as_float32 = value.astype(np.float32)
        if value.dtype != np.float32 and not np.array_equal(as_float32.astype(value.dtype), value):
            raise BundleError(f"{bundle.path}: {name!r} holds float64 values that float32 cannot represent "
                              f"exactly; the lab's reference starts from float32 values (cast them first)")
        arrays[name] = from_layout(as_float32, bundle.weight_layout) if name in WEIGHT_NAMES else as_float32
    params = {name: arrays[name] for name in PARAM_NAMES}
    seed = bundle.manifest.get("seed", -1)
    return Problem(arrays["input"], arrays["target"], params, seed if isinstance(seed, int) else -1, str(bundle.path))


def result_from_bundle(bundle: Bundle) -> Result:
    """The response part of a bundle as a Result, gradients converted to OIHW by the declared layout."""
    grads = {}
    for name in PARAM_NAMES:
        grad = bundle.arrays[f"{name}.grad"]
        grads[name] = from_layout(grad, bundle.weight_layout) if name in WEIGHT_NAMES else grad
    return Result(loss=float(bundle.arrays["loss"]), grads=grads, output=bundle.arrays.get("output"),
                  dtype=str(bundle.arrays["loss"].dtype),
                  meta={"bundle": str(bundle.path), "weight_layout": bundle.weight_layout})


@dataclass
class BundleCandidate(Candidate):
    """A static bundle as a candidate: `problem` is the bundle's own problem, compute returns its response."""

    problem: Problem | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "BundleCandidate":
        """Read and validate a static bundle directory (every array is loaded and checked here)."""
        bundle = read_bundle(path, ("static",))
        problem = problem_from_bundle(bundle)
        response = result_from_bundle(bundle)
        name = bundle.manifest.get("name") if isinstance(bundle.manifest.get("name"), str) else Path(path).name
        return cls(name=name, description=f"static bundle {path}", run=_stored_response(bundle, problem, response),
                   claimed_precision=bundle.precision, weight_layout=bundle.weight_layout, family="bundle",
                   has_float64=False, meta={"bundle": str(path)}, problem=problem)


def _stored_response(bundle: Bundle, problem: Problem, response: Result):
    def run(asked: Problem, precision: str, device: torch.device) -> Result:
        if asked is not problem and not (np.array_equal(asked.input, problem.input)
                                         and all(np.array_equal(asked.params[n], problem.params[n]) for n in PARAM_NAMES)):
            raise CandidateError(f"static bundle {bundle.path} holds results for its own problem only "
                                 f"(input {problem.input.shape}); use candidate.problem")
        return Result(response.loss, dict(response.grads), response.output, response.dtype, dict(response.meta))

    return run


__all__ = ["Bundle", "BundleCandidate", "BundleError", "FORMAT", "MODEL", "problem_from_bundle", "read_bundle",
           "read_response", "result_from_bundle", "write_bundle", "write_request", "write_response", "write_static"]
