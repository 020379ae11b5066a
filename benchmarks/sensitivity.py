"""Sensitivity and false alarms of a diagnosis at 1024² with its default probes, against its targets.

    python benchmarks/sensitivity.py [--size 1024] [--batch 2] [--seed 0] [--seeds 100] [--large-seeds 2]
        [--parts slips,boundary,false-alarms,large] [--quick] [--device cpu] [--out FILE.md]

What a diagnosis (`precision-lab diagnose`, default probes) says about

1. `slips`: one element of one parameter's gradient slipped by a relative amount: g[k] + ε·|g[k]|,
   k chosen on each problem by rank in the candidate's own gradient (the largest |g|, or the one of
   median |g|), the same rule on the requested problem and on every probe, since a candidate is a
   program. Targets: ε = 0.1% of the largest element, 1% of a median one, caught (verdict ≠ roundoff)
   in every layer. Also the smallest ε caught, found by bisection on a quarter-decade grid (10⁻⁶ … 1),
   overall and on the requested problem alone.
2. `boundary`: one convolution's weight gradient that ignores the first image column, the last image
   row, or one 16×16 tile (rows and columns 16–31) of its upstream gradient; caught, by which
   problem, and the cause named.
3. `false-alarms`: every legitimate order of the zoo judged on `--seeds` seeds at each default probe's
   own size, batch and targets; the non-roundoff verdicts counted per candidate and probe.
4. `large`: every legitimate order on the requested problem (`--size`) for `--large-seeds` seeds.
6. `networks` (only when asked): on every example network at its natural size (the deep denoiser at 256²,
   above the size sampled propagation runs at, so its probes settle what its bound cannot), at
   `--network-seeds` seeds with the default probes, judged as diagnose judges (the worst of the problem and
   its probes, through decision.decide): each layer's gradients zeroed, each weight gradient 10% short (scaled by 0.9), the largest
   element of each weight gradient slipped by ε (smallest ε caught on the grid), and the native float32 run.
   `--network-spec SPEC:SIZE` runs the same on any model spec (benchmarks/networks/ holds networks
   unlike the examples: a GELU/tanh MLP classifier, a strided leaky-ReLU classifier, six sigmoid convolutions, a
   global-pool classifier, and a deeper and wider classifier).
5. `zoo` (only when asked): the whole zoo's confusion matrix at `--zoo-size` (default 128), judged on that
   problem alone, as before probes existed.

A diagnosis of an in-process candidate is its judgement on the requested problem and on each probe,
the worst counting (precision_lab.diagnosis). This script builds each problem's float64 reference and
the native float32 result once and judges every slipped result against them with the same `judge`
call `diagnose` makes (one problem at a time, so one 1024² reference is in memory at once); a caught
slip is caught by at least one problem, the smallest ε caught overall is the smallest over problems
(each problem's verdict is monotone in ε on the grid, checked by the bisection's end points).
`--quick`: 256², 20 seeds, one large seed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from precision_lab import probes as probe_set
from precision_lab.calibration import confusion_matrix, judge_zoo
from precision_lab.candidates import registry
from precision_lab.candidates.zoo import _edge_skipped
from precision_lab.compute import Result, forward_backward
from precision_lab.device import resolve_device
from precision_lab.ops import OPS, BackwardReplaced
from precision_lab.problem import Problem, make_problem, parse_size
from precision_lab.reference import reference
from precision_lab.decision import decide
from precision_lab.verdict import judge, worst
from precision_lab.provenance import run_recorded

#: the slips a diagnosis at 1024² with its default probes must catch (0.1% of the largest element, 1% of a median one)
TARGETS = {"largest": 1e-3, "median": 1e-2}
#: the grid of the bisection: quarter decades from 10⁻⁶ to 1 (the slip ε as a fraction of |g[k]|)
LEVELS = tuple(10.0 ** (e / 4) for e in range(-24, 1))
#: a tile of a GPU kernel's output (16×16 threads), placed one tile in from the corner so every probe has it
TILE = (16, 32)
PARTS = ("slips", "boundary", "false-alarms", "large", "zoo", "zoo-probes", "networks")
#: the example networks at their natural sizes (examples/models/), and the wide classifier
NETWORKS = {"small-unet": ("small-unet.json", 64), "dilated-resnet": ("dilated-resnet.yaml", 64),
            "lenet-classifier": ("lenet-classifier.json", 28), "tf-lenet": ("tf-lenet.json", 128),
            "wide-classifier": ("wide-classifier.json", 128), "deep-denoiser": ("deep-denoiser.json", 256)}
DEFAULT_PARTS = PARTS[:4]


@dataclass
class Case:
    """One problem of a diagnosis (the requested one or a probe), its reference and the native result."""

    name: str
    problem: Problem
    trace: object
    native: Result


def problems_of(size, batch: int, seed: int) -> list[tuple[str, Problem]]:
    """The requested problem and its default probes, as `diagnose` makes them."""
    main = make_problem(size, batch, seed)
    return [("requested", main)] + [(p.name, probe_set.probe_problem(p, main)) for p in probe_set.DEFAULT_PROBES]


def each_case(size, batch: int, seed: int, device):
    """Each problem in turn with its reference and native result (the previous one freed first)."""
    native = registry()["native"]
    for name, problem in problems_of(size, batch, seed):
        result = native.compute(problem, "float32", device)
        yield Case(name, problem, reference(problem, device), result)


def rank_index(grad: np.ndarray, rank: str) -> tuple[int, ...]:
    """The element of largest |g|, or of median |g| (the middle of the sorted magnitudes)."""
    magnitude = np.abs(grad).ravel()
    if rank == "largest":
        flat = int(np.argmax(magnitude))
    else:
        flat = int(np.argsort(magnitude, kind="stable")[magnitude.size // 2])
    return tuple(int(i) for i in np.unravel_index(flat, grad.shape))


def slipped(result: Result, name: str, rank: str, eps: float) -> Result:
    """`result` with g[k] + ε·|g[k]| in gradient `name`, k chosen by `rank` on this result's own gradient."""
    grad = np.array(result.grads[name], copy=True)
    index = rank_index(grad, rank)
    grad[index] = grad[index] + grad.dtype.type(eps) * abs(grad[index])
    return Result(result.loss, dict(result.grads, **{name: grad}), result.output, result.dtype, result.meta)


def verdict_of(case: Case, result: Result):
    # the defect doctor only names a cause, never changes a verdict: left out of the bisection
    return judge(result, case.trace, "float32", "slip", hypotheses=False)


def smallest_caught(case: Case, name: str, rank: str) -> tuple[float | None, int]:
    """Smallest grid level this problem's judgement catches (bisection), and the judgements it took."""
    caught = lambda i: verdict_of(case, slipped(case.native, name, rank, LEVELS[i])).verdict != "roundoff"  # noqa: E731
    calls = 1
    if not caught(len(LEVELS) - 1):
        return None, calls
    lo, hi = -1, len(LEVELS) - 1  # LEVELS[hi] caught; LEVELS[lo] not (lo = -1: nothing below the grid tried)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        calls += 1
        if caught(mid):
            hi = mid
        else:
            lo = mid
    return LEVELS[hi], calls


def slip_rows(cases_iter, parameters: list[str]) -> list[dict]:
    rows = {(n, r): {"quantity": n, "rank": r, "target": TARGETS[r], "caught_by": [], "smallest": None,
                     "smallest_by": None, "smallest_requested": None}
            for n in parameters for r in TARGETS}
    for case in cases_iter:
        start = time.time()
        for (name, rank), row in rows.items():
            at_target = verdict_of(case, slipped(case.native, name, rank, TARGETS[rank]))
            if at_target.verdict != "roundoff":
                row["caught_by"].append(f"{case.name} ({at_target.verdict})")
            level, _ = smallest_caught(case, name, rank)
            if case.name == "requested":
                row["smallest_requested"] = level
            if level is not None and (row["smallest"] is None or level < row["smallest"]):
                row["smallest"], row["smallest_by"] = level, case.name
        print(f"  slips judged on {case.name} ({case.problem.size_text}, batch {case.problem.batch}): "
              f"{time.time() - start:.0f} s", file=sys.stderr)
    return list(rows.values())


def _tile_skipped(tile: tuple[int, int]):
    def backward(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        clipped = g.clone()
        clipped[:, :, tile[0]:tile[1], tile[0]:tile[1]] = 0
        param_grads["weight"] = kernels.conv_weight_grad(xs[0], clipped, attrs, tuple(params["weight"].shape))
        return grads, param_grads

    return backward


BOUNDARY = {"first image column": _edge_skipped(row=False, first=True),
            "last image row": _edge_skipped(row=True, first=False),
            f"one 16×16 tile (rows/cols {TILE[0]}–{TILE[1] - 1})": _tile_skipped(TILE)}


def boundary_rows(cases_iter, device) -> list[dict]:
    rows = {}
    for case in cases_iter:
        start = time.time()
        convs = [layer for layer in case.problem.network.layers if layer.op == "conv2d"]
        for layer in convs:
            for what, backward in BOUNDARY.items():
                result = forward_backward(case.problem, "float32", device,
                                          rules={layer.index: BackwardReplaced(OPS["conv2d"], backward)})
                judgement = judge(result, case.trace, "float32", "boundary")
                row = rows.setdefault((layer.name, what), {"layer": layer.name, "skipped": what, "caught_by": [],
                                                           "requested_ratio": None, "cause": None})
                worst = judgement.quantities[f"{layer.name}.weight"].bound_ratio
                if case.name == "requested":
                    row["requested_ratio"] = worst
                if judgement.verdict != "roundoff":
                    row["caught_by"].append(f"{case.name} ({judgement.verdict}, {worst:.3g}× bound)")
                    row["cause"] = row["cause"] or judgement.cause
        print(f"  boundary slips on {case.name}: {time.time() - start:.0f} s", file=sys.stderr)
    return list(rows.values())


#: `--candidates`: the legitimate orders judged (None: all that apply)
CHOSEN: list[str] | None = None


def legitimate_names(network) -> list[str]:
    return [c.name for c in registry().values() if c.family == "legitimate" and c.applies_to(network)
            and (CHOSEN is None or c.name in CHOSEN)]


def false_alarm_rows(batch: int, seeds: int, device) -> tuple[list[dict], dict]:
    """Every legitimate order at each default probe's problem on `seeds` seeds: non-roundoff verdicts counted."""
    counts, worst, problems_text, fingerprint = {}, {}, {}, {}
    names = legitimate_names(make_problem(8, 1, 0).network)
    start = time.time()
    for seed in range(seeds):  # seeds outermost: a run stopped early still covers every probe alike
        main = make_problem(8, batch, seed)  # only its batch, seed and network reach the probe's problem
        for probe in probe_set.DEFAULT_PROBES:
            problem = probe_set.probe_problem(probe, main)
            problems_text[probe.name] = f"{problem.size_text}, batch {problem.batch}, {probe.targets} targets"
            table = judge_zoo(problem, device, names=names)
            for row in table.itertuples():
                key = (row.candidate, probe.name)
                counts[key] = counts.get(key, 0) + int(not row.correct)  # Candidate.accepts: a TF32 claim may be inconclusive
                worst[key] = max(worst.get(key, 0.0), float(row.worst_ratio))
                if row.fingerprint_max == row.fingerprint_max:  # computed (not NaN)
                    best, margin = fingerprint.get(row.candidate, (-1.0, math.inf))
                    fingerprint[row.candidate] = (max(best, float(row.fingerprint_max)),
                                                  min(margin, float(row.fingerprint_margin)))
                if not row.correct:
                    print(f"  FALSE ALARM: {row.candidate} on {probe.name}, seed {seed}: {row.verdict} "
                          f"({row.detail or row.cause}, worst error ÷ bound {row.worst_ratio:.3g})", file=sys.stderr)
        print(f"  false alarms: seeds 0…{seed} done, {sum(counts.values())} non-roundoff verdicts, "
              f"{time.time() - start:.0f} s", file=sys.stderr, flush=True)
    rows = [{"candidate": name, **{f"{p.name}": counts[(name, p.name)] for p in probe_set.DEFAULT_PROBES},
             "worst_ratio": max(worst[(name, p.name)] for p in probe_set.DEFAULT_PROBES),
             "fingerprint_max": fingerprint.get(name)} for name in names]
    return rows, problems_text


def large_rows(size, batch: int, seeds: int, device) -> list[dict]:
    rows = {}
    names = legitimate_names(make_problem(8, 1, 0).network)
    for seed in range(seeds):
        start = time.time()
        table = judge_zoo(make_problem(size, batch, seed), device, names=names)
        for row in table.itertuples():
            entry = rows.setdefault(row.candidate, {"candidate": row.candidate, "seeds": 0, "not_roundoff": 0,
                                                    "worst_ratio": 0.0})
            entry["seeds"] += 1
            entry["not_roundoff"] += int(not row.correct)
            entry["worst_ratio"] = max(entry["worst_ratio"], float(row.worst_ratio))
        print(f"  legitimate orders at {size}, seed {seed}: {time.time() - start:.0f} s", file=sys.stderr)
    return list(rows.values())


def zoo_probe_rows(size, batch: int, seed: int, device) -> list[dict]:
    """Every zoo candidate judged as `diagnose` judges it: the requested problem and the default probes, the
    overall verdict the worst, its transform or format from the problem that decided it."""
    rows = {}
    for name, problem in problems_of(size, batch, seed):
        start = time.time()
        for row in judge_zoo(problem, device).itertuples():
            entry = rows.setdefault(row.candidate, {"candidate": row.candidate, "expected": row.expected,
                                                    "expected_detail": _text(row.expected_detail), "verdicts": {}})
            entry["verdicts"][name] = (row.verdict, _text(row.detail), bool(row.correct))
        print(f"  zoo on {name} ({problem.size_text}): {time.time() - start:.0f} s", file=sys.stderr)
    for entry in rows.values():
        overall = worst([v for v, _, _ in entry["verdicts"].values()])
        decided_by = "requested" if entry["verdicts"]["requested"][0] == overall else next(
            n for n, (v, _, _) in entry["verdicts"].items() if v == overall)
        entry.update(verdict=overall, detail=entry["verdicts"][decided_by][1], decided_by=decided_by,
                     requested=entry["verdicts"]["requested"][0])
        entry["correct"] = overall == entry["expected"] and entry["verdicts"][decided_by][2]
    return list(rows.values())


def network_rows(seeds: int, batch: int, device, chosen: list[str]) -> list[dict]:
    """Per network and layer: zeroed and 10%-short gradients caught on how many seeds, the smallest ε caught
    for the largest weight-gradient element (worst over seeds), and native float32 judged roundoff."""
    from pathlib import Path

    from precision_lab.model import load_model

    models = Path(__file__).resolve().parents[1] / "examples" / "models"
    rows = []
    for label, (spec, size) in NETWORKS.items():
        if label not in chosen:
            continue
        network = load_model(models / spec)
        stats: dict[str, dict] = {}
        native_ok = 0
        for seed in range(seeds):
            main = make_problem(size, batch, seed, network=network)
            problems = [main] + [probe_set.probe_problem(p, main) for p in probe_set.DEFAULT_PROBES]
            cases = []
            for problem in problems:
                trace = reference(problem)
                cases.append((trace, forward_backward(problem, "float32", device)))

            def verdict(change) -> str:
                judged = [judge(change(result), trace, hypotheses=False) for trace, result in cases]
                # the one decision diagnose makes: what the requested problem's bound cannot certify, the probes may
                return decide(judged[0], [(probe_set.ProbeRun.of(p, problem), j) for p, problem, j
                                          in zip(probe_set.DEFAULT_PROBES, problems[1:], judged[1:])]).verdict

            native_ok += verdict(lambda r: r) == "roundoff"
            for layer in network.parametrised_layers:
                names = [n for n in network.parameter_names if network.layer_of(n) is layer]
                weight = next(n for n in names if n.endswith("weight"))  # conv's weight, attention's in_proj_weight
                entry = stats.setdefault(layer.name, {"zeroed": 0, "short": 0, "eps": 0.0})
                entry["zeroed"] += verdict(lambda r: _with(r, {n: np.zeros_like(r.grads[n]) for n in names})) != "roundoff"
                entry["short"] += verdict(lambda r: _with(r, {weight: r.grads[weight] * np.float32(0.9)})) != "roundoff"
                # bisection on the grid (a verdict is monotone in ε): the smallest level caught, None if none
                low, high = -1, len(LEVELS) - 1
                if verdict(lambda r: _with(r, {weight: _slip_largest(r.grads[weight], LEVELS[high])})) == "roundoff":
                    low = high = len(LEVELS)
                while high - low > 1:
                    mid = (low + high) // 2
                    if verdict(lambda r: _with(r, {weight: _slip_largest(r.grads[weight], LEVELS[mid])})) != "roundoff":
                        high = mid
                    else:
                        low = mid
                caught = LEVELS[high] if high < len(LEVELS) else None
                entry["eps"] = max(entry["eps"], caught if caught is not None else math.inf)
        for name, entry in stats.items():
            rows.append({"network": f"{label} ({size}²)", "layer": name, "seeds": seeds, **entry,
                         "native_roundoff": native_ok})
        print(f"  {label}: done", file=sys.stderr)
    return rows


def _with(result: Result, grads: dict) -> Result:
    return Result(result.loss, {**result.grads, **grads}, result.output, result.dtype, dict(result.meta))


def _slip_largest(grad: np.ndarray, eps: float) -> np.ndarray:
    out = grad.copy()
    k = np.unravel_index(np.argmax(np.abs(grad)), grad.shape)
    out[k] += eps * abs(out[k])
    return out


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _pct(value: float | None) -> str:
    if value is None:
        return "not caught (≤ 100%)"
    return f"{value * 100:.3g}%"


def _matrix_lines(matrix) -> list[str]:
    return (["| expected \\ given | " + " | ".join(matrix.columns) + " |", "|---" * (len(matrix.columns) + 1) + "|"]
            + [f"| {name} | " + " | ".join(str(int(v)) for v in row) + " |" for name, row in matrix.iterrows()])


def markdown(args, size_text: str, figures: dict) -> str:
    # the networks part has its own sizes and seeds (in its table): the requested problem is the other parts'
    problem = (f"requested problem {size_text}, batch {args.batch}, seed {args.seed}" if set(figures) - {"networks"}
               else f"each network at the size in its row, batch {args.batch}, seeds 0–{args.network_seeds - 1}")
    lines = [f"Measured by `{' '.join(['python', 'benchmarks/sensitivity.py'] + sys.argv[1:])}` "
             f"({problem}; probes "
             + ", ".join(f"`{p.name}`" for p in probe_set.DEFAULT_PROBES) + f"; device {args.device}).", ""]
    if "slips" in figures:
        lines += ["**Single-element slips** (g[k] + ε·|g[k]|, k the largest or a median-magnitude element of the "
                  "candidate's own gradient on each problem):", "",
                  "| quantity | element | target ε | caught at target by | smallest ε caught | by | on the requested "
                  "problem alone |", "|---|---|---|---|---|---|---|"]
        for row in figures["slips"]:
            lines.append(f"| {row['quantity']} | {row['rank']} | {_pct(row['target'])} | "
                         f"{', '.join(row['caught_by']) or '**missed**'} | {_pct(row['smallest'])} | "
                         f"{row['smallest_by'] or '–'} | {_pct(row['smallest_requested'])} |")
        lines.append("")
    if "boundary" in figures:
        lines += ["**Boundary slips** (the weight gradient of one convolution ignores part of its upstream gradient):",
                  "", "| layer | skipped | caught by | error ÷ bound on the requested problem | cause named |",
                  "|---|---|---|---|---|"]
        for row in figures["boundary"]:
            lines.append(f"| {row['layer']} | {row['skipped']} | {'; '.join(row['caught_by']) or '**missed**'} | "
                         f"{row['requested_ratio']:.3g} | {row['cause'] or '–'} |")
        lines.append("")
    if "false-alarms" in figures:
        rows, problems_text = figures["false-alarms"]
        lines += [f"**False alarms**: legitimate orders, {args.seeds} seeds (0…{args.seeds - 1}) at each probe's "
                  "problem; the count of verdicts other than `roundoff` (`inconclusive` allowed for the honest TF32 "
                  "claim, whose bound may certify nothing: Candidate.accepts):", "",
                  "| candidate | " + " | ".join(f"{name} ({text})" for name, text in problems_text.items())
                  + " | worst error ÷ bound | fingerprint: largest r; least threshold − r |",
                  "|---" * (len(problems_text) + 3) + "|"]
        for row in rows:
            corr = "–" if row["fingerprint_max"] is None else "{:.3f}; {:.3f}".format(*row["fingerprint_max"])
            lines.append(f"| {row['candidate']} | " + " | ".join(f"{row[name]}/{args.seeds}" for name in problems_text)
                         + f" | {row['worst_ratio']:.3g} | {corr} |")
        lines.append("")
    if "large" in figures:
        lines += [f"**Legitimate orders at {size_text}**, batch {args.batch}, seeds 0…{args.large_seeds - 1} "
                  "(the requested problem's judgement):", "",
                  "| candidate | seeds | not roundoff | worst error ÷ bound |",
                  "|---|---|---|---|"]
        for row in figures["large"]:
            lines.append(f"| {row['candidate']} | {row['seeds']} | {row['not_roundoff']} | {row['worst_ratio']:.3g} |")
        lines.append("")
    if "zoo" in figures:
        table = figures["zoo"]
        lines += [f"**The zoo at {args.zoo_size}²** (requested problem only): "
                  f"{int(table.correct.sum())} of {len(table)} "
                  "candidates in their class, naming the expected transform or format; rows expected, columns given:",
                  "", *_matrix_lines(confusion_matrix(table)), ""]
        wrong = table[~table.correct]
        lines += [f"- {row.candidate}: expected {row.expected} {row.expected_detail or ''}, given {row.verdict} "
                  f"{row.detail or ''}" for row in wrong.itertuples()] + ([""] if len(wrong) else [])
    if "zoo-probes" in figures:
        rows = figures["zoo-probes"]
        lines += [f"**The zoo at {size_text} with the default probes** (as `diagnose` judges: overall the worst): "
                  f"{sum(r['correct'] for r in rows)} of {len(rows)} candidates in their class, naming the expected "
                  "transform or format.", "",
                  "| candidate | expected | requested problem alone | overall (decided by) |", "|---|---|---|---|"]
        for r in rows:
            expected = f"{r['expected']} {r['expected_detail']}".strip()
            lines.append(f"| {r['candidate']} | {expected} | {r['requested']} | {r['verdict']} "
                         f"{r['detail']} ({r['decided_by']}){'' if r['correct'] else ' **wrong**'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default=None, help="requested problem N or HxW (default 1024; --quick: 256)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per probe for false alarms (default 100; --quick: 20)")
    parser.add_argument("--large-seeds", type=int, default=None,
                        help="seeds for the legitimate orders at --size (default 2; --quick: 1)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated among {', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--zoo-size", default="128", help="image size of the zoo's confusion matrix (default 128)")
    parser.add_argument("--quick", action="store_true", help="256², 20 seeds per probe, one large seed")
    parser.add_argument("--candidates", help="false-alarms and large: only these legitimate orders (comma-separated)")
    parser.add_argument("--network-seeds", type=int, default=3, help="seeds of the networks part (default 3)")
    parser.add_argument("--networks", default=None, help="networks part: which (comma-separated; default all)")
    parser.add_argument("--network-spec", action="append", default=[], metavar="SPEC:SIZE",
                        help="networks part: a model spec of your own at that image size (repeatable; with it, "
                        "only the specs given unless --networks names examples too)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the markdown here (default: stdout only)")
    args = parser.parse_args(argv)
    args.size = args.size or ("256" if args.quick else "1024")
    args.seeds = args.seeds or (20 if args.quick else 100)
    args.large_seeds = args.large_seeds or (1 if args.quick else 2)
    parts = [p.strip() for p in args.parts.split(",")]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    if args.candidates:
        global CHOSEN
        CHOSEN = [name.strip() for name in args.candidates.split(",")]
        unknown = [n for n in CHOSEN if n not in registry() or registry()[n].family != "legitimate"]
        if unknown:
            parser.error(f"--candidates: not legitimate orders of the zoo: {', '.join(unknown)}")
    chosen = [n.strip() for n in args.networks.split(",")] if args.networks else ([] if args.network_spec
                                                                                    else list(NETWORKS))
    for item in args.network_spec:
        spec, _, size = item.rpartition(":")
        if not spec or not size.isdigit() or not Path(spec).is_file():
            parser.error(f"--network-spec {item!r}: expected SPEC:SIZE with an existing spec file and an integer size")
        NETWORKS[Path(spec).stem] = (str(Path(spec).resolve()), int(size))
        chosen.append(Path(spec).stem)
    device = resolve_device(args.device)
    torch.manual_seed(0)
    size_text = "×".join(str(s) for s in parse_size(args.size))
    figures, started = {}, time.time()
    parameters = list(make_problem(8, 1, 0).network.parameter_names)
    if "slips" in parts:
        print("single-element slips…", file=sys.stderr)
        figures["slips"] = slip_rows(each_case(args.size, args.batch, args.seed, device), parameters)
    if "boundary" in parts:
        print("boundary slips…", file=sys.stderr)
        figures["boundary"] = boundary_rows(each_case(args.size, args.batch, args.seed, device), device)
    if "false-alarms" in parts:
        print("false alarms…", file=sys.stderr)
        figures["false-alarms"] = false_alarm_rows(args.batch, args.seeds, device)
    if "large" in parts:
        print(f"legitimate orders at {size_text}…", file=sys.stderr)
        figures["large"] = large_rows(args.size, args.batch, args.large_seeds, device)
    if "zoo" in parts:
        print(f"the zoo at {args.zoo_size}…", file=sys.stderr)
        table = judge_zoo(make_problem(args.zoo_size, args.batch, args.seed), device)
        figures["zoo"] = table
    if "zoo-probes" in parts:
        print(f"the zoo at {size_text} with its probes…", file=sys.stderr)
        figures["zoo-probes"] = zoo_probe_rows(args.size, args.batch, args.seed, device)
    if "networks" in parts:
        print("the example networks…", file=sys.stderr)
        rows = network_rows(args.network_seeds, args.batch, device, chosen)
        lines = [f"\n### Example networks ({args.network_seeds} seeds, default probes)\n",
                 "| network | layer | zeroed → not roundoff | weight gradient 10% short → not roundoff | "
                 "smallest ε caught (largest element, worst seed) | native float32 roundoff |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['network']} | {r['layer']} | {r['zeroed']}/{r['seeds']} | {r['short']}/{r['seeds']} | "
                  f"{_text(r['eps'])} | {r['native_roundoff']}/{r['seeds']} |" for r in rows]
        print("\n".join(lines))
    text = markdown(args, size_text, figures) + f"\n({time.time() - started:.0f} s in all)\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    missed = [r for r in figures.get("slips", []) if not r["caught_by"]] + \
             [r for r in figures.get("boundary", []) if not r["caught_by"]]
    alarms = sum(1 for r in figures.get("false-alarms", ([], {}))[0]
                 for p in probe_set.DEFAULT_PROBES if r[p.name]) + \
        sum(1 for r in figures.get("large", []) if r["not_roundoff"])
    print(f"missed slips: {len(missed)}; candidate×problem cells with false alarms: {alarms}", file=sys.stderr)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
