"""`precision-lab campaign SPEC.yaml`: a grid of diagnoses on Dask, one Parquet table, a campaign report.

    precision-lab campaign SPEC.yaml [--workers N | --scheduler ADDRESS] [--threads T] [--out DIR]
        [--max-cells N] [--retry-failed] [--no-report | --report]

A spec is a grid (docs/design.md, "Campaigns"); paths in it are relative to the spec file:

```yaml
name: tf32-study                  # optional (default: the file's stem)
candidates:                       # built-in names, candidate YAMLs, bundle folders
  - builtin:native
  - candidate: ../examples/fortran/candidate.yaml
    expect: roundoff              # the verdict a legitimate build must get (built-ins know their own)
images: [synthetic, ../data/micrographs]   # `synthetic`, a .mrc/.npy file, or a folder of them
seeds: [0, 1, 2]
sizes: [256, 1024, 512x768]       # N or HxW
batch: [2]
flags: [{tf32: off}, {tf32: on}]  # precision flags (below); default one cell without flags
probes: default                   # as `diagnose --probes` (default, none, or names)
device: auto                      # as `diagnose --device`, on each worker
model: null                       # a model spec for built-in candidates (as `diagnose --model`)
out: null                         # default: <spec folder>/<spec stem>-campaign
```

Each cell is one `diagnose` (precision_lab.diagnose.diagnose) run as one task on Dask distributed:
a LocalCluster of worker processes by default, `--scheduler ADDRESS` for a cluster started elsewhere
(docs/campaigns.md: SLURM with dask-jobqueue, one worker per GPU). The flag `tf32` means:

* `builtin:native` (and its TF32 twins): `on` runs the TF32 build — `native-tf32` on a GPU,
  `tf32-emulated` on a CPU, which has no TF32 hardware; `off` runs `native` (cuDNN/cuBLAS IEEE);
* other built-ins: torch's float32 precision flags (cuDNN and cuBLAS `fp32_precision`) around the
  cell; on a CPU they change nothing (the row's `flags_applied` says so);
* command candidates: `off` sets `NVIDIA_TF32_OVERRIDE=0` in the program's environment (NVIDIA's
  switch that disables TF32 in cuBLAS and cuDNN); `on` leaves the libraries' default;
* static bundles hold a computed answer to their own problem: one cell each, flags, sizes, seeds
  and images do not apply.

Results: `OUT/cells/<cell>.parquet` (one file per finished cell, written to a temporary name and
renamed, so a killed campaign keeps every finished cell) and `OUT/campaign.parquet` (all cells of
the spec, rewritten atomically at the end), one row per cell and quantity. A cell's key hashes its
parameters and its candidate's bytes (the YAML and the program files it names, a bundle's files);
a rerun skips cells whose key has a part file. `OUT/report.html` is the campaign report
(precision_lab.campaign_report), written at the end of every run; `--report` rewrites it alone.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ..errors import LabInputError

#: keys a campaign spec may have
SPEC_KEYS = ("name", "candidates", "images", "seeds", "sizes", "batch", "flags", "probes", "device", "model", "out")
#: precision flags and their values (the module docstring says what each does to each kind of candidate)
FLAGS = {"tf32": ("on", "off")}
#: what precision_lab.problem.load_micrograph reads
IMAGE_SUFFIXES = (".mrc", ".mrcs", ".map", ".npy")
#: a spec is a few dozen lines; anything this large is the wrong file (and is not parsed)
MAX_SPEC_BYTES = 1 << 20
#: built-ins with a TF32 build: flag value → variant, per device type (the CPU has no TF32 hardware)
TF32_FAMILY = {"native", "native-tf32", "tf32-emulated"}
TF32_VARIANT = {("on", "cuda"): "native-tf32", ("on", "cpu"): "tf32-emulated", ("off", "cuda"): "native",
                ("off", "cpu"): "native"}
#: columns that describe how a run went, not what it found (excluded when two runs are compared)
VARYING_COLUMNS = ("seconds", "problem_seconds", "diagnose_seconds", "started", "worker", "torch_threads")
#: at most this many error lines are shown for one kind of spec error (a folder of 500 images …)
MAX_ERROR_LINES = 12


class CampaignSpecError(LabInputError):
    """A campaign spec that cannot run: one line per problem, each naming the key and the fix."""


# ---------------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True)
class CandidateEntry:
    """A candidate as the spec names it, resolved enough to key, label and reproduce its cells."""

    written: str  # as in the spec
    target: str  # what precision_lab.candidates.resolve takes: builtin:NAME or an absolute path
    name: str
    kind: str  # builtin | command | bundle
    family: str
    expected: str | None  # the verdict a cell must get (None: not declared)
    sha256: str


@dataclass(frozen=True)
class Cell:
    """One diagnosis of the grid; `params()` is what travels to a worker (plain JSON types only)."""

    candidate: CandidateEntry
    image: str  # "synthetic" or an absolute file path
    image_label: str
    seed: int | None
    height: int | None
    width: int | None
    batch: int | None
    flags: tuple[tuple[str, str], ...]
    probes: str
    device: str
    model: str | None
    campaign: str

    @property
    def flags_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.flags)

    def identity(self) -> dict:
        """What decides the cell's result: its parameters and its candidate's bytes."""
        return {"candidate": self.candidate.target, "candidate_sha256": self.candidate.sha256,
                "image": self.image, "image_bytes": _file_size(self.image), "seed": self.seed,
                "height": self.height, "width": self.width, "batch": self.batch, "flags": self.flags_text,
                "probes": self.probes, "device": self.device, "model": self.model, "model_sha256": _sha_of(self.model)}

    @property
    def key(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def params(self) -> dict:
        c = self.candidate
        return {"key": self.key, "campaign": self.campaign, "candidate": c.written, "target": c.target,
                "candidate_name": c.name, "kind": c.kind, "family": c.family, "expected": c.expected,
                "candidate_sha256": c.sha256, "image": self.image, "image_label": self.image_label,
                "seed": self.seed, "height": self.height, "width": self.width, "batch": self.batch,
                "flags": self.flags_text, "probes": self.probes, "device": self.device, "model": self.model}


@dataclass
class Spec:
    path: Path
    name: str
    candidates: list[CandidateEntry]
    images: list[tuple[str, str]]  # (absolute path or "synthetic", label)
    seeds: list[int]
    sizes: list[tuple[int, int]]
    batches: list[int]
    flags: list[tuple[tuple[str, str], ...]]
    probes: str
    device: str
    model: str | None
    out: Path
    raw: dict = field(default_factory=dict)

    def cells(self) -> list[Cell]:
        cells = []
        for cand in self.candidates:
            if cand.kind == "bundle":  # a static bundle answers its own problem only
                cells.append(Cell(cand, "synthetic", "bundle's own", None, None, None, None, (), "none",
                                  self.device, None, self.name))
                continue
            for image, label in self.images:
                for seed in self.seeds:
                    for height, width in self.sizes:
                        for batch in self.batches:
                            for flags in self.flags:
                                cells.append(Cell(cand, image, label, seed, height, width, batch, flags,
                                                  self.probes, self.device, self.model, self.name))
        return cells


def _file_size(path: str | None) -> int | None:
    return os.path.getsize(path) if path and path != "synthetic" and os.path.isfile(path) else None


def _sha_of(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_spec(path: str | Path, out: str | Path | None = None) -> Spec:
    """Read and check the whole spec; CampaignSpecError lists every problem, one line each."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise CampaignSpecError(f"{path}: no such campaign spec (give a YAML file; docs/campaigns.md shows one)")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise CampaignSpecError(f"{path}: {path.stat().st_size} bytes is not a campaign spec (at most {MAX_SPEC_BYTES})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CampaignSpecError(f"{path}: not valid YAML ({first})") from None
    if not isinstance(raw, dict):
        raise CampaignSpecError(f"{path}: a campaign spec is a mapping with keys {', '.join(SPEC_KEYS)}")
    base = path.resolve().parent
    errors: list[str] = []

    def error(key: str, message: str) -> None:
        errors.append(f"{path}: {key}: {message}")

    for key in raw:
        if key not in SPEC_KEYS:
            error(str(key), f"unknown key; a campaign spec has {', '.join(SPEC_KEYS)}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[\w.+-]+", name):
        error("name", f"expected a word (letters, digits, . _ + -), got {name!r}")
        name = path.stem
    device = _check_device(raw.get("device", "auto"), error)
    probes = _check_probes(raw.get("probes", "default"), error)
    model = _check_model(raw.get("model"), base, error)
    network = _network(model)
    seeds = _check_ints(raw.get("seeds", [0]), "seeds", 0, "a non-negative integer", error)
    batches = _check_ints(raw.get("batch", [2]), "batch", 1, "a positive integer", error)
    sizes = _check_sizes(raw.get("sizes", [1024]), network, error)
    flags = _check_flags(raw.get("flags", [{}]), error)
    candidates = _check_candidates(raw.get("candidates"), base, model, network, sizes, error)
    images = _check_images(raw.get("images", ["synthetic"]), base, sizes, error)
    out_dir = raw.get("out")
    if out_dir is not None and not isinstance(out_dir, str):
        error("out", f"expected a folder path relative to the spec, got {out_dir!r}")
        out_dir = None
    # --out (relative to where you run) wins over the spec's `out` (relative to the spec)
    out_path = Path(out) if out is not None else (base / out_dir if out_dir else base / f"{path.stem}-campaign")
    if errors:
        raise CampaignSpecError("\n".join(errors))
    return Spec(path, name, candidates, images, seeds, sizes, batches, flags, probes, device, model, out_path, raw)


def _check_device(value, error) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        error("device", f"expected auto, cpu or cuda[:N], got {value!r}")
        return "auto"
    return value


def _check_probes(value, error) -> str:
    from .. import probes as probe_set

    text = ",".join(map(str, value)) if isinstance(value, list) else value
    if not isinstance(text, str) or not text:
        error("probes", f"expected default, none or probe names among {', '.join(probe_set.PROBES)}, got {value!r}")
        return "none"
    try:
        probe_set.select(text)
    except LabInputError as exc:
        error("probes", str(exc).removeprefix("--probes: "))
    return text


def _check_model(value, base: Path, error) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        error("model", "expected a model spec file (JSON/YAML) relative to the spec, or 'seed'")
        return None
    if value == "seed":
        return None
    where = (base / value).resolve()
    if not where.is_file():
        error("model", f"{where}: no such model spec file (a path relative to the spec file)")
        return None
    return str(where)


def _network(model: str | None):
    from ..model import ModelSpecError, load_model

    try:
        return load_model(model)
    except (ModelSpecError, LabInputError, ValueError):
        return load_model(None)  # the model error itself is reported by the candidates' check


def _check_ints(value, key: str, minimum: int, words: str, error) -> list[int]:
    values = []
    for item in _as_list(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
            error(key, f"each entry must be {words}, got {item!r}")
        else:
            values.append(item)
    if not _as_list(value):
        error(key, f"give at least one value ({words})")
    return list(dict.fromkeys(values))


def _check_sizes(value, network, error) -> list[tuple[int, int]]:
    from ..model import ModelSpecError
    from ..problem import ProblemError, parse_size

    sizes = []
    for item in _as_list(value):
        try:
            height, width = parse_size(item, "size")
            network.check_size(height, width)
            sizes.append((height, width))
        except (ProblemError, ModelSpecError) as exc:
            error("sizes", f"{exc} (write N or HxW, e.g. 256 or 512x768)")
    if not _as_list(value):
        error("sizes", "give at least one size (N or HxW)")
    return list(dict.fromkeys(sizes))


def _check_flags(value, error) -> list[tuple[tuple[str, str], ...]]:
    sets = []
    for i, item in enumerate(_as_list(value)):
        if item is None:
            item = {}
        if not isinstance(item, dict):
            error(f"flags[{i}]", f"expected a mapping such as {{tf32: off}}, got {item!r}")
            continue
        chosen = []
        for flag, setting in item.items():
            if isinstance(setting, bool):  # YAML 1.1 reads on/off as booleans
                setting = "on" if setting else "off"
            if flag not in FLAGS:
                error(f"flags[{i}]", f"unknown flag {flag!r}; flags are {', '.join(FLAGS)}")
            elif setting not in FLAGS[flag]:
                error(f"flags[{i}].{flag}", f"expected {' or '.join(FLAGS[flag])}, got {setting!r}")
            else:
                chosen.append((str(flag), str(setting)))
        sets.append(tuple(sorted(chosen)))
    if not sets:
        error("flags", "give at least one flag set ({} for none)")
    return list(dict.fromkeys(sets))


def _check_candidates(value, base: Path, model, network, sizes, error) -> list[CandidateEntry]:
    from ..verdict import VERDICTS

    if not isinstance(value, list) or not value:
        error("candidates", "give a list of built-in names (builtin:native), candidate YAMLs or bundle folders")
        return []
    entries = []
    for i, item in enumerate(value):
        key = f"candidates[{i}]"
        expect = None
        if isinstance(item, dict):
            unknown = set(item) - {"candidate", "expect"}
            if unknown or "candidate" not in item:
                error(key, "a mapping takes `candidate:` (required) and `expect:` (a verdict)")
                continue
            item, expect = item["candidate"], item.get("expect")
            if expect is not None and expect not in VERDICTS:
                error(f"{key}.expect", f"expected one of {', '.join(VERDICTS)}, got {expect!r}")
                expect = None
        if not isinstance(item, str) or not item:
            error(key, f"expected a built-in name, a candidate YAML path or a bundle folder, got {item!r}")
            continue
        try:
            entry = _candidate_entry(item, base, expect, model, network, sizes)
        except LabInputError as exc:
            error(key, str(exc))
            continue
        except ValueError as exc:  # CandidateError
            error(key, f"{exc}")
            continue
        entries.append(entry)
    return entries


def _candidate_entry(written: str, base: Path, expect, model, network, sizes=()) -> CandidateEntry:
    from ..candidates import resolve
    from ..candidates.opaque import OpaqueCandidate

    path = Path(written)
    is_file = not written.startswith("builtin:") and (path.suffix.lower() in (".yaml", ".yml") or "/" in written
                                                      or (base / path).exists())
    target = str((base / path).resolve()) if is_file else (written if written.startswith("builtin:")
                                                           else f"builtin:{written}")
    if is_file and not Path(target).exists():
        raise LabInputError(f"{target}: no such candidate YAML or bundle folder (paths are relative to the spec file)")
    candidate = resolve(target)
    if isinstance(candidate, OpaqueCandidate):
        raise LabInputError(f"{written} is `model: opaque` (the reference-free gradient check): campaigns run "
                            f"model-based diagnoses; run it with `precision-lab diagnose --candidate {written}`")
    kind = "builtin" if candidate.family in ("builtin", "legitimate", "defect") else candidate.family
    if kind == "builtin":
        if not candidate.applies_to(network):
            raise LabInputError(f"built-in {candidate.name} does not apply to the network {network.name!r} "
                                f"({candidate.description}); drop it or change `model`")
        # built-ins know their verdict; those with none declared (native, fortran-replay) are the right builds
        expected = expect or candidate.expected or "roundoff"
    else:
        expected = expect
        own = getattr(candidate, "network", None)
        if model is not None and own is not None and own.spec != network.spec:
            raise LabInputError(f"{written} names its own model {own.name!r}; drop the spec's `model` or this candidate")
        if own is not None and kind == "command":  # its own network must take every size of the grid
            from ..model import ModelSpecError

            for height, width in sizes:
                try:
                    own.check_size(height, width)
                except ModelSpecError as exc:
                    raise LabInputError(f"{written}: its model does not take size {height}×{width} ({exc}); "
                                        f"change `sizes` or list it in another campaign") from None
    return CandidateEntry(written, target, candidate.name, kind, candidate.family, expected,
                          candidate_sha256(target, kind))


def candidate_sha256(target: str, kind: str) -> str:
    """The candidate's bytes: a built-in's name and the lab's version; a YAML and the files its commands
    and model name; every file of a bundle folder."""
    digest = hashlib.sha256()
    if kind == "builtin":
        digest.update(f"{target}\0{_version('precision-lab')}".encode())
        return digest.hexdigest()
    path = Path(target)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] + _named_files(path)
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _named_files(yaml_path: Path) -> list[Path]:
    """Files a candidate YAML names (program, scripts, model spec), resolved as the lab resolves them."""
    import yaml

    try:
        spec = yaml.safe_load(yaml_path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return []
    words = []
    for key in ("command", "command_float64"):
        if isinstance(spec.get(key), list):
            words += [str(w) for w in spec[key]]
    if isinstance(spec.get("model"), str):
        words.append(spec["model"])
    found = []
    for word in words:
        candidate = (yaml_path.parent / word) if not os.path.isabs(word) else Path(word)
        if "{" not in word and candidate.is_file():
            found.append(candidate.resolve())
    return sorted(set(found))


def _check_images(value, base: Path, sizes, error) -> list[tuple[str, str]]:
    images, too_small = [], []
    for i, item in enumerate(_as_list(value)):
        if item == "synthetic":
            images.append(("synthetic", "synthetic"))
            continue
        if not isinstance(item, str):
            error(f"images[{i}]", f"expected `synthetic`, a .mrc/.npy file or a folder of them, got {item!r}")
            continue
        where = (base / item).resolve()
        if where.is_dir():
            files = sorted(p for p in where.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not files:
                error(f"images[{i}]", f"{where} holds no {'/'.join(IMAGE_SUFFIXES)} files")
            labels = [f"{item.rstrip('/')}/{p.name}" for p in files]
        elif where.is_file() and where.suffix.lower() in IMAGE_SUFFIXES:
            files, labels = [where], [item]
        else:
            error(f"images[{i}]", f"{where}: no such {'/'.join(IMAGE_SUFFIXES)} file or folder "
                                  f"(paths are relative to the spec file)")
            continue
        for file, label in zip(files, labels):
            shape = _image_shape(file)
            if isinstance(shape, str):
                error(f"images[{i}]", shape)
                continue
            for height, width in sizes:
                if shape[0] < height or shape[1] < width:
                    too_small.append(f"images[{i}]: {label} is {shape[0]}×{shape[1]}, smaller than size "
                                     f"{height}×{width}; drop that size or that image")
            images.append((str(file), label))
    for line in too_small[:MAX_ERROR_LINES]:
        key, message = line.split(": ", 1)
        error(key, message)
    if len(too_small) > MAX_ERROR_LINES:
        error("images", f"… and {len(too_small) - MAX_ERROR_LINES} more image × size pairs too small")
    if not _as_list(value):
        error("images", "give at least one image source (`synthetic`, a file or a folder)")
    return list(dict.fromkeys(images))


def _image_shape(file: Path):
    """(H, W) of a micrograph from its header alone, or a one-line problem."""
    import numpy as np

    try:
        if file.suffix.lower() == ".npy":
            shape = np.load(file, mmap_mode="r", allow_pickle=False).shape
        else:
            import mrcfile

            with mrcfile.open(file, header_only=True, permissive=True) as mrc:
                shape = (int(mrc.header.ny), int(mrc.header.nx))
    except Exception as exc:  # noqa: BLE001 - any reader failure is one line naming the file
        return f"{file}: cannot read the image header ({type(exc).__name__}: {exc})"
    if len(shape) == 3:
        shape = shape[1:]
    if len(shape) != 2:
        return f"{file}: expected a 2-D image, got shape {tuple(shape)}"
    return int(shape[0]), int(shape[1])


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# one cell, on a worker


def run_cell(params: dict, threads: int | dict | None = None) -> list[dict]:
    """Diagnose one cell; the rows of the table (one per quantity, or one row naming the error).

    Runs in a Dask worker process (or in-process with --workers 0). `threads`: torch's intra-op
    threads for this cell, or {host: threads} for a cluster whose hosts differ.
    """
    import socket

    import numpy
    import torch

    started, clock = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    torch_threads = _threads_here(threads)
    if torch_threads:
        torch.set_num_threads(torch_threads)  # Dask's nanny sets OMP_NUM_THREADS=1; one cell may use its share
    base = dict(params, status="ok", error=None, worker=socket.gethostname(), torch_threads=torch.get_num_threads(),
                started=started.isoformat(timespec="seconds"), precision_lab_version=_version("precision-lab"),
                torch_version=torch.__version__, numpy_version=numpy.__version__)
    base.pop("target")
    base.pop("kind")
    try:
        rows, timing = _diagnose_cell(params)
    except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, the campaign goes on
        message = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, (LabInputError, ValueError, FileNotFoundError, PermissionError)):
            where = traceback.extract_tb(exc.__traceback__)[-1]
            message = f"{type(exc).__name__}: {message} ({Path(where.filename).name}:{where.lineno})"
        base.update(status="failed", error=message, seconds=time.perf_counter() - clock)
        return [base]
    seconds = time.perf_counter() - clock
    return [dict(base, **timing, **row, seconds=seconds) for row in rows]


def _threads_here(threads) -> int | None:
    if isinstance(threads, dict):
        try:
            from distributed import get_worker

            host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
        except (ImportError, ValueError):
            return None
        workers_here = threads.get(host, 1)
        return max(1, len(os.sched_getaffinity(0)) // workers_here)
    return threads


def _diagnose_cell(params: dict) -> tuple[list[dict], dict]:
    from contextlib import nullcontext

    from .. import probes as probe_set
    from ..candidates import resolve
    from ..conv.backends import native_flags
    from ..device import describe_device, resolve_device
    from ..diagnose import candidate_and_problem, diagnose

    where = resolve_device(params["device"])
    flags = dict(f.split("=", 1) for f in params["flags"].split(",") if f)
    target, note, context = params["target"], "", nullcontext()
    tf32 = flags.get("tf32")
    if params["kind"] == "builtin" and tf32:
        name = target.removeprefix("builtin:")
        if name in TF32_FAMILY:
            target = "builtin:" + TF32_VARIANT[(tf32, where.type)]
            note = f"tf32={tf32}: ran as {target}"
        elif where.type == "cuda":
            context = native_flags(fp32_precision="tf32" if tf32 == "on" else "ieee")
            note = f"tf32={tf32}: torch cuDNN/cuBLAS fp32_precision={'tf32' if tf32 == 'on' else 'ieee'}"
        else:
            note = f"tf32={tf32}: no effect on a CPU (no TF32 hardware)"
    clock = time.perf_counter()
    if params["kind"] == "bundle":
        candidate, problem = candidate_and_problem(None, target)
    else:
        candidate, problem = candidate_and_problem(
            target, None, (params["height"], params["width"]), params["batch"], params["seed"], params["model"],
            None if params["image"] == "synthetic" else params["image"], where)
    if params["kind"] == "command" and tf32:
        program = candidate.run.__self__
        if tf32 == "off":
            program.env = dict(program.env, NVIDIA_TF32_OVERRIDE="0")
        note = f"tf32={tf32}: " + ("NVIDIA_TF32_OVERRIDE=0 for the program" if tf32 == "off" else "libraries' default")
    problem_seconds = time.perf_counter() - clock
    with context:
        diagnosis = diagnose(candidate, problem, str(where), probe_set.select(params["probes"]))
    diagnose_seconds = time.perf_counter() - clock - problem_seconds
    info = describe_device(where)
    report = diagnosis.to_json()
    deciding = diagnosis.deciding()
    detail = deciding.layout_fix or deciding.format or deciding.cause or deciding.localisation
    quantities = {name: dict(entry, problem="requested") for name, entry in report["forward"].items()}
    quantities.update(report["parameters"])
    worst_name = max(quantities, key=lambda n: quantities[n]["bound_ratio"] or 0.0)
    expected = params["expected"]
    if params["kind"] == "builtin" and target != params["target"]:  # a flag chose another build: its own expectation
        expected = candidate.expected or "roundoff"
    cell = {"ran_as": candidate.name, "flags_applied": note or None, "expected": expected, "verdict": diagnosis.verdict,
            "claimed_precision": diagnosis.claimed_precision, "decided_by": report["decided_by"], "detail": detail,
            "worst_quantity": worst_name, "worst_bound_ratio": quantities[worst_name]["bound_ratio"],
            "device": str(where), "device_name": info.get("name"),
            "height": problem.height, "width": problem.width, "batch": problem.batch,
            "seed": problem.seed if problem.seed >= 0 else None,  # a static bundle does not know its seed (−1)
            "command": reproduce_command(params, target)}
    rows = []
    for name, q in quantities.items():
        rows.append(dict(cell, quantity=name, problem=q.get("problem"), quantity_verdict=q["verdict"],
                         **{k: q.get(k) for k in QUANTITY_NUMBERS}, elements=q.get("size"),
                         **{k: q.get(k) for k in QUANTITY_TEXTS}))
    return rows, {"problem_seconds": problem_seconds, "diagnose_seconds": diagnose_seconds}


#: evidence columns per quantity (precision_lab.compare.QuantityVerdict), numbers then words
QUANTITY_NUMBERS = ("max_abs_err", "mean_abs_err", "max_rel_err", "bound_ratio", "bound_max", "ulps", "cosine",
                    "sign_agreement", "exceeding", "second_ratio", "n_terms", "relu_flips")
QUANTITY_TEXTS = ("layout_fix", "format", "cause", "evidence")


def reproduce_command(params: dict, target: str | None = None) -> str:
    """The `precision-lab diagnose` command that repeats one cell (paths relative to where you run it)."""
    target = target or params["target"]
    if params["kind"] == "bundle":
        return shlex.join(["precision-lab", "diagnose", "--bundle", _shown_path(target)])
    words = ["precision-lab", "diagnose", "--candidate",
             _shown_path(target) if params["kind"] != "builtin" else target,
             "--size", f"{params['height']}x{params['width']}", "--batch", str(params["batch"]),
             "--seed", str(params["seed"])]
    if params["image"] != "synthetic":
        words += ["--image", _shown_path(params["image"])]
    if params.get("model"):
        words += ["--model", _shown_path(params["model"])]
    words += ["--device", params["device"], "--probes", params["probes"]]
    command = shlex.join(words)
    if params["kind"] == "command" and "tf32=off" in params["flags"]:
        command += "  # with NVIDIA_TF32_OVERRIDE: '0' added to the YAML's env"
    return command


def _shown_path(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# ---------------------------------------------------------------------------------------------
# the table


def schema():
    import pyarrow as pa

    text, integer, number = pa.string(), pa.int64(), pa.float64()
    columns = [
        ("campaign", text), ("key", text), ("status", text), ("error", text),
        ("candidate", text), ("candidate_name", text), ("ran_as", text), ("family", text), ("expected", text),
        ("candidate_sha256", text), ("image", text), ("image_label", text), ("seed", integer), ("height", integer),
        ("width", integer), ("batch", integer), ("flags", text), ("flags_applied", text), ("probes", text),
        ("model", text), ("device", text), ("device_name", text),
        ("verdict", text), ("claimed_precision", text), ("decided_by", text), ("detail", text),
        ("worst_quantity", text), ("worst_bound_ratio", number),
        ("quantity", text), ("problem", text), ("quantity_verdict", text),
        *[(name, integer if name in ("exceeding", "n_terms", "relu_flips") else number) for name in QUANTITY_NUMBERS],
        ("elements", integer), *[(name, text) for name in QUANTITY_TEXTS],
        ("command", text), ("seconds", number), ("problem_seconds", number), ("diagnose_seconds", number),
        ("started", text), ("worker", text), ("torch_threads", integer),
        ("precision_lab_version", text), ("torch_version", text), ("numpy_version", text),
    ]
    return pa.schema(columns)


def write_part(rows: list[dict], folder: Path) -> Path:
    """One cell's rows as `folder/<key>.parquet`: a temporary file renamed into place (atomic on POSIX)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sch = schema()
    table = pa.Table.from_pylist([{name: row.get(name) for name in sch.names} for row in rows], schema=sch)
    final = folder / f"{rows[0]['key']}.parquet"
    temporary = folder / f".{final.name}.{os.getpid()}.tmp"
    pq.write_table(table, temporary)
    os.replace(temporary, final)
    return final


def finished_keys(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.parquet")} if folder.is_dir() else set()


def failed_keys(folder: Path, keys) -> set[str]:
    import pyarrow.parquet as pq

    failed = set()
    for key in keys:
        status = pq.read_table(folder / f"{key}.parquet", columns=["status"]).column("status").to_pylist()
        if "failed" in status:
            failed.add(key)
    return failed


def consolidate(cells: list[Cell], folder: Path, out_file: Path):
    """Every finished cell of the spec, in grid order, as one table written atomically; returns it (pandas)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = [folder / f"{c.key}.parquet" for c in cells if (folder / f"{c.key}.parquet").exists()]
    table = pa.concat_tables([pq.read_table(p, schema=schema()) for p in parts]) if parts else schema().empty_table()
    temporary = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
    pq.write_table(table, temporary)
    os.replace(temporary, out_file)
    return table.to_pandas()


def read_table(out: str | Path):
    """The consolidated table of a campaign folder (pandas)."""
    import pandas as pd

    return pd.read_parquet(Path(out) / "campaign.parquet")


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class Outcome:
    cells: int
    skipped: int
    ran: int
    failed: int
    left: int
    table: object
    out: Path
    seconds: float
    report: Path | None = None


def run_campaign(spec: Spec, workers: int = 2, scheduler: str | None = None, threads: int | None = None,
                 max_cells: int | None = None, retry_failed: bool = False, report: bool = True,
                 progress: bool = True, say=print) -> Outcome:
    """Run every cell of `spec` not finished yet; returns what ran and the consolidated table."""
    clock = time.perf_counter()
    cells = list({cell.key: cell for cell in spec.cells()}.values())  # `native` and `builtin:native` are one cell
    parts = spec.out / "cells"
    try:
        parts.mkdir(parents=True, exist_ok=True)
        (spec.out / "spec.json").write_text(json.dumps({"spec": str(spec.path.resolve()), "name": spec.name,
                                                         "raw": spec.raw}, indent=1, default=str) + "\n")
    except OSError as exc:
        raise LabInputError(f"{spec.out}: cannot write the campaign folder ({exc.strerror}); choose --out") from None
    for stale in parts.glob(".*.tmp"):  # a part a killed run was writing: its cell runs again
        stale.unlink(missing_ok=True)
    done = finished_keys(parts) & {c.key for c in cells}
    if retry_failed:
        done -= failed_keys(parts, done)
    todo = [c for c in cells if c.key not in done]
    chosen = todo[:max_cells] if max_cells is not None else todo
    say(f"campaign {spec.name}: {len(cells)} cells, {len(done)} already finished, {len(chosen)} to run"
        + (f" now ({len(todo) - len(chosen)} left for later: --max-cells)" if len(chosen) < len(todo) else "")
        + f"; results in {spec.out}")
    failed = 0
    try:
        if chosen:
            failed = _run_cells(chosen, parts, workers, scheduler, threads, len(cells), len(done), progress, say)
    finally:  # interrupted too: the table holds every cell finished so far
        table = consolidate(cells, parts, spec.out / "campaign.parquet")
    outcome = Outcome(len(cells), len(done), len(chosen), failed, len(todo) - len(chosen), table, spec.out,
                      time.perf_counter() - clock)
    if report:
        from .report import write_report

        outcome.report = write_report(spec, table, spec.out / "report.html")
    return outcome


def _run_cells(cells: list[Cell], parts: Path, workers: int, scheduler: str | None, threads: int | None,
               total: int, already: int, progress: bool, say) -> int:
    from tqdm import tqdm

    bar = tqdm(total=total, initial=already, desc="campaign", unit="cell", disable=not progress, file=sys.stderr)
    failed = [0]

    def record(rows: list[dict]) -> None:
        write_part(rows, parts)
        if rows[0]["status"] == "failed":
            failed[0] += 1
            bar.write(f"cell failed: {rows[0]['candidate']} {rows[0]['image_label']} seed {rows[0]['seed']} "
                      f"{rows[0]['height']}x{rows[0]['width']}: {rows[0]['error']}")
        bar.update()
        bar.set_postfix(done=bar.n - failed[0] - already, failed=failed[0], remaining=total - bar.n)

    try:
        if workers == 0 and scheduler is None:  # in-process, one cell after another (the overhead baseline)
            for cell in cells:
                record(run_cell(cell.params(), threads))
        else:
            _on_dask(cells, workers, scheduler, threads, record, say)
    finally:
        bar.close()
    return failed[0]


def _on_dask(cells: list[Cell], workers: int, scheduler: str | None, threads: int | None, record, say) -> None:
    import logging

    from distributed import Client, LocalCluster, as_completed

    cluster = None
    if scheduler is None:
        dashboard = ":0" if _has_bokeh() else None  # any free port: several campaigns may share a host
        # processes, one thread each: every cell owns its worker, and torch's threads are set per cell
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=dashboard,
                               silence_logs=logging.ERROR)
        client = Client(cluster)
        threads = threads or max(1, len(os.sched_getaffinity(0)) // workers)
    else:
        try:  # an address (tcp://host:8786) or the file `dask scheduler --scheduler-file` wrote
            client = (Client(scheduler_file=scheduler, timeout="20s") if scheduler.endswith(".json")
                      else Client(scheduler, timeout="20s"))
        except (OSError, TimeoutError, ValueError) as exc:
            raise LabInputError(f"--scheduler {scheduler}: cannot reach the Dask scheduler ({exc})") from None
        if threads is None:
            hosts: dict[str, int] = {}
            for address in client.scheduler_info().get("workers", {}):
                host = address.split("://")[-1].rsplit(":", 1)[0]
                hosts[host] = hosts.get(host, 0) + 1
            threads = hosts
    try:
        link = client.dashboard_link if (cluster is None or _has_bokeh()) else None
        say(f"Dask: {len(client.scheduler_info().get('workers', {}))} workers at {client.scheduler.address}; "
            + (f"dashboard {link}" if link else "dashboard off (it needs `pip install bokeh`)"))
        futures = {client.submit(run_cell, cell.params(), threads, key=f"cell-{cell.key}", pure=False): cell
                   for cell in cells}
        for future in as_completed(list(futures)):
            try:
                rows = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker that died (memory, a crash) fails its cell only
                rows = [dict(futures[future].params(), status="failed",
                             error=f"{type(exc).__name__}: {exc}".splitlines()[0])]
            record(rows)
            future.release()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


# ---------------------------------------------------------------------------------------------
# command line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.yaml", help="the campaign spec (docs/campaigns.md)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--workers", default="2", help="worker processes of the local Dask cluster (default 2; "
                                                      "0 runs the cells in this process, one after another)")
    where.add_argument("--scheduler", metavar="ADDRESS", help="an existing Dask scheduler instead: tcp://host:8786 or "
                                                               "the JSON file of `dask scheduler --scheduler-file`")
    parser.add_argument("--threads", default=None, help="torch threads per cell (default: the cores of a worker's "
                                                        "host ÷ the workers on it)")
    parser.add_argument("--out", default=None, help="results folder (default: the spec's `out`, else "
                                                    "<spec folder>/<spec stem>-campaign)")
    parser.add_argument("--max-cells", default=None, help="run at most N unfinished cells, then stop (the rest "
                                                          "on the next run)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed cells again (default: skip them)")
    report = parser.add_mutually_exclusive_group()
    report.add_argument("--no-report", action="store_true", help="do not write OUT/report.html")
    report.add_argument("--report", action="store_true", help="only rewrite OUT/report.html from the finished cells")


def main(args: argparse.Namespace) -> int:
    import importlib.util

    from .. import options

    workers = options.nonnegative(args.workers, "--workers")
    needed = ("pyarrow",) if workers == 0 and not args.scheduler else ("distributed", "pyarrow")  # 0: in-process
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise LabInputError(f"campaign needs {' and '.join(missing)}: `make setup` installs them, or "
                            f"pip install 'dask[distributed]' pyarrow")
    threads = options.positive(args.threads, "--threads")
    max_cells = options.nonnegative(args.max_cells, "--max-cells")
    spec = load_spec(args.spec, args.out)
    if args.report:
        from .report import write_report

        if not (spec.out / "cells").is_dir():
            raise LabInputError(f"{spec.out}: no finished cells yet; run `precision-lab campaign {args.spec}` first")
        table = consolidate(spec.cells(), spec.out / "cells", spec.out / "campaign.parquet")
        print(f"report: {write_report(spec, table, spec.out / 'report.html')}")
        return 0
    outcome = run_campaign(spec, workers, args.scheduler, threads, max_cells, args.retry_failed,
                           report=not args.no_report, progress=sys.stderr.isatty())
    cells = outcome.table.drop_duplicates("key") if len(outcome.table) else outcome.table
    counts = cells.verdict.fillna("failed").value_counts().to_dict() if len(cells) else {}
    print(f"{outcome.ran} cells run ({outcome.failed} failed), {outcome.skipped} skipped as finished, "
          f"{outcome.left} left, in {outcome.seconds:.1f} s; verdicts: "
          + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))
    print(f"table: {outcome.out / 'campaign.parquet'}" + (f"\nreport: {outcome.report}" if outcome.report else ""))
    return 0 if outcome.failed == 0 else 1
