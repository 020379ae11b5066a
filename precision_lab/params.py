"""Run parameters: a params YAML plus `-p NAME VALUE` overrides, checked before anything runs.

Each notebook declares its parameters in a cell tagged `parameters` (literal defaults only);
`papermill.inspect_notebook` reads them. A value is accepted when its name is declared by at
least one notebook of the suite and its type is a plain literal compatible with every
declaring notebook's default (int, float, str, bool, None, list of those). A few names the
lab gives a meaning to (device, size, candidates, image …) are also checked for sense, so
`-p device cuda` on a machine without a GPU fails here, in one line, not inside a kernel.
Each notebook then receives only the names it declares, plus `run_dir`.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import LabInputError

#: set by `precision-lab run` for each notebook: never taken from the user
RESERVED = ("run_dir",)

_PLAIN_SCALARS = (bool, int, float, str, type(None))


class _Loader(yaml.SafeLoader):
    """YAML with 1.2 floats: `1e-3` is a number (YAML 1.1, PyYAML's default, reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$"),
    list("-+0123456789."))


def read_yaml(text: str):
    """A YAML document read with the lab's loader (safe, 1.2-style floats)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


@dataclass(frozen=True)
class Declared:
    """One notebook's parameter: its name, literal default and the notebook declaring it."""

    name: str
    default: Any
    notebook: str


def notebook_parameters(notebook: str | Path) -> dict[str, Declared]:
    """The parameters a notebook declares in its `parameters` cell, with their literal defaults."""
    import papermill

    notebook = Path(notebook)
    try:
        found = papermill.inspect_notebook(str(notebook))
    except Exception as exc:  # noqa: BLE001 - an unreadable notebook is one clear line
        raise LabInputError(f"{notebook}: cannot read its parameters cell ({type(exc).__name__}: {exc})") from None
    declared = {}
    for name, info in found.items():
        try:
            default = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            raise LabInputError(f"{notebook}: parameter {name!r} has default {info['default']!r}; "
                                "the parameters cell must hold literal values only") from None
        declared[name] = Declared(name, default, notebook.stem)
    return declared


def load_params_file(path: str | Path | None) -> dict[str, Any]:
    """Parameters from a YAML mapping (an empty file is no parameters)."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise LabInputError(f"{path}: no such parameters file (expected a YAML mapping such as params/quick.yaml)")
    try:
        loaded = read_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise LabInputError(f"{path}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    except UnicodeDecodeError:
        raise LabInputError(f"{path}: not a UTF-8 text file (expected a YAML mapping of parameter: value)") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise LabInputError(f"{path}: expected a YAML mapping of parameter: value, got a {type(loaded).__name__}")
    for key in loaded:
        if not isinstance(key, str):
            raise LabInputError(f"{path}: key {key!r} is not a parameter name (expected a string)")
    return loaded


def parse_overrides(pairs: list[list[str]] | None) -> dict[str, Any]:
    """`-p NAME VALUE` pairs, each VALUE read as a YAML literal (`64`, `[64, 128]`, `null`, `cpu`)."""
    overrides = {}
    for name, text in pairs or []:
        try:
            overrides[name] = read_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            raise LabInputError(f"-p {name} {text!r}: not a YAML literal "
                                "(write e.g. 64, 1e-3, cpu, null, or [64, 128])") from None
    return overrides


def merge(file_params: dict, overrides: dict, params_file: str | Path | None) -> tuple[dict, dict]:
    """The effective values and where each came from (the file or `-p`), overrides winning."""
    values, sources = {}, {}
    for name, value in file_params.items():
        values[name], sources[name] = value, f"{params_file}: key {name!r}"
    for name, value in overrides.items():
        values[name], sources[name] = value, f"-p {name}"
    return values, sources


def validate(values: dict, sources: dict, declared_by_notebook: dict[str, dict[str, Declared]]) -> dict:
    """Check every value against the notebooks' declarations; returns the values, normalised.

    Raises LabInputError naming the file (or `-p`), the key and the expected type.
    """
    known: dict[str, list[Declared]] = {}
    for declared in declared_by_notebook.values():
        for name, item in declared.items():
            known.setdefault(name, []).append(item)
    normalised = {}
    for name, value in values.items():
        where = sources.get(name, name)
        if name in RESERVED:
            raise LabInputError(f"{where}: {name} is set by `precision-lab run` itself; remove it")
        if name not in known:
            choices = ", ".join(sorted(n for n in known if n not in RESERVED)) or "none"
            raise LabInputError(f"{where}: unknown parameter {name!r}; the notebooks declare: {choices}")
        for item in known[name]:
            value = _check_type(value, item, where)
        _check_meaning(name, value, where)
        normalised[name] = value
    defaults = {name: items[0].default for name, items in known.items()}
    check_together({**defaults, **normalised}, sources)
    return normalised


def for_notebook(values: dict, declared: dict[str, Declared], run_dir: str | Path) -> dict:
    """What papermill injects into one notebook: the names it declares, plus `run_dir`."""
    injected = {name: value for name, value in values.items() if name in declared}
    injected["run_dir"] = str(run_dir)
    return injected


# ---------------------------------------------------------------------------------------------
# types


def _type_word(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list"}.get(type(value), f"a {type(value).__name__}")


def _check_type(value: Any, item: Declared, where: str) -> Any:
    """`value` converted to the kind of `item.default` (int → float allowed), or LabInputError."""
    expected = f"{_type_word(item.default)} like the default {item.default!r} of {item.notebook}"
    if not _is_plain(value):
        raise LabInputError(f"{where}: expected {expected}, got {_type_word(value)} "
                            "(parameters are plain literals: numbers, strings, booleans, null, lists)")
    default = item.default
    if default is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, str):
        if isinstance(value, str) or value is None:
            return value
    elif isinstance(default, list):
        if isinstance(value, list):
            return [_check_element(v, default, i, item, where) for i, v in enumerate(value)]
    raise LabInputError(f"{where}: expected {expected}, got {_type_word(value)} {value!r}")


def _check_element(value: Any, default: list, index: int, item: Declared, where: str) -> Any:
    if not default:
        return value
    return _check_type(value, Declared(f"{item.name}[{index}]", default[0], item.notebook), f"{where}[{index}]")


def _is_plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN_SCALARS)


# ---------------------------------------------------------------------------------------------
# meaning of the names the lab knows


def _check_meaning(name: str, value: Any, where: str) -> None:
    if name not in _MEANING or value is None:
        return
    kind, check = _MEANING[name]
    if not _is_kind(value, kind):
        raise LabInputError(f"{where}: expected {_KIND_WORDS[kind]}, got {_type_word(value)} {value!r}")
    check(value, where)


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integers":
        return isinstance(value, list) and all(_is_kind(v, "integer") for v in value)
    return isinstance(value, list) and all(isinstance(v, str) for v in value)  # "strings"


_KIND_WORDS = {"number": "a number", "integer": "an integer", "string": "a string",
               "integers": "a list of integers", "strings": "a list of strings"}


#: the smallest image side a notebook runs at (a 3×3 kernel, a probe, a pool need a few pixels)
MIN_NOTEBOOK_SIZE = 8


def _positive_size(value: Any, where: str) -> None:
    if value < MIN_NOTEBOOK_SIZE:
        raise LabInputError(f"{where}: image size {value} is too small (expected an integer ≥ {MIN_NOTEBOOK_SIZE}, "
                            f"e.g. 64 or 1024)")


def _sizes(value: Any, where: str) -> None:
    if not value:
        raise LabInputError(f"{where}: expected a non-empty list of image sizes, e.g. [64, 128, 256]")
    for i, size in enumerate(value):
        _positive_size(size, f"{where}[{i}]")


def _positive(value: Any, where: str) -> None:
    if value <= 0:
        raise LabInputError(f"{where}: expected a positive value, got {value!r}")


def _non_negative(value: Any, where: str) -> None:
    if value < 0:
        raise LabInputError(f"{where}: expected a value ≥ 0, got {value!r}")


def _device(value: Any, where: str) -> None:
    from .device import resolve_device

    try:
        resolve_device(value)
    except ValueError as exc:
        raise LabInputError(f"{where}: {exc}") from None


def _candidates(value: Any, where: str) -> None:
    from .candidates import resolve

    for i, spec in enumerate(value):
        try:
            resolve(spec)
        except ValueError as exc:  # CandidateError, bundle and command-YAML errors are ValueErrors
            raise LabInputError(f"{where}[{i}]: {exc}") from None


def _probes(value: Any, where: str) -> None:
    from . import probes

    try:
        probes.select(value)
    except LabInputError as exc:
        raise LabInputError(f"{where}: {str(exc).removeprefix('--probes: ')}") from None


def _model(value: Any, where: str) -> None:
    from .model import ModelSpecError
    from .paths import ROOT
    from .model import load_model

    try:
        load_model(value, base_dir=ROOT)
    except ModelSpecError as exc:
        raise LabInputError(f"{where}: {exc}") from None


def check_together(values: dict, sources: dict) -> None:
    """Checks across parameters: every size fits the model (its strides and pools), and the largest
    problem fits in the memory that is free (precision_lab.resources), before any notebook starts."""
    from .device import resolve_device
    from .model import ModelSpecError, load_model
    from .paths import ROOT
    from .resources import ResourceError, check_fits

    model_where = sources.get("model", "model")
    network = load_model(values.get("model"), base_dir=ROOT)
    sized = [(name, size) for name in ("size", "trajectory_size") if isinstance(values.get(name), int)
             for size in [values[name]]]
    sized += [(f"sizes[{i}]", size) for i, size in enumerate(values.get("sizes") or []) if isinstance(size, int)]
    for name, size in sized:
        where = sources.get(name.split("[")[0], name)
        try:
            network.check_size(size, size)
        except ModelSpecError as exc:
            raise LabInputError(f"{where}: {size}×{size} does not fit the model ({model_where}): {exc}") from None
    if not sized:
        return
    batch = values.get("batch", 2) if isinstance(values.get("batch", 2), int) else 2
    try:
        device = resolve_device(values.get("device", "auto") if isinstance(values.get("device"), str) else "auto")
    except ValueError:
        return
    name, largest = max(sized, key=lambda item: item[1])
    try:
        check_fits(network, batch, largest, largest, device, what="a notebook's problem")
    except ResourceError as exc:
        raise LabInputError(f"{sources.get(name.split('[')[0], name)}: {exc}") from None


def _image(value: Any, where: str) -> None:
    from .problem import ProblemError, load_micrograph

    try:
        load_micrograph(value)
    except ProblemError as exc:
        raise LabInputError(f"{where}: {exc}") from None


#: names the lab gives a meaning to: (expected kind, check of the value)
_MEANING = {"size": ("integer", _positive_size), "sizes": ("integers", _sizes),
            "batch": ("integer", _positive), "steps": ("integer", _non_negative),
            "seed": ("integer", _non_negative), "lr": ("number", _positive), "adam_lr": ("number", _positive),
            "device": ("string", _device), "candidates": ("strings", _candidates), "image": ("string", _image),
            "trajectory_size": ("integer", _positive_size), "model": ("string", _model),
            "opaque_candidates": ("strings", _candidates), "probes": ("string", _probes)}


def from_papermill(**values):
    """List parameters as a notebook received them, turned into lists: `papermill NB OUT -p candidates
    "[native, fortran-replay-flip]"` injects that text as a string (papermill's `-p` only knows numbers,
    booleans and None), so its YAML flow form is read here; a single value becomes a list of one.
    Lists (`-y`, `precision-lab run -p`) pass unchanged. One value in, one out; several, a tuple.
    """
    out = []
    for name, value in values.items():
        if isinstance(value, str) and value.strip().startswith(("[", "{")):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise LabInputError(f"parameter {name!r}: {value!r} is not a list: write it as \"[a, b]\" "
                                    f"(papermill -p {name} \"[a, b]\", or -y \"{name}: [a, b]\")") from None
        if not isinstance(value, (list, tuple, dict)):
            value = [value]  # `-p candidates native`: one candidate
        out.append(list(value) if isinstance(value, tuple) else value)
    return out[0] if len(out) == 1 else tuple(out)
