"""The campaign spec: a grid read from YAML, every key checked, and the cells it lists.

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

A cell's key hashes its parameters and its candidate's bytes (the YAML and the program files it
names, a bundle's files): a rerun skips cells whose key has a part file (precision_lab.campaign.store).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ..errors import LabInputError

#: keys a campaign spec may have
SPEC_KEYS = ("name", "candidates", "images", "seeds", "sizes", "batch", "flags", "probes", "device", "model", "out")
#: precision flags and their values (what each does to each kind of candidate: precision_lab.campaign.cell)
FLAGS = {"tf32": ("on", "off")}
#: what precision_lab.problem.load_micrograph reads
IMAGE_SUFFIXES = (".mrc", ".mrcs", ".map", ".npy")
#: a spec is a few dozen lines; anything this large is the wrong file (and is not parsed)
MAX_SPEC_BYTES = 1 << 20
#: at most this many error lines are shown for one kind of spec error (a folder of 500 images …)
MAX_ERROR_LINES = 12


class CampaignSpecError(LabInputError):
    """A campaign spec that cannot run: one line per problem, each naming the key and the fix."""


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
        digest.update(f"{target}\0{version_of('precision-lab')}".encode())
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


def version_of(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
