"""Regenerate the sample micrographs of data/micrographs/ byte for byte (data/README.md says how they are made).

    .venv/bin/python data/make_sample_micrographs.py           # write them
    .venv/bin/python data/make_sample_micrographs.py --check   # compare with the shipped files, exit 1 if any differs

Each is the noisy image of precision_lab.problem.synthetic_micrograph (Poisson counts at 20
electrons per pixel, so whole numbers), stored as 16-bit integers (MRC mode 1) with mrcfile: the
counts fit exactly, and a counting-mode camera writes the same kind of file.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "micrographs"

#: file name → (side of the square synthetic micrograph, seed, rows kept: None for all, else (first, stop))
SAMPLES = {
    "synthetic-1024-seed101.mrc": (1024, 101, None),
    "synthetic-512x768-seed102.mrc": (768, 102, (128, 640)),  # a non-square crop: rows 128-639 of a 768² image
    "synthetic-256-seed103.mrc": (256, 103, None),
}


def sample_counts(side: int, seed: int, rows: tuple[int, int] | None) -> np.ndarray:
    """The electron counts of one sample, as int16 (exact: Poisson counts at dose 20 stay far below 2¹⁵)."""
    from precision_lab.problem import synthetic_micrograph

    noisy, _ = synthetic_micrograph(side, seed)
    if rows is not None:
        noisy = noisy[rows[0]:rows[1]]
    counts = np.rint(noisy)
    if not np.array_equal(counts, noisy) or counts.min() < 0 or counts.max() > np.iinfo(np.int16).max:
        raise ValueError(f"seed {seed}: the synthetic micrograph is not whole counts within int16")
    return counts.astype(np.int16)


def write_sample(path: Path, counts: np.ndarray, label: str) -> None:
    import mrcfile

    with mrcfile.new(path, overwrite=True) as mrc:
        mrc.set_data(counts)
        # mrcfile labels a new file "Created by mrcfile.py <time>": a fixed label keeps the bytes reproducible
        mrc.header.label[0] = label.encode("ascii")[:80]
        mrc.header.nlabl = 1


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_all(folder: Path) -> dict[str, str]:
    """Write every sample into `folder`; returns name → SHA-256."""
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, (side, seed, rows) in SAMPLES.items():
        label = f"precision-lab synthetic_micrograph({side}, seed={seed})" + (f" rows {rows[0]}-{rows[1] - 1}" if rows else "")
        write_sample(folder / name, sample_counts(side, seed, rows), label)
        digests[name] = sha256(folder / name)
    return digests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="regenerate into a temporary folder and compare")
    args = parser.parse_args(argv)
    if not args.check:
        for name, digest in write_all(FOLDER).items():
            print(f"{digest}  micrographs/{name}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_all(Path(tmp))
    differing = [name for name, digest in fresh.items()
                 if not (FOLDER / name).is_file() or sha256(FOLDER / name) != digest]
    for name in differing:
        print(f"differs from a fresh regeneration: data/micrographs/{name}", file=sys.stderr)
    print("all samples are byte-identical to a fresh regeneration" if not differing else "", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
