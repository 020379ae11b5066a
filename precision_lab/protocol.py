"""Write a candidate in Python: a request in *your* layout and dtype in, your loss and gradients out.

A command candidate (docs/external.md §2) reads a request bundle and writes a response bundle.
This module is that exchange for a Python program, so a framework candidate is ~10–20 lines:

    from precision_lab import protocol

    def compute(request):                       # arrays in the layouts you asked for, request.dtype
        loss, grads, output = my_framework_step(request.input, request.target, request.params)
        return loss, grads, output              # grads: {parameter name: array in your layout}

    protocol.run(compute, layout="HWIO", activations="NHWC")   # argv: REQUEST_DIR RESPONSE_DIR

The contract (stable, like the exchange format it reads and writes):

* ``layout``: the weight layout your code holds, any permutation of O, I, H, W (default: the
  request's, i.e. the YAML's `weight_layout`). 4-D weights come in that layout; 2-D (linear)
  weights keep its relative order of O and I (HWIO → IO, as Keras and Flax hold a dense kernel;
  OIHW → OI, as PyTorch and tinygrad do). Gradients go back in the same layout.
* ``activations``: "NCHW" (default) or "NHWC": the layout of 4-D `input`, `target` and `output`.
* ``request.masks``: a training dropout's `<layer>.mask` (1 keeps, 0 drops), the lab's draw: apply it as
  x·mask/(1 − p) and g·mask/(1 − p), draw none of your own; no gradient goes back for a mask.
* ``dtype``: arrays are the request's exchange dtype (float32, or float64 for a float64 build;
  tf32/bfloat16/float16 claims exchange float32); int64 class targets stay int64.
* The response is written in the request's format (npz or raw binaries), its `precision` and
  `weight_layout`, each gradient converted from your layout to the request's. Declare in the YAML
  the layout your framework holds: then nothing is converted and the layout doctor reads the
  gradient buffer exactly as your framework wrote it.
* A request or response that breaks the contract (a missing or extra gradient, a wrong shape or
  dtype, NaN/Inf) raises `ProtocolError`; `run` prints it as one line and exits 2.
* Worker mode (`worker: true` in the YAML, docs/external.md §2): started with PRECISION_LAB_WORKER=1, `run`
  answers one request per stdin line until EOF; an error in one request is its answer, and the next is served.
  What the program prints goes to stderr (file descriptor 1 is pointed there): stdout carries the frames only.
* An opaque request (`model: opaque`, docs/external.md §5) comes as an `OpaqueRequest`: `request.arrays`
  (everything the start bundle holds), `request.params` (the listed parameters), no layouts; `compute`
  returns (loss, grads) and the response goes back in the request's format (npz or raw).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import bundle as exchange
from . import formats
from .errors import LabInputError
from .layout import check_layout, from_layout, layout_for, shape_in_layout, to_layout
from .model import Network

ACTIVATION_LAYOUTS = ("NCHW", "NHWC")
#: exit status for a request or response that breaks the contract (the lab's bad-input status)
EXIT_BAD_INPUT = 2


class ProtocolError(LabInputError):
    """A request or response that breaks the exchange contract: one line naming the array and the fix."""


@dataclass
class Request:
    """A request as your code wants it: arrays in your layouts and the exchange dtype."""

    path: Path
    precision: str  # the claimed precision: float32, float64, tf32, bfloat16, float16
    dtype: np.dtype  # the exchange dtype of every float array (float32 or float64)
    layout: str  # the weight layout of `params` and of the gradients you return
    activations: str  # NCHW or NHWC: the layout of 4-D input, target and output
    input: np.ndarray
    target: np.ndarray
    params: dict[str, np.ndarray]
    network: Network  # the network the lab computes (request.model is its spec)
    request_layout: str  # the weight layout written in the request (the YAML's weight_layout)
    raw: bool = False  # the request came as raw binaries: the response goes back the same way
    manifest: dict = field(default_factory=dict)
    #: a training dropout's '<layer>.mask' (1 keeps, 0 drops; its output's shape, 4-D ones in `activations`):
    #: y = x·mask/(1 − p), ∂x = g·mask/(1 − p); not parameters, so no gradient goes back for them
    masks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def model(self) -> dict:
        """The model spec as bundle.json carries it (seed form or layer form; docs/models.md)."""
        return self.network.to_json()

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return self.network.parameter_names

    def shape_of(self, parameter: str) -> tuple[int, ...]:
        """The shape of `parameter` (and of its gradient) in your layout."""
        return shape_in_layout(self.network.param_shapes[parameter], self.layout)

    def layer(self, name: str) -> dict:
        """A layer's attributes by name (e.g. request.layer('conv1')['padding']), defaults filled in."""
        return dict(self.network.layers[self.network.index_of(name)].attrs)


def _nhwc(array: np.ndarray, activations: str) -> np.ndarray:
    return np.ascontiguousarray(array.transpose(0, 2, 3, 1)) if activations == "NHWC" and array.ndim == 4 else array


def _nchw(array: np.ndarray, activations: str) -> np.ndarray:
    return np.ascontiguousarray(array.transpose(0, 3, 1, 2)) if activations == "NHWC" and array.ndim == 4 else array


def _check_choices(layout, activations) -> None:
    if layout is not None:
        try:
            check_layout(layout)
        except ValueError as exc:
            raise ProtocolError(f"protocol: layout: {exc}") from None
    if activations not in ACTIVATION_LAYOUTS:
        raise ProtocolError(f"protocol: activations is {activations!r}: expected one of "
                            f"{', '.join(ACTIVATION_LAYOUTS)}")


@dataclass
class OpaqueRequest:
    """A request of the reference-free check (`model: opaque`, docs/external.md §5): every array of the start bundle,
    the listed parameters perturbed, floats in the build's dtype. Answer `loss` and a gradient per parameter."""

    path: Path
    precision: str  # the build's: the claim (float32, …) or float64 for command_float64
    dtype: np.dtype  # the exchange dtype of every float array
    arrays: dict[str, np.ndarray]  # everything the start bundle holds (inputs, targets, grids, parameters, …)
    parameter_names: tuple[str, ...]  # model.parameters, in the start bundle's order
    raw: dict[str, dict] | None = None  # raw binaries (name → file, order): the response goes back the same way
    manifest: dict = field(default_factory=dict)

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {name: self.arrays[name] for name in self.parameter_names}

    def shape_of(self, parameter: str) -> tuple[int, ...]:
        """The shape of `parameter` and of its gradient (an opaque model has no layout: as the array came)."""
        return tuple(self.arrays[parameter].shape)


def _opaque(directory: str | Path) -> bool:
    """Does bundle.json describe an opaque model (`"model": {"opaque": true, …}`)?"""
    try:
        model = exchange.load_manifest(Path(directory) / exchange.MANIFEST, "").get("model")
    except (exchange.BundleError, AttributeError):
        return False  # read_bundle says what is wrong with it
    return isinstance(model, dict) and model.get("opaque") is True


def _read_opaque(directory: str | Path) -> OpaqueRequest:
    from .candidates.opaque import read_start_bundle  # the lab's own reading of an opaque request

    precision = exchange.load_manifest(Path(directory) / exchange.MANIFEST, "").get("precision")
    try:
        found = read_start_bundle(directory, precision if precision in formats.STORAGE_DTYPE else "float32")
    except exchange.BundleError as exc:
        raise ProtocolError(str(exc)) from None
    dtype = np.dtype(formats.STORAGE_DTYPE[found.manifest["precision"]])
    return OpaqueRequest(Path(directory), found.manifest["precision"], dtype, found.arrays, tuple(found.parameters),
                         found.raw, found.manifest)


def read_request(directory: str | Path, layout: str | None = None, activations: str = "NCHW") -> Request | OpaqueRequest:
    """Read and validate a request bundle (npz or raw, C or F order) into arrays in your layouts.

    `layout`: your weight layout (None: the request's own); `activations`: NCHW or NHWC. An opaque request
    (`model.opaque`) comes as an `OpaqueRequest`: its arrays as they are (it has no layouts).
    """
    _check_choices(layout, activations)
    if _opaque(directory):
        return _read_opaque(directory)
    try:
        found = exchange.read_bundle(directory, ("request",))
    except exchange.BundleError as exc:
        raise ProtocolError(str(exc)) from None
    layout = layout or found.weight_layout
    network = found.network
    params = {name: to_layout(from_layout(found.arrays[name], found.weight_layout), layout)
              for name in network.parameter_names}
    masks = {name: _nhwc(found.arrays[name], activations) for name in network.mask_names}
    return Request(Path(directory), found.precision, found.arrays["input"].dtype, layout, activations,
                   _nhwc(found.arrays["input"], activations), _nhwc(found.arrays["target"], activations), params,
                   network, found.weight_layout, "arrays" in found.manifest, found.manifest, masks)


def _as_array(where: str, name: str, value, dtype: np.dtype) -> np.ndarray:
    """A framework value as a numpy array of the exchange dtype; a different float width is refused."""
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise ProtocolError(f"{where}: {name!r} has dtype {array.dtype}, expected {dtype} (floating point)")
    if array.dtype != dtype and array.ndim > 0:
        raise ProtocolError(f"{where}: {name!r} has dtype {array.dtype}, expected {dtype} as in the request "
                            f"(compute in {dtype}: a float64 request is the float64 build)")
    return array.astype(dtype, copy=False)


def response_arrays(request: Request, loss, grads: dict, output=None) -> dict[str, np.ndarray]:
    """The response arrays in the request's layout and dtype, every name and shape checked first."""
    where = f"response to {request.path}"
    arrays = _loss_checked(where, request, loss, grads, "parameter", "a parameter of the network (parameters")
    for name in request.parameter_names:
        grad = _as_array(where, f"{name}.grad", grads[name], request.dtype)
        expected = request.shape_of(name)
        if grad.shape != expected:
            held = layout_for(len(expected), request.layout)
            raise ProtocolError(f"{where}: gradient of {name!r} has shape {grad.shape}, expected {expected} "
                                f"(layout {held}, as its weight came)")
        arrays[f"{name}.grad"] = to_layout(from_layout(grad, request.layout), request.request_layout)
    if output is not None:
        batch, _, height, width = _nchw(request.input, request.activations).shape
        shape = (batch, *request.network.output_shape(height, width))
        value = _nchw(_as_array(where, "output", output, request.dtype), request.activations)
        if value.shape != shape:
            raise ProtocolError(f"{where}: 'output' has shape {_nhwc(value, request.activations).shape}, expected "
                                f"{_nhwc(np.empty(shape, bool), request.activations).shape} ({request.activations})")
        arrays["output"] = value
    for name, value in arrays.items():
        if not np.isfinite(value).all():
            raise ProtocolError(f"{where}: {name!r} holds NaN or infinite values; expected finite numbers")
    return arrays


def _loss_checked(where: str, request, loss, grads, each: str, belongs: str) -> dict[str, np.ndarray]:
    """{"loss": the scalar loss}, after checking that `grads` is a dict with one gradient per parameter and no other."""
    if not isinstance(grads, dict):
        raise ProtocolError(f"{where}: gradients must be a dict {{parameter name: array}}, got {type(grads).__name__}")
    names = request.parameter_names
    missing = [name for name in names if name not in grads]
    if missing:
        raise ProtocolError(f"{where}: no gradient for {missing[0]!r} (expected one per {each}: {', '.join(names)})")
    extra = sorted(set(grads) - set(names))
    if extra:
        raise ProtocolError(f"{where}: {extra[0]!r} is not {belongs}: {', '.join(names)})")
    loss = _as_array(where, "loss", loss, request.dtype)
    if loss.size != 1:
        raise ProtocolError(f"{where}: 'loss' has shape {loss.shape}, expected a scalar")
    return {"loss": np.asarray(loss.reshape(()), request.dtype)}


def opaque_response_arrays(request: OpaqueRequest, loss, grads: dict) -> dict[str, np.ndarray]:
    """`loss` and `<parameter>.grad` for every listed parameter, each checked: name, shape, dtype, finite."""
    where = f"response to {request.path}"
    arrays = _loss_checked(where, request, loss, grads, "listed parameter", "a listed parameter (model.parameters")
    for name in request.parameter_names:
        grad = _as_array(where, f"{name}.grad", grads[name], request.dtype)
        if grad.shape != request.shape_of(name):
            raise ProtocolError(f"{where}: gradient of {name!r} has shape {grad.shape}, expected "
                                f"{request.shape_of(name)} (the parameter's)")
        arrays[f"{name}.grad"] = grad
    for name, value in arrays.items():
        if not np.isfinite(value).all():
            raise ProtocolError(f"{where}: {name!r} holds NaN or infinite values; expected finite numbers")
    return arrays


def _write_opaque(directory: str | Path, request: OpaqueRequest, loss, grads: dict, output=None) -> Path:
    if output is not None:
        raise ProtocolError(f"response to {request.path}: an opaque response is the loss and the gradients; "
                            f"return (loss, grads)")
    arrays = opaque_response_arrays(request, loss, grads)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"format": exchange.FORMAT, "kind": "response", "precision": request.precision}
    if request.raw is not None:  # the request's format: raw binaries in the order its parameters came in
        orders = {f"{name}.grad": spec.get("order", "C") for name, spec in request.raw.items()}
        manifest["arrays"] = {name: exchange.write_raw_array(directory, name, value, orders.get(name, "C"))
                              for name, value in arrays.items()}
    else:
        np.savez(directory / exchange.NPZ, **arrays)
    (directory / exchange.MANIFEST).write_text(exchange.manifest_text(manifest))
    return directory


def write_response(directory: str | Path, request: Request | OpaqueRequest, loss, grads: dict, output=None) -> Path:
    """Write the response bundle: `loss` (a scalar), `grads` {parameter: array in your layout}, and
    optionally the network `output` (in your activation layout), in the request's format and layout.
    For an `OpaqueRequest`: `loss` and `grads` {listed parameter: array of its shape}, no output."""
    if isinstance(request, OpaqueRequest):
        return _write_opaque(directory, request, loss, grads, output)
    arrays = response_arrays(request, loss, grads, output)
    return exchange.write_bundle(directory, "response", request.precision, request.request_layout, arrays,
                                 raw=request.raw, network=request.network)


#: the variable the lab sets when it starts the program as a worker (candidates/worker.py)
WORKER_ENV = "PRECISION_LAB_WORKER"


def run(compute: Callable[[Request], tuple], layout: str | None = None, activations: str = "NCHW",
        argv: list[str] | None = None) -> None:
    """A candidate's main: read argv's REQUEST_DIR, call `compute(request)`, write RESPONSE_DIR; as a worker
    (PRECISION_LAB_WORKER=1, `worker: true` in the YAML), the same for each request framed on stdin until EOF.

    `compute` returns (loss, grads) or (loss, grads, output). A request or response that breaks the
    contract ends the program with one line on stderr and exit status 2 (a worker answers it and serves on).
    """
    worker = os.environ.get(WORKER_ENV) == "1"
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 2 and not worker:
        print(f"usage: {Path(sys.argv[0]).name} REQUEST_DIR RESPONSE_DIR", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)
    try:
        if worker:
            serve(compute, layout, activations)  # a bad layout or activations ends it here, before any request
        else:
            answer_one(compute, args[0], args[1], layout, activations)
    except LabInputError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def answer_one(compute: Callable, request_dir: str | Path, response_dir: str | Path, layout: str | None = None,
               activations: str = "NCHW") -> None:
    """Read one request, compute, write its response (every contract check of `run`)."""
    request = read_request(request_dir, layout, activations)
    answer = compute(request)
    if not isinstance(answer, tuple) or len(answer) not in (2, 3):
        raise ProtocolError("protocol: compute(request) must return (loss, grads) or (loss, grads, output)")
    write_response(response_dir, request, *answer)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def serve(compute: Callable, layout: str | None = None, activations: str = "NCHW", stdin=None) -> None:
    """Worker mode: for each stdin line {"id", "request", "response"} answer {"id", "ok"[, "error"]} on stdout
    once the response is written, until EOF. Any exception of a request is its answer (ok false, one line; the
    traceback on stderr) and the worker serves on."""
    _check_choices(layout, activations)
    sys.stdout.flush()
    frames = os.fdopen(os.dup(1), "w", buffering=1)  # the real stdout, for frames only
    os.dup2(2, 1)  # print() and C libraries writing to descriptor 1 now reach stderr: they cannot break a frame
    for line in stdin if stdin is not None else sys.stdin:
        if not line.strip():
            continue
        ident = None
        try:
            try:
                frame = json.loads(line)
            except ValueError:
                frame = None
            ident = frame.get("id") if isinstance(frame, dict) else None
            if not isinstance(frame, dict) or not isinstance(frame.get("request"), str) \
                    or not isinstance(frame.get("response"), str):
                raise ProtocolError(f"protocol: a request line is {{\"id\": N, \"request\": DIR, \"response\": DIR}}, "
                                    f"got {line.strip()[:200]!r}")
            answer_one(compute, frame["request"], frame["response"], layout, activations)
            answer = {"id": ident, "ok": True}
        except Exception as exc:  # noqa: BLE001 — the request fails, the worker serves the next one
            if not isinstance(exc, LabInputError):
                traceback.print_exc(file=sys.stderr)
            answer = {"id": ident, "ok": False, "error": _one_line(f"{type(exc).__name__}: {exc}"
                                                                   if not isinstance(exc, LabInputError) else exc)}
        sys.stdout.flush()
        frames.write(json.dumps(answer) + "\n")
    frames.close()


__all__ = ["ACTIVATION_LAYOUTS", "OpaqueRequest", "ProtocolError", "Request", "answer_one", "opaque_response_arrays",
           "read_request", "response_arrays", "run", "serve", "write_response"]
