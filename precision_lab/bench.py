"""`precision-lab bench`: the benchmark ratios of issue 5, printed (not timed tests).

1. float64 reference ÷ float32 native forward + backward, same problem, same process, runs
   interleaved and the fastest of `--repeats` kept for each (a busy machine slows both alike);
2. a diagnosis of a float32 command candidate (`precision-lab diagnose --candidate FILE.yaml`)
   ÷ the candidate's own run (interleaved, fastest of `--repeats` each), and the diagnosis's
   peak resident memory (the largest process, and the lab and the program together);
3. a table of the convolution algorithms: time and worst error ÷ bound at one size.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from .errors import LabInputError
from .paths import ROOT
from .problem import forward_backward, make_problem

#: issue 5, item 4: the float64 reference within 2× of the float32 native forward + backward
REFERENCE_TARGET = 2.0
#: issue 5, item 5: a diagnosis within 4× of the candidate's own run, peaking under 3 GB
DIAGNOSIS_TARGET, DIAGNOSIS_MEMORY_TARGET_GB = 4.0, 3.0
DEFAULT_CANDIDATE = ROOT / "examples" / "python" / "candidate.yaml"
PARTS = ("reference", "diagnose", "algorithms")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=1024, help="image size (default 1024, the seed scale)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="problem seed (default 0)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per timing; the fastest counts (default 3)")
    parser.add_argument("--candidate", default=str(DEFAULT_CANDIDATE),
                        help="float32 command candidate YAML for the diagnosis cost (default examples/python/candidate.yaml)")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    parser.add_argument("--algorithms-size", type=int, default=256, help="image size of the algorithms table (default 256)")
    parser.add_argument("--check-stock", action="store_true",
                        help="also time stock PyTorch float64 and check the reference agrees with it (slow: ~6-20× float32)")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON to this file")


def _timed(fn):
    gc.collect()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def reference_ratio(problem, repeats: int = 3, check_stock: bool = False) -> dict:
    """Fastest float32 native and float64 reference forward + backward, interleaved, and their ratio."""
    from .reference import agreement, reference, stock_reference

    float32_s, float64_s = [], []
    for _ in range(repeats):
        float32_s.append(_timed(lambda: forward_backward(problem, "float32"))[0])
        seconds, trace = _timed(lambda: reference(problem))
        float64_s.append(seconds)
        if not check_stock:
            del trace
    out = {"float32_native_s": min(float32_s), "float64_reference_s": min(float64_s),
           "ratio": min(float64_s) / min(float32_s), "target": REFERENCE_TARGET,
           "float32_runs_s": float32_s, "float64_runs_s": float64_s, "reference_conv": "direct (shift-and-GEMM)"}
    if check_stock:
        seconds, stock = _timed(lambda: stock_reference(problem))
        out.update(stock_float64_s=seconds, stock_ratio=seconds / min(float32_s),
                   max_relative_difference_to_stock=max(agreement(trace, stock).values()))
    return out


def _diagnosis_unavailable(candidate: Path) -> str | None:
    if importlib.util.find_spec("precision_lab.diagnose") is None:
        return "precision_lab.diagnose is not written yet"
    if importlib.util.find_spec("precision_lab.candidates.command") is None:
        return "command candidates (precision_lab.candidates.command) are not written yet"
    if not candidate.exists():
        return f"{candidate}: no such candidate YAML"
    return None


#: seconds between samples of the diagnosis's process-tree memory (the lab and the program it runs)
MEMORY_SAMPLE_S = 0.01


def _tree_rss_sampler(pid: int, peak: list[float], stop: threading.Event) -> None:
    """Largest sum of resident memory over `pid` and its descendants, sampled until `stop`: the
    candidate's program runs beside the lab's reference, so their peaks may add up."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.is_set():
        total = 0
        try:
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += process.memory_info().rss
        except psutil.Error:
            return
        peak[0] = max(peak[0], total)
        stop.wait(MEMORY_SAMPLE_S)


def _one_diagnosis(command: list[str]) -> tuple[float, float, float, int, list[str]]:
    """Wall time, peak memory (GB: largest single process, and the process tree summed) and exit
    code of one `diagnose` child, and its stderr lines."""
    peak, stop = [0.0], threading.Event()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        sampler = threading.Thread(target=_tree_rss_sampler, args=(child.pid, peak, stop), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        stop.set()
        sampler.join()
        child.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        error_lines = stderr.read().decode(errors="replace").strip().splitlines()
    # ru_maxrss (KiB on Linux) is the largest single process; the sampled sum covers the overlap
    single_gb = usage.ru_maxrss / 2 ** 20
    return seconds, single_gb, max(single_gb, peak[0] / 2 ** 30), child.returncode, error_lines


def diagnosis_cost(candidate: Path, size: int, batch: int, seed: int, repeats: int = 1) -> dict:
    """Wall time and peak memory of `precision-lab diagnose --candidate FILE`, and the candidate's own run.

    Diagnoses and own runs are interleaved `repeats` times and the fastest of each kept (a busy
    machine slows both alike). Each diagnosis runs in a child reaped with os.wait4, whose
    ru_maxrss is the peak of that child and the descendants it reaped — the largest single
    process (the lab's own peak, unless the program is bigger), not earlier children (which
    RUSAGE_CHILDREN would count), taken from the first diagnosis only (later ones start after this
    process has grown). The candidate's program runs beside the lab's reference, so the process
    tree's summed RSS is sampled too: what the machine must hold at once (an upper bound: shared
    library pages count in each process).
    """
    missing = _diagnosis_unavailable(candidate)
    if missing:
        return {"available": False, "reason": missing}
    from .candidates import resolve

    command = [sys.executable, "-m", "precision_lab.cli", "diagnose", "--candidate", str(candidate),
               "--size", str(size), "--batch", str(batch), "--seed", str(seed), "--device", "cpu"]
    runner, problem, first_peak = None, None, None
    diagnose_s, own_s, tree_peaks = [], [], []
    for _ in range(repeats):
        seconds, single_gb, tree_gb, returncode, error_lines = _one_diagnosis(command)
        if returncode not in (0, 1):
            return {"available": False, "reason": f"diagnose failed (exit {returncode}): {error_lines[-1:] or ''}"}
        diagnose_s.append(seconds)
        if first_peak is None:  # later children start from this process grown by the own runs: exec carries its high-water mark
            first_peak = single_gb
        tree_peaks.append(tree_gb)
        if runner is None:  # built after the first diagnosis: this process stays small until then
            runner, problem = resolve(str(candidate)), make_problem(size, batch, seed)
        own_s.append(_timed(lambda: runner.compute(problem, "float32", "cpu"))[0])
    return {"available": True, "candidate": str(candidate), "diagnose_s": min(diagnose_s), "candidate_s": min(own_s),
            "ratio": min(diagnose_s) / min(own_s), "target": DIAGNOSIS_TARGET, "peak_rss_gb": first_peak,
            "peak_tree_rss_gb": max(tree_peaks),
            "memory_target_gb": DIAGNOSIS_MEMORY_TARGET_GB, "verdict_exit_code": returncode,
            "diagnose_runs_s": diagnose_s, "candidate_runs_s": own_s}


def algorithms_table(size: int, batch: int, seed: int):
    """Time and worst error ÷ bound of every convolution algorithm at one size (experiment 05's sweep)."""
    import torch

    from .experiments import algorithms

    table = algorithms.sweep([size], list(algorithms.DEFAULT_ALGORITHMS), torch.device("cpu"), batch, seed)
    return algorithms.per_run(table)


def _met(value: float, target: float) -> str:
    return "meets" if value <= target else "MISSES"


def main(args: argparse.Namespace) -> int:
    if args.size < 8 or args.batch < 1 or args.repeats < 1 or args.algorithms_size < 8:
        raise LabInputError("bench: --size and --algorithms-size must be ≥ 8, --batch and --repeats ≥ 1")
    parts = args.only or list(PARTS)
    figures: dict = {"size": args.size, "batch": args.batch, "seed": args.seed}
    print(f"problem: {args.size}×{args.size}, batch {args.batch}, seed {args.seed}; best of {args.repeats} interleaved runs")
    # the diagnosis goes first: exec folds the parent's memory high-water mark into the child's
    # ru_maxrss, so it must be measured while this process is still small
    if "diagnose" in parts:
        cost = diagnosis_cost(Path(args.candidate), args.size, args.batch, args.seed, args.repeats)
        figures["diagnose"] = cost
        if not cost["available"]:
            print(f"cost of a diagnosis: not available yet ({cost['reason']})")
        else:
            print(f"diagnosis ÷ candidate's own run: {cost['diagnose_s']:.1f} s ÷ {cost['candidate_s']:.1f} s = "
                  f"{cost['ratio']:.2f}× ({_met(cost['ratio'], DIAGNOSIS_TARGET)} the ≤ {DIAGNOSIS_TARGET:g}× target)")
            print(f"diagnosis peak RSS: {cost['peak_rss_gb']:.2f} GB, the largest process "
                  f"({_met(cost['peak_rss_gb'], DIAGNOSIS_MEMORY_TARGET_GB)} the < {DIAGNOSIS_MEMORY_TARGET_GB:g} GB target); "
                  f"{cost['peak_tree_rss_gb']:.2f} GB with the candidate's program running beside it "
                  "(summed RSS: shared library pages counted in each process, an upper bound)")
    if "reference" in parts:
        ref = reference_ratio(make_problem(args.size, args.batch, args.seed), args.repeats, args.check_stock)
        figures["reference"] = ref
        print(f"float64 reference ÷ float32 native forward+backward: {ref['float64_reference_s']:.2f} s ÷ "
              f"{ref['float32_native_s']:.2f} s = {ref['ratio']:.2f}× ({_met(ref['ratio'], REFERENCE_TARGET)} "
              f"the ≤ {REFERENCE_TARGET:g}× target)")
        if args.check_stock:
            print(f"stock float64: {ref['stock_float64_s']:.2f} s = {ref['stock_ratio']:.1f}× float32; reference "
                  f"agrees with it to {ref['max_relative_difference_to_stock']:.1e} (relative)")
    if "algorithms" in parts:
        runs = algorithms_table(args.algorithms_size, args.batch, args.seed)
        figures["algorithms"] = runs.to_dict(orient="records")
        print(f"convolution algorithms, float32 forward+backward at {args.algorithms_size}², batch {args.batch}:")
        print(runs.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(figures, indent=1, default=str) + "\n")
        except OSError as exc:
            raise LabInputError(f"{args.json}: cannot write the benchmark JSON ({exc.strerror})") from None
    return 0
