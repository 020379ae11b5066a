"""Probes: a few small problems judged beside the one asked for (docs/design.md, "Probes").

Boundary and indexing bugs shrink as 1/H while the rounding bound grows as √n: a gradient that
ignores one image column is within the float32 bound at 1024² and far outside it at 64². A
square image cannot tell some H/W swaps apart; batch 2 hides some batch bugs; a smooth upstream
gradient hides others. So a diagnosis judges, besides the requested problem, these cheap ones:

| probe | size | batch | why |
|---|---|---|---|
| `odd-61x67` | 61×67 | as asked | odd and non-square: an H/W swap shows, and a slip of one row or column is 1/61 of the image, not 1/1024 |
| `odd-33x47-batch3` | 33×47 | 3 | batch 3 and another odd size: bugs that read only some samples or mix the batch axis with another |
| `seed1-random-targets` | 45×39 | as asked | another seed and random targets: an upstream gradient without smooth structure, where slips that cancel on smooth gradients show |

A network that cannot take a size (an upsample that must undo a stride, a "same" stride, attention's cap; strides
and pools floor as PyTorch's, so odd sizes run) gets the nearest size it takes, odd and
non-square where it can, never one the size parser refuses (each side ≥ problem.MIN_SIDE). A
network with a fixed input size (a flatten feeding a linear layer) keeps the requested problem's
size: another size of the same area (3×12 for 6×6) would change what the linear layer reads, so
its probes vary batch, seed and targets there instead, and say so. Probes use synthetic micrographs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from .errors import LabInputError
from .sizes import MIN_SIDE

if TYPE_CHECKING:  # `--probes` is checked by the CLI before torch is imported
    from .problem import Problem


@dataclass(frozen=True)
class Probe:
    name: str
    size: tuple[int, int]
    batch: int | None  # None: the requested problem's batch
    seed_offset: int
    targets: str
    why: str


DEFAULT_PROBES = (
    Probe("odd-61x67", (61, 67), None, 0, "task",
          "odd and non-square: an H/W swap shows, and a slip of one row or column is 1/61 of the image"),
    Probe("odd-33x47-batch3", (33, 47), 3, 0, "task",
          "batch 3 and another odd size: bugs that read only some samples or mix the batch axis with another"),
    Probe("seed1-random-targets", (45, 39), None, 1, "random",
          "another seed and random targets: an upstream gradient without smooth structure"),
)
PROBES = {probe.name: probe for probe in DEFAULT_PROBES}


def select(spec: str | None) -> list[Probe]:
    """Probes from `--probes`: none, default, or a comma-separated list of names."""
    if spec is None or spec == "default":
        return list(DEFAULT_PROBES)
    if spec == "none":
        return []
    chosen = []
    for name in (part.strip() for part in spec.split(",")):
        if name not in PROBES:
            raise LabInputError(f"--probes: unknown probe {name!r}: choose none, default, or names among "
                                f"{', '.join(PROBES)}")
        chosen.append(PROBES[name])
    return chosen


#: how a probe of a fixed-size network differs from the requested problem besides its own batch,
#: seed and targets: the odd-size probe becomes one more sample and another seed at the same size
FIXED_SIZE_EXTRA = {"odd-61x67": (1, 2)}


def fixed_size_note(network, main: Problem) -> str | None:
    """What the probes do instead of other sizes when `network` takes one input size only."""
    if not network.has_fixed_size:
        return None
    return (f"the network takes {main.height}×{main.width} only (a flatten feeds a linear layer): the probes "
            f"vary batch, seed and targets at that size")


def probe_size(probe: Probe, network, main_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """The probe's size, or the nearest the network takes (odd and non-square first, each side ≥ MIN_SIDE);
    for a fixed-size network, the requested problem's size `main_size`."""
    if network.has_fixed_size and main_size is not None:
        return main_size
    height, width = probe.size
    if network.fits(height, width):
        return height, width
    near = [hw for hw in network.sizes_near(height, width, limit=64) if min(hw) >= MIN_SIDE][:32]
    if not near:
        return network.default_size(max(height, width))
    preferred = [hw for hw in near if hw[0] != hw[1] and hw[0] % 2 and hw[1] % 2]
    non_square = [hw for hw in near if hw[0] != hw[1]]
    return (preferred or non_square or near)[0]


@dataclass(frozen=True)
class ProbeRun:
    """A probe as it ran: its name says what ran (size, batch, seed, targets), `kind` which default probe it is."""

    kind: str
    why: str
    height: int
    width: int
    batch: int
    seed: int
    targets: str
    #: the candidate's float64 build on this probe (decision.Float64Build), run where its bound left a quantity open
    float64_build: object = field(default=None, compare=False)

    @property
    def name(self) -> str:
        """'61x67-batch2-seed0', '45x39-batch2-seed1-random-targets': the label is what ran, not what was planned."""
        return (f"{self.height}x{self.width}-batch{self.batch}-seed{self.seed}"
                + ("-random-targets" if self.targets == "random" else ""))

    def text(self) -> str:
        return f"{self.height}×{self.width}, batch {self.batch}, seed {self.seed}, {self.targets} targets"

    @classmethod
    def of(cls, probe: Probe, problem: Problem) -> "ProbeRun":
        return cls(probe.name, probe.why, problem.height, problem.width, problem.batch, problem.seed, problem.targets)

    @classmethod
    def of_size(cls, problem: Problem) -> "ProbeRun":
        """Another size of a sweep (notebooks 03 and 05), judged as a problem of its own."""
        return cls("sweep-size", "another size of the sweep (not a probe: the experiment's own problem)", problem.height, problem.width, problem.batch,
                   problem.seed, problem.targets)


def probe_problem(probe: Probe, main: Problem) -> Problem:
    """The probe's problem for the network of `main`."""
    from .problem import make_problem

    network = main.network
    extra_batch, extra_seed = FIXED_SIZE_EXTRA.get(probe.name, (0, 0)) if network.has_fixed_size else (0, 0)
    return make_problem(probe_size(probe, network, (main.height, main.width)),
                        (probe.batch or main.batch) + extra_batch, max(main.seed, 0) + probe.seed_offset + extra_seed,
                        network=network, targets=probe.targets)
