"""The exchange format (docs/design.md, "Exchange format"): request, response and static bundles.

A bundle is a directory holding `bundle.json` and either `arrays.npz` (C order, loaded with
``allow_pickle=False``) or raw binaries listed in `bundle.json` under ``"arrays"``
(``{"name": {"file", "dtype", "shape", "order"}}``; little-endian; ``order`` "C" or "F",
"C" when absent). Everything read is validated *before* it is allocated: names, shapes,
dtypes, file sizes and the memory the arrays would take; then every value must be finite.
Every error is one line naming the file, the key and what was expected (`BundleError`).

Array names follow the bundle's network (its `model`, either form of the model spec): `input`
(N, C, H, W), `target` (the output's shape for mse; int64 class indices (N,) or (N, H, W) for
cross_entropy), `<name>.weight` / `<name>.bias` (4-D weights in `weight_layout`, 2-D ones in its
order of O and I), a training dropout's `<layer>.mask` (0/1, its output's shape, batch included: no
parameter, never answered), and in a response `loss`, `<param>.grad`, optionally `output` and, for named
layers, `<layer>.output` and `<layer>.output.grad` (intermediates, for localisation).
"""
from __future__ import annotations

import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import formats
from .compute import GradBuffer, Result
from .errors import LabInputError
from .layout import check_layout, from_layout, layout_for, shape_in_layout, to_layout
from .model import SEED_SPEC, ModelSpecError, Network, parse_spec, seed_network
from .problem import Problem

FORMAT = "precision-lab/bundle-1"
#: the seed network's spec, as requests for it carry it
MODEL = dict(SEED_SPEC)
KINDS = ("request", "response", "static")
MANIFEST = "bundle.json"
NPZ = "arrays.npz"
RAW_DTYPES = ("float32", "float64", "int64")
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
    network: Network | None = None
    buffers: dict[str, GradBuffer] = field(default_factory=dict)  # weight gradients as written (memory order)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.arrays["input"].shape)


# ---------------------------------------------------------------------------------------------
# writing


def write_bundle(directory: str | Path, kind: str, precision: str, weight_layout: str,
                 arrays: dict[str, np.ndarray], raw: bool = False, extra: dict | None = None,
                 network: Network | None = None) -> Path:
    """Write `arrays` (already in their exchange shapes and dtypes) as a bundle; returns the directory.

    With `raw`, each array goes to `<name>.bin` in Fortran (column-major) order, listed in
    bundle.json, for programs that read binaries directly; otherwise to arrays.npz (C order).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = (network or seed_network()).to_json()
    manifest = {"format": FORMAT, "kind": kind, "model": model, "precision": precision,
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
    target = problem.target if problem.target.dtype == np.int64 else problem.target.astype(dtype)
    arrays = {"input": problem.input.astype(dtype), "target": target}
    for name in problem.network.parameter_names:
        arrays[name] = to_layout(problem.params[name].astype(dtype), weight_layout)
    for name in problem.network.mask_names:
        arrays[name] = problem.masks[name].astype(dtype)  # 0 and 1: exact in every exchange dtype
    return arrays


def response_arrays(result: Result, precision: str, weight_layout: str, network: Network | None = None
                    ) -> dict[str, np.ndarray]:
    """The response arrays of a Result (canonical gradients) in the exchange layout and dtype."""
    dtype = _storage_dtype(precision, "precision")
    names = (network or seed_network()).parameter_names
    arrays = {"loss": np.asarray(result.loss, dtype)}
    for name in names:
        arrays[f"{name}.grad"] = to_layout(np.asarray(result.grads[name], dtype), weight_layout)
    if result.output is not None:
        arrays["output"] = np.asarray(result.output, dtype)
    for name, value in result.intermediates.items():
        arrays[name] = np.asarray(value, dtype)
    return arrays


def write_request(problem: Problem, directory: str | Path, precision: str = "float32",
                  weight_layout: str = "OIHW", raw: bool = False) -> Path:
    """Write the request bundle a candidate reads: the problem in its layout and precision."""
    return write_bundle(directory, "request", precision, weight_layout,
                        request_arrays(problem, precision, weight_layout), raw, network=problem.network)


def write_response(result: Result, directory: str | Path, precision: str = "float32",
                   weight_layout: str = "OIHW", raw: bool = False, network: Network | None = None) -> Path:
    """Write a response bundle (what a candidate writes) from a Result with canonical gradients."""
    return write_bundle(directory, "response", precision, weight_layout,
                        response_arrays(result, precision, weight_layout, network), raw, network=network)


def write_static(problem: Problem, result: Result, directory: str | Path, precision: str = "float32",
                 weight_layout: str = "OIHW", raw: bool = False) -> Path:
    """Write a static bundle: the request arrays and the response arrays together."""
    arrays = {**request_arrays(problem, precision, weight_layout),
              **response_arrays(result, precision, weight_layout, problem.network)}
    return write_bundle(directory, "static", precision, weight_layout, arrays, raw, network=problem.network)


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
    manifest = load_manifest(path, f"a bundle is a folder with {MANIFEST} and {NPZ} or raw binaries")
    expect_field(path, manifest, "format", FORMAT)
    if manifest.get("kind") not in kinds:
        raise BundleError(f"{path}: key 'kind' is {manifest.get('kind')!r}, expected {' or '.join(map(repr, kinds))}")
    if manifest["kind"] in ("request", "static"):
        manifest["_network"] = network_of(path, manifest.get("model"))
    _storage_dtype(manifest.get("precision"), f"{path}: key 'precision'")
    try:
        check_layout(manifest.get("weight_layout"))
    except ValueError as exc:
        raise BundleError(f"{path}: key 'weight_layout': {exc}") from None
    return manifest


def load_manifest(path: Path, missing: str) -> dict:
    """A bundle.json read as a JSON object, or a BundleError naming it; `missing` says, in words, what
    should have put it there (a bundle's, a start bundle's or a program's response folder)."""
    if not path.is_file():
        raise BundleError(f"{path}: missing ({missing})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    return manifest


def expect_field(path: Path, manifest: dict, key: str, expected) -> None:
    if manifest.get(key) != expected:
        raise BundleError(f"{path}: key {key!r} is {manifest.get(key)!r}, expected {expected!r}")


def network_of(path: Path, model) -> Network:
    """The network a bundle's `model` describes (either form of the model spec)."""
    if model is None:
        raise BundleError(f"{path}: key 'model' missing (expected a model spec, e.g. {json.dumps(MODEL)})")
    try:
        return parse_spec(model, f"{path}: key 'model'")
    except ModelSpecError as exc:
        raise BundleError(str(exc)) from None


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


def expected_shapes(kind: str, weight_layout: str, input_shape: tuple[int, ...],
                    network: Network | None = None) -> dict[str, tuple[int, ...]]:
    """Required arrays of a bundle kind and their shapes, given the input's (N, C, H, W)."""
    network = network or seed_network()
    batch, _, height, width = input_shape
    out = network.output_shape(height, width)
    from .ops import LOSSES

    request = {"input": input_shape, "target": (batch, *LOSSES[network.loss].target_shape(out))}
    response = {"loss": ()}
    for name, shape in network.param_shapes.items():
        request[name] = shape_in_layout(shape, weight_layout)
        response[f"{name}.grad"] = shape_in_layout(shape, weight_layout)
    request.update(network.mask_shapes(batch, height, width))  # masks: request arrays only, never a gradient
    return {"request": request, "response": response, "static": {**request, **response}}[kind]


def optional_shapes(network: Network, input_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Arrays a response may add: the output and, for named layers, their outputs and output gradients."""
    batch, _, height, width = input_shape
    shapes = network.shapes(height, width)
    optional = {"output": (batch, *shapes[-1])}
    for layer in network.layers:
        if layer.name:
            optional[f"{layer.name}.output"] = (batch, *shapes[layer.index])
            optional[f"{layer.name}.output.grad"] = (batch, *shapes[layer.index])
    return optional


def _describe_expected(name: str, shape: tuple[int, ...], weight_layout: str) -> str:
    in_layout = ""
    if ".weight" in name and len(shape) in (2, 4):
        in_layout = f" in layout {layout_for(len(shape), weight_layout)}"
    return f"expected shape {shape}{in_layout}"


def _input_shape(where: Path, entries: dict[str, ArrayEntry], network: Network) -> tuple[int, ...]:
    channels = network.input_channels
    if "input" not in entries:
        raise BundleError(f"{where} has no 'input' (expected shape (N, {channels}, H, W))")
    shape = entries["input"].shape
    if len(shape) != 4 or shape[1] != channels or min(shape) < 1:
        raise BundleError(f"{where}: 'input' has shape {shape}, expected (N, {channels}, H, W) with N, H, W ≥ 1")
    try:
        network.check_size(shape[2], shape[3])
    except ModelSpecError as exc:
        raise BundleError(f"{where}: 'input' is {shape[2]}×{shape[3]}: {exc}") from None
    return shape


def check_entries(where: Path, entries: dict[str, ArrayEntry], kind: str, precision: str,
                  weight_layout: str, input_shape: tuple[int, ...], network: Network | None = None) -> list[str]:
    """Every required array present with its shape and dtype; returns the optional arrays present (checked too)."""
    network = network or seed_network()
    dtype = np.dtype(formats.STORAGE_DTYPE[precision])
    expected = expected_shapes(kind, weight_layout, input_shape, network)
    from .ops import LOSSES

    target_dtype = LOSSES[network.loss].target_dtype  # class labels are integers: the one array not in `precision`
    for name, shape in expected.items():
        if name not in entries:
            raise BundleError(f"{where} has no {name!r} ({_describe_expected(name, shape, weight_layout)})")
        wanted = np.dtype(target_dtype) if name == "target" and target_dtype != "float" else dtype
        _check_entry(where, entries[name], shape, wanted, precision, weight_layout)
    present = []
    if kind != "request":
        for name, shape in optional_shapes(network, input_shape).items():
            if name in entries:
                _check_entry(where, entries[name], shape, dtype, precision, weight_layout)
                present.append(name)
    return present


def _check_entry(where: Path, entry: ArrayEntry, shape: tuple[int, ...], dtype: np.dtype,
                 precision: str, weight_layout: str) -> None:
    if entry.shape != tuple(shape):
        raise BundleError(f"{where}: {entry.name!r} has shape {entry.shape}, "
                          f"{_describe_expected(entry.name, tuple(shape), weight_layout)}")
    if entry.dtype.newbyteorder("=") != dtype:
        what = "cross_entropy targets are int64 class indices" if dtype == np.int64 else \
            f"precision {precision} exchanges {dtype}"
        raise BundleError(f"{where}: {entry.name!r} has dtype {entry.dtype}, expected {dtype} ({what})")


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
                input_shape: tuple[int, ...] | None = None, network: Network | None = None) -> Bundle:
    """Read and validate a bundle; a response is read against its request (`input_shape`, `network`)."""
    directory = Path(directory)
    manifest = read_manifest(directory, kinds)
    kind, precision, weight_layout = manifest["kind"], manifest["precision"], manifest["weight_layout"]
    network = manifest.pop("_network", None) or network or seed_network()
    entries = array_entries(directory, manifest)
    where = next(iter(entries.values())).file if entries and "arrays" not in manifest else directory / MANIFEST
    if kind == "response" and input_shape is None:
        raise BundleError(f"{directory}: a response bundle is read against its request (give input_shape)")
    if kind != "response":
        input_shape = _input_shape(where, entries, network)
    optional = check_entries(where, entries, kind, precision, weight_layout, input_shape, network)
    names = list(expected_shapes(kind, weight_layout, input_shape, network)) + optional
    check_memory(where, {name: entries[name] for name in names})
    arrays = load_arrays(directory, entries, names)
    buffers = {}
    for name in network.weight_names:
        key = f"{name}.grad"
        if key in arrays and arrays[key].ndim in (2, 4):
            order = entries[key].order
            buffers[name] = GradBuffer(arrays[key].ravel(order=order), weight_layout, order)
    return Bundle(directory, kind, precision, weight_layout, arrays, manifest, network, buffers)


def read_response(directory: str | Path, precision: str, weight_layout: str,
                  input_shape: tuple[int, ...], network: Network | None = None) -> Bundle:
    """Read a candidate's response to a request with this precision, layout, input shape and network."""
    manifest = read_manifest(directory, ("response",))
    for key, expected in (("precision", precision), ("weight_layout", weight_layout)):
        if manifest[key] != expected:
            raise BundleError(f"{Path(directory) / MANIFEST}: key {key!r} is {manifest[key]!r}, "
                              f"expected {expected!r} as in the request")
    return read_bundle(directory, ("response",), input_shape, network)


# ---------------------------------------------------------------------------------------------
# bundles as the lab's objects


def problem_from_bundle(bundle: Bundle) -> Problem:
    """The Problem a request or static bundle describes (float32 values, canonical weights).

    The reference starts from float32 values (docs/design.md, "One way through a diagnosis"), so float64 arrays must hold exactly
    float32-representable numbers; anything else is refused rather than silently rounded.
    """
    network = bundle.network or seed_network()
    arrays = {}
    for name in ("input", "target", *network.parameter_names, *network.mask_names):
        value = bundle.arrays[name]
        if value.dtype == np.int64:
            arrays[name] = value
            continue
        as_float32 = value.astype(np.float32)
        if value.dtype != np.float32 and not np.array_equal(as_float32.astype(value.dtype), value):
            raise BundleError(f"{bundle.path}: {name!r} holds float64 values that float32 cannot represent "
                              f"exactly; the lab's reference starts from float32 values (cast them first)")
        arrays[name] = from_layout(as_float32, bundle.weight_layout) if name in network.param_shapes else as_float32
    params = {name: arrays[name] for name in network.parameter_names}
    masks = {name: arrays[name] for name in network.mask_names}
    for name, mask in masks.items():
        if not np.all((mask == 0) | (mask == 1)):
            raise BundleError(f"{bundle.path}: {name!r} holds values other than 0 and 1 (a dropout mask: 1 keeps, "
                              f"0 drops)")
    seed = bundle.manifest.get("seed", -1)
    return Problem(arrays["input"], arrays["target"], params, seed if isinstance(seed, int) else -1, str(bundle.path),
                   network, masks=masks)


def result_from_bundle(bundle: Bundle) -> Result:
    """The response part of a bundle as a Result, gradients converted to canonical by the declared layout;
    the weight gradients as written kept for the layout doctor, intermediates for localisation."""
    network = bundle.network or seed_network()
    grads = {name: from_layout(bundle.arrays[f"{name}.grad"], bundle.weight_layout)
             for name in network.parameter_names}
    intermediates = {name: value for name, value in bundle.arrays.items()
                     if name.endswith(".output") or name.endswith(".output.grad")}
    return Result(loss=float(bundle.arrays["loss"]), grads=grads, output=bundle.arrays.get("output"),
                  dtype=str(bundle.arrays["loss"].dtype),
                  meta={"bundle": str(bundle.path), "weight_layout": bundle.weight_layout},
                  intermediates=intermediates, buffers=dict(bundle.buffers))


__all__ = ["Bundle", "BundleError", "FORMAT", "MODEL", "problem_from_bundle", "read_bundle", "read_response",
           "result_from_bundle", "write_bundle", "write_request", "write_response", "write_static"]
