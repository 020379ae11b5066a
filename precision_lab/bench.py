"""`precision-lab bench`: the benchmark ratios, printed (not timed tests: machines are shared and noisy).

1. `reference`: float64 reference ÷ float32 native forward + backward, same problem, same process,
   runs interleaved and the fastest of `--repeats` kept for each (a busy machine slows both alike);
2. `bounds`: the error bounds of the problem's network ÷ its float64 reference (target: ≤ 1×), and the seconds
   each spends in its convolutions (the bounds' alone ÷ the reference: what the ratio cannot go below);
3. `diagnose`: a diagnosis of a float32 command candidate as a user runs it (`precision-lab diagnose
   --candidate FILE.yaml`, default probes, the float64 build when the YAML has one) ÷ the candidate's own
   run (interleaved, fastest of `--repeats` each; target ≤ 2.5×), the CPU seconds it used (the lab and the
   programs it ran: on a machine of C cores a diagnosis takes at least CPU ÷ C), its floor (the program's calls
   timed alone, and the lab's start-up, float64 reference and bounds' convolutions in one thread: what no
   schedule and no faster elementwise code can go below with this error model), and its peak resident
   memory (the largest process, target ≤ 2 GB; and the lab and its programs together);
4. `builtin`: an in-process diagnosis of the built-in `native` candidate, seconds beyond the
   candidate's own run (target on a GPU: ≤ 3 s at 1024²), and what the default probes add
   (target: ≤ 25% of the requested problem's diagnosis);
5. `algorithms`: a table of the convolution algorithms: time and worst error ÷ bound at one size;
6. `stages`: where an in-process diagnosis of `native` with its default probes spends its time, by stage
   (cumulative seconds under cProfile, whose overhead inflates Python-level work: shares, not seconds, compare).

Every part runs on `--device` (auto: the GPU when there is one) and on `--model` (the seed CNN by
default); GPU timings synchronise before reading the clock.
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from . import options
from .compute import forward_backward
from . import resources
from .device import resolve_device
from .diagnosis import calls_at_once, has_float64_build
from .errors import LabInputError
from .model import ModelSpecError, load_model
from .paths import ROOT
from .problem import make_problem

#: target: the float64 reference within 2× of the float32 native forward + backward
REFERENCE_TARGET = 2.0
#: target: a diagnosis, probes and float64 build included, within 2.5× of the candidate's own run, peaking at 2 GB
DIAGNOSIS_TARGET, DIAGNOSIS_MEMORY_TARGET_GB = 2.5, 2.0
DEFAULT_CANDIDATE = ROOT / "examples" / "python" / "candidate.yaml"
#: target: the bounds of a network no dearer than its float64 reference forward + backward
BOUNDS_TARGET = 1.0
#: target: a diagnosis of a built-in candidate at 1024² within 3 s of the candidate's own run (GPU)
BUILTIN_EXTRA_TARGET_S = 3.0
#: target: the default probes within 25% of the requested problem's diagnosis
PROBES_TARGET = 0.25
PARTS = ("reference", "bounds", "diagnose", "builtin", "algorithms", "stages")
#: the stages of a diagnosis, each the cumulative time of one function (its file's path ends so); indented rows are
#: parts of the error bounds and may overlap (the sampled runs draw Winograd's scale too)
STAGES = (("the candidate's runs (problem and probes)", "candidates/__init__.py", "compute"),
          ("the float64 references", "reference.py", "reference"),
          ("error bounds", "errmodel.py", "error_bounds"),
          ("  sampled propagation", "sampled.py", "deviations"),
          ("  Winograd's forward scale", "conv/winograd_bound.py", "winograd_scale"),
          ("  Winograd's weight-gradient scale", "conv/winograd_bound.py", "winograd_weight_grad_scale"),
          ("  convolution weight-gradient parts", "ops/layers.py", "_weight_grad_parts"),
          ("the format fingerprint", "doctors/formats.py", "_fingerprint"),
          ("the defect hypotheses", "doctors/defects.py", "defects"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default=None, help="image size N or HxW (default 1024, the seed scale, or the nearest "
                                                     "the network takes)")
    parser.add_argument("--batch", default="2", help="batch size (default 2)")
    parser.add_argument("--seed", default="0", help="problem seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto: the GPU when present)")
    parser.add_argument("--model", default=None,
                        help="model spec (JSON/YAML file or an exported .onnx, default the seed CNN)")
    parser.add_argument("--repeats", default="3", help="interleaved runs per timing; the fastest counts (default 3)")
    parser.add_argument("--candidate", default=str(DEFAULT_CANDIDATE),
                        help="float32 command candidate YAML for the diagnosis cost (default examples/python/candidate.yaml)")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    parser.add_argument("--algorithms-size", default="256", help="image size of the algorithms table (default 256)")
    parser.add_argument("--check-stock", action="store_true",
                        help="also time stock PyTorch float64 and check the reference agrees with it (slow: ~6-20× float32)")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON to this file")


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device="cpu", collect: bool = True):
    if collect:
        gc.collect()
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return time.perf_counter() - start, value


def reference_ratio(problem, repeats: int = 3, check_stock: bool = False, device="cpu") -> dict:
    """Fastest float32 native and float64 reference forward + backward, interleaved, and their ratio."""
    from .reference import agreement, reference, stock_reference

    float32_s, float64_s = [], []
    forward_backward(problem, "float32", device)  # warm-up: cuDNN's first call picks and loads kernels
    for _ in range(repeats):
        float32_s.append(_timed(lambda: forward_backward(problem, "float32", device), device)[0])
        seconds, trace = _timed(lambda: reference(problem, device), device)
        float64_s.append(seconds)
        if not check_stock:
            del trace
    out = {"float32_native_s": min(float32_s), "float64_reference_s": min(float64_s),
           "ratio": min(float64_s) / min(float32_s), "target": REFERENCE_TARGET,
           "float32_runs_s": float32_s, "float64_runs_s": float64_s, "reference_conv": "direct (shift-and-GEMM)"}
    if check_stock:
        seconds, stock = _timed(lambda: stock_reference(problem, device), device)
        out.update(stock_float64_s=seconds, stock_ratio=seconds / min(float32_s),
                   max_relative_difference_to_stock=max(agreement(trace, stock).values()))
    return out


def bounds_ratio(problem, repeats: int = 3, device="cpu") -> dict:
    """Fastest float64 reference and error bounds of the same problem, and their ratio; and the seconds each spends
    in its convolutions (fastest of the same runs), which the bounds cost at least however fast the rest is."""
    from . import errmodel
    from .reference import reference

    reference_s, bounds_s, reference_conv, bounds_conv = [], [], [], []
    for _ in range(repeats):
        with convolutions_timed(device) as spent:
            seconds, trace = _timed(lambda: reference(problem, device), device)
        reference_s.append(seconds)
        reference_conv.append(spent)
        with convolutions_timed(device) as spent:
            bounds_s.append(_timed(lambda: errmodel.error_bounds(trace, "float32"), device)[0])
        bounds_conv.append(spent)
        del trace
    floor = min(run["seconds"] for run in bounds_conv)
    fastest = bounds_conv[bounds_s.index(min(bounds_s))], reference_conv[reference_s.index(min(reference_s))]
    return {"reference_s": min(reference_s), "bounds_s": min(bounds_s), "ratio": min(bounds_s) / min(reference_s),
            "target": BOUNDS_TARGET, "reference_runs_s": reference_s, "bounds_runs_s": bounds_s,
            "bounds_convolutions_s": floor, "bounds_convolution_calls": bounds_conv[0]["calls"],
            "reference_convolutions_s": min(run["seconds"] for run in reference_conv),
            "reference_convolution_calls": reference_conv[0]["calls"],
            "convolutions_floor_ratio": floor / min(reference_s),
            # [seconds, calls] by Kernels method, in the fastest run of each
            "bounds_convolutions_by_kind": fastest[0]["by_kind"], "reference_convolutions_by_kind": fastest[1]["by_kind"]}


#: the convolutions of ops.Kernels, which the reference and the bounds run through
CONVOLUTIONS = ("conv_forward", "conv_input_grad", "conv_weight_grad", "conv_weight_grad_of_squares")


@contextlib.contextmanager
def convolutions_timed(device="cpu"):
    """Yields {"seconds", "calls", "by_kind": {method: [seconds, calls]}}, filled with the time the block spends
    inside ops.Kernels' convolutions: outermost calls only (a sum of squares may call the weight gradient), each
    synchronised on a GPU. Kernels' methods are wrapped for the block and restored after it."""
    from .ops import Kernels

    spent = {"seconds": 0.0, "calls": 0, "by_kind": {name: [0.0, 0] for name in CONVOLUTIONS}}
    depth = [0]
    originals = {name: Kernels.__dict__[name] for name in CONVOLUTIONS}

    def timed(name, method):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] += 1
            try:
                seconds, value = _timed(lambda: method(*args, **kwargs), device, collect=False)
            finally:
                depth[0] -= 1
            spent["seconds"] += seconds
            spent["calls"] += 1
            spent["by_kind"][name][0] += seconds
            spent["by_kind"][name][1] += 1
            return value
        return wrapper

    for name, method in originals.items():
        setattr(Kernels, name, timed(name, method))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(Kernels, name, method)


def builtin_cost(problem, repeats: int = 3, device="cpu", name: str = "native") -> dict:
    """Seconds an in-process diagnosis of a built-in candidate adds to its own run, and what the probes add."""
    from .candidates import get_builtin
    from .diagnosis import diagnose

    candidate = get_builtin(name)
    candidate.compute(problem, "float32", device)  # warm-up
    from . import probes as probe_set

    probe_problems = {p.name: probe_set.probe_problem(p, problem) for p in probe_set.DEFAULT_PROBES}
    own_s, diagnose_s, probes_s, alone_s = [], [], [], {name: [] for name in probe_problems}
    for _ in range(repeats):
        own_s.append(_timed(lambda: candidate.compute(problem, "float32", device), device)[0])
        diagnose_s.append(_timed(lambda: diagnose(candidate, problem, str(device), probes=[]), device)[0])
        probes_s.append(_timed(lambda: diagnose(candidate, problem, str(device)), device)[0])
        for probe_name, probe_problem in probe_problems.items():  # each probe's own diagnosis, as diagnose runs it
            alone_s[probe_name].append(_timed(lambda: diagnose(candidate, probe_problem, str(device), probes=[]),
                                              device)[0])
    main, with_probes = min(diagnose_s), min(probes_s)
    # the difference of two totals drowns in a shared machine's noise; the probes timed alone do not
    alone = sum(min(runs) for runs in alone_s.values())
    return {"candidate": name, "candidate_s": min(own_s), "diagnose_s": main, "extra_s": main - min(own_s),
            "extra_target_s": BUILTIN_EXTRA_TARGET_S, "with_probes_s": with_probes,
            "probes_share": (with_probes - main) / main, "probes_alone_s": alone, "probes_alone_share": alone / main,
            "probes_target": PROBES_TARGET,
            "runs": {"candidate": own_s, "diagnose": diagnose_s, "with_probes": probes_s, "probes_alone": alone_s}}


def _diagnosis_unavailable(candidate: Path) -> str | None:
    if not candidate.exists():
        return f"{candidate}: no such candidate YAML"
    return None


#: seconds between samples of the diagnosis's process-tree memory (the lab and the program it runs)
MEMORY_SAMPLE_S = 0.01


def _own_peak_bytes(process) -> tuple[int, bool]:
    """The process's own resident high-water mark and True (VmHWM, Linux: its address space is new at exec, so
    nothing is inherited and no spike between samples is missed), else its current RSS and False."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, True
    return process.memory_info().rss, False


def _tree_rss_sampler(pid: int, peak: list[float], stop: threading.Event) -> None:
    """Largest sum of resident memory over `pid` and its descendants (peak[0]), largest single process's
    own high-water mark (peak[1]; peak[2] true when the kernel's own mark was read) and the lab's own, `pid`'s
    (peak[3]), sampled until `stop`: the candidate's program runs beside the lab's reference, so their peaks may
    add up."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.is_set():
        processes = [root]
        # listing descendants reads every process on the machine: one that cannot be read must not end the sampling
        with contextlib.suppress(psutil.Error, OSError):
            processes += root.children(recursive=True)
        total = 0
        for process in processes:
            with contextlib.suppress(psutil.Error, OSError):
                total += process.memory_info().rss
                own, exact = _own_peak_bytes(process)
                peak[1], peak[2] = max(peak[1], own), peak[2] or exact
                if process is root and exact:
                    peak[3] = max(peak[3], own)  # the lab's own mark, where the kernel's was read
        peak[0] = max(peak[0], total)
        stop.wait(MEMORY_SAMPLE_S)


def _one_diagnosis(command: list[str]) -> tuple[float, float, float, int, list[str], float, float | None]:
    """Wall time, peak memory (GB: largest single process, and the process tree summed) and exit
    code of one `diagnose` child, its stderr lines, the CPU seconds of it and the programs it ran, and the
    lab's own peak (GB, the child's VmHWM; None where it cannot be read)."""
    peak, stop = [0.0, 0.0, False, 0.0], threading.Event()
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
    # the kernel's own high-water mark of each process (VmHWM) is the answer where it was read; ru_maxrss (KiB on
    # Linux) is the largest single process too, but a child started by vfork (Python's subprocess) inherits its
    # parent's mark at exec, so without VmHWM it counts only where it is below the parent's mark, else the samples
    inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    sampled_single = peak[1] / 2 ** 30
    reaped = usage.ru_maxrss / 2 ** 20
    if peak[2]:
        single_gb = sampled_single
    else:
        single_gb = reaped if reaped < inherited or not sampled_single else sampled_single
    # wait4's usage counts the child and every descendant it waited for: the lab and the candidate's programs
    cpu_s = usage.ru_utime + usage.ru_stime
    lab_gb = peak[3] / 2 ** 30 if peak[3] else None
    return seconds, single_gb, max(single_gb, peak[0] / 2 ** 30), child.returncode, error_lines, cpu_s, lab_gb


def diagnosis_cost(candidate: Path, size, batch: int, seed: int, repeats: int = 1, device: str = "cpu") -> dict:
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

    height, width = size if isinstance(size, (tuple, list)) else (size, size)
    command = [sys.executable, "-m", "precision_lab.cli", "diagnose", "--candidate", str(candidate),
               "--size", f"{height}x{width}", "--batch", str(batch), "--seed", str(seed), "--device", str(device)]
    runner, problem, first_peak, lab_peak, calls_s, calls_cpu_s = None, None, None, None, {}, {}
    diagnose_s, own_s, tree_peaks, diagnose_cpu_s, own_cpu_s = [], [], [], [], []
    for _ in range(repeats):
        seconds, single_gb, tree_gb, returncode, error_lines, cpu_s, lab_gb = _one_diagnosis(command)
        if returncode not in (0, 1):
            return {"available": False, "reason": f"diagnose failed (exit {returncode}): {error_lines[-1:] or ''}"}
        diagnose_s.append(seconds)
        diagnose_cpu_s.append(cpu_s)
        if first_peak is None:  # later children start from this process grown by the own runs: exec carries its high-water mark
            first_peak, lab_peak = single_gb, lab_gb
        tree_peaks.append(tree_gb)
        if runner is None:  # built after the first diagnosis: this process stays small until then
            runner = resolve(str(candidate))
            problem = make_problem(size, batch, seed, network=runner.network)
        _fresh(runner)  # a worker (`worker: true`) is started by the own run, as a plain command is: its start counts
        (seconds, _), cpu_s = _children_cpu(lambda: _timed(lambda: runner.compute(problem, "float32", device), device))
        own_s.append(seconds)
        own_cpu_s.append(cpu_s)
        for name, (asked, precision) in _calls(runner, problem).items():
            (seconds, _), cpu_s = _children_cpu(lambda: _timed(lambda: runner.compute(asked, precision, device), device))
            calls_s.setdefault(name, []).append(seconds)
            calls_cpu_s.setdefault(name, []).append(cpu_s)
    _fresh(runner)  # no worker outlives the timings
    calls = {name: min(seconds) for name, seconds in calls_s.items()}
    floor = _calls_floor(min(own_s), calls, calls_at_once(runner, torch.device(device)) > 1)
    # a call needs at least its wall time alone of one core, and no more than its CPU seconds (threads may spin)
    calls_core_s = min(min(own_s), min(own_cpu_s)) + sum(min(calls[name], min(calls_cpu_s[name])) for name in calls)
    lab = lab_floor(candidate, runner, problem, device)
    with_lab = max(floor, (calls_core_s + lab["cpu_s"]) / os.cpu_count())
    return {"available": True, "candidate": str(candidate), "diagnose_s": min(diagnose_s), "candidate_s": min(own_s),
            "calls_s": calls, "calls_floor_s": floor, "calls_floor_ratio": floor / min(own_s),
            "calls_core_s": calls_core_s, "lab_floor": lab, "floor_s": with_lab, "floor_ratio": with_lab / min(own_s),
            "diagnose_cpu_s": min(diagnose_cpu_s), "candidate_cpu_s": min(own_cpu_s), "cores": os.cpu_count(),
            "ratio": min(diagnose_s) / min(own_s), "target": DIAGNOSIS_TARGET, "peak_rss_gb": first_peak,
            "peak_tree_rss_gb": max(tree_peaks), "lab_peak_rss_gb": lab_peak,
            "memory_target_gb": DIAGNOSIS_MEMORY_TARGET_GB, "verdict_exit_code": returncode,
            "diagnose_runs_s": diagnose_s, "candidate_runs_s": own_s}


def _fresh(runner) -> None:
    """End the candidate's workers, if it has any: its next call starts the program as a user's run does."""
    program = getattr(runner.run, "__self__", None)  # a command candidate's run is CommandProgram.run
    if hasattr(program, "close"):
        program.close()


def _calls(runner, problem) -> dict:
    """The program's other calls in a diagnosis of `problem`, by name: (problem, precision) of its float64 build (where
    it has one) and of each default probe."""
    from . import probes

    calls = {"float64 build": (problem, "float64")} if has_float64_build(runner) else {}
    calls.update({probe.name: (probes.probe_problem(probe, problem), "float32") for probe in probes.select("default")})
    return calls


def _calls_floor(own_s: float, calls: dict, two_at_once: bool) -> float:
    """Seconds the program's own calls take in a diagnosis however fast the lab is: one after another, or two at once
    (diagnosis.calls_at_once), at least the longest and half the sum."""
    total = own_s + sum(calls.values())
    if not two_at_once:
        return total
    return max(own_s, *calls.values(), total / 2)


def _children_cpu(fn):
    """fn()'s value and the CPU seconds of the child processes it waited for (a program's calls)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    value = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return value, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def lab_floor(candidate: Path, runner, problem, device="cpu") -> dict:
    """CPU seconds of the lab's work that any diagnosis of `problem` by `runner` does with this error model, each in
    one thread (threads only add to the CPU seconds): its start-up (imports and the problem, in a fresh interpreter),
    the float64 reference, and the convolutions of the bounds of each claim it judges (the claimed precision, and
    float64 where the program has a float64 build; S shared by the two, as in a diagnosis). Everything else the lab
    does (elementwise passes, probes, judgements) comes on top."""
    from . import errmodel
    from .device import torch_threads
    from .reference import reference

    start_up = ("import precision_lab.diagnosis, precision_lab.verdict, precision_lab.decision\n"
                "from precision_lab.candidates import resolve\nfrom precision_lab.problem import make_problem\n"
                f"make_problem(({problem.height}, {problem.width}), {problem.batch}, {problem.seed}, "
                f"network=resolve({str(candidate)!r}).network)")
    _, start_up_s = _children_cpu(lambda: subprocess.run([sys.executable, "-c", start_up], check=True,
                                                         stdout=subprocess.DEVNULL))
    claims = [runner.claimed_precision] + (["float64"] if has_float64_build(runner) else [])
    where = torch.device(device)
    with torch_threads(where, 1):
        gc.collect()
        cpu = time.process_time()
        trace = reference(problem, where)
        reference_s = time.process_time() - cpu
        convolutions = {}
        for claim in claims:
            with convolutions_timed(where) as spent:
                errmodel.error_bounds(trace, claim)
            convolutions[claim] = spent["seconds"]
    del trace
    return {"start_up_s": start_up_s, "reference_s": reference_s, "bounds_convolutions_s": convolutions,
            "cpu_s": start_up_s + reference_s + sum(convolutions.values())}


def diagnosis_stages(problem, device="cpu", name: str = "native") -> dict:
    """Cumulative seconds of each of STAGES in one in-process diagnosis (default probes) under cProfile."""
    import cProfile
    import pstats

    from .candidates import get_builtin
    from .diagnosis import diagnose

    candidate = get_builtin(name)
    candidate.compute(problem, "float32", device)  # warm-up, as the other parts
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(diagnose, candidate, problem, str(device))
    total = time.perf_counter() - start
    stats = pstats.Stats(profile).stats  # (file, line, function) → (calls, primitive calls, own s, cumulative s, …)
    rows = []
    for label, path, function in STAGES:
        seconds = sum(entry[3] for (file, _, func), entry in stats.items()
                      if func == function and file.replace(os.sep, "/").endswith("precision_lab/" + path))
        rows.append({"stage": label, "seconds": seconds, "share": seconds / total})
    return {"candidate": name, "diagnose_s": total, "stages": rows}


def algorithms_table(size: int, batch: int, seed: int, device="cpu"):
    """Time and worst error ÷ bound of every convolution algorithm at one size (experiment 05's sweep)."""
    import torch

    from .experiments import algorithms

    table, decisions = algorithms.sweep([size], list(algorithms.DEFAULT_ALGORITHMS), torch.device(device), batch, seed)
    runs = algorithms.per_run(table)
    return runs.assign(overall=runs["algorithm"].map(lambda name: decisions[name].verdict))  # with the probes


def _met(value: float, target: float) -> str:
    return "meets" if value <= target else "MISSES"


def main(args: argparse.Namespace) -> int:
    batch, seed = options.positive(args.batch, "--batch"), options.nonnegative(args.seed, "--seed")
    repeats = options.positive(args.repeats, "--repeats")
    algorithms_size = options.size(args.algorithms_size, "--algorithms-size")[0]
    device = resolve_device(args.device)
    try:
        network = load_model(args.model)
    except ModelSpecError as exc:
        raise LabInputError(f"--model: {exc}") from None
    size = options.size(args.size, "--size") or network.default_size(1024)
    try:
        network.check_size(*size)
    except ModelSpecError as exc:
        raise LabInputError(f"--size: {exc}") from None
    resources.check_fits(network, batch, size[0], size[1], device, "this benchmark")  # before anything is allocated
    parts = args.only or list(PARTS)
    problem_text = f"{size[0]}×{size[1]}, batch {batch}, seed {seed}, network {network.name}, on {device}"
    figures: dict = {"size": list(size), "batch": batch, "seed": seed, "device": str(device), "network": network.name}
    print(f"problem: {problem_text}; best of {repeats} interleaved runs")
    # the diagnosis goes first: exec folds the parent's memory high-water mark into the child's
    # ru_maxrss, so it must be measured while this process is still small
    if "diagnose" in parts:
        cost = diagnosis_cost(Path(args.candidate), size, batch, seed, repeats, str(device))
        figures["diagnose"] = cost
        if not cost["available"]:
            print(f"cost of a diagnosis: not available ({cost['reason']})")
        else:
            print(f"diagnosis (default probes, float64 build if any) ÷ candidate's own run: {cost['diagnose_s']:.1f} s ÷ "
                  f"{cost['candidate_s']:.1f} s = {cost['ratio']:.2f}× ({_met(cost['ratio'], DIAGNOSIS_TARGET)} the ≤ "
                  f"{DIAGNOSIS_TARGET:g}× target)")
            calls = " + ".join(f"{name} {seconds:.1f} s" for name, seconds in cost["calls_s"].items())
            print(f"the program's own calls, each alone: the problem {cost['candidate_s']:.1f} s + {calls}; however fast "
                  f"the lab, they take {cost['calls_floor_s']:.1f} s = {cost['calls_floor_ratio']:.2f}× in a diagnosis "
                  "(two at once on a CPU where the program has a float64 build, else one after another)")
            lab = cost["lab_floor"]
            bounds = " + ".join(f"{seconds:.1f} s ({claim})" for claim, seconds in lab["bounds_convolutions_s"].items())
            print(f"the lab's floor, one thread: start-up {lab['start_up_s']:.1f} s + float64 reference "
                  f"{lab['reference_s']:.1f} s + the bounds' convolutions {bounds} = {lab['cpu_s']:.1f} CPU-s; with the "
                  f"program's calls ({cost['calls_core_s']:.1f} core-s) on {cost['cores']} cores no diagnosis with this "
                  f"error model takes under {cost['floor_s']:.1f} s = {cost['floor_ratio']:.2f}× the candidate's run")
            print(f"CPU seconds: the diagnosis {cost['diagnose_cpu_s']:.1f} s (the lab and every program it ran), the "
                  f"candidate's own run {cost['candidate_cpu_s']:.1f} s; on {cost['cores']} cores a diagnosis takes at "
                  f"least {cost['diagnose_cpu_s'] / cost['cores']:.1f} s")
            # the target is the lab's own memory: a program's is the candidate's, whatever the lab does
            lab = cost["lab_peak_rss_gb"]
            lab_text = "not readable here (no /proc)" if lab is None else \
                f"{lab:.2f} GB ({_met(lab, DIAGNOSIS_MEMORY_TARGET_GB)} the ≤ {DIAGNOSIS_MEMORY_TARGET_GB:g} GB target)"
            print(f"diagnosis peak RSS: the lab's own {lab_text}; the largest process {cost['peak_rss_gb']:.2f} GB (a "
                  f"program's where larger); {cost['peak_tree_rss_gb']:.2f} GB with the candidate's programs running "
                  "beside it (summed RSS: shared library pages counted in each process, an upper bound)")
    problem = make_problem(size, batch, seed, network=network) if set(parts) - {"diagnose", "algorithms"} else None
    if "reference" in parts:
        ref = reference_ratio(problem, repeats, args.check_stock, device)
        figures["reference"] = ref
        print(f"float64 reference ÷ float32 native forward+backward: {ref['float64_reference_s']:.3g} s ÷ "
              f"{ref['float32_native_s']:.3g} s = {ref['ratio']:.2f}× ({_met(ref['ratio'], REFERENCE_TARGET)} "
              f"the ≤ {REFERENCE_TARGET:g}× target)")
        if args.check_stock:
            print(f"stock float64: {ref['stock_float64_s']:.2f} s = {ref['stock_ratio']:.1f}× float32; reference "
                  f"agrees with it to {ref['max_relative_difference_to_stock']:.1e} (relative)")
    if "bounds" in parts:
        cost = bounds_ratio(problem, repeats, device)
        figures["bounds"] = cost
        print(f"error bounds ÷ float64 reference: {cost['bounds_s']:.3g} s ÷ {cost['reference_s']:.3g} s = "
              f"{cost['ratio']:.2f}× ({_met(cost['ratio'], BOUNDS_TARGET)} the ≤ {BOUNDS_TARGET:g}× target)")
        print(f"their convolutions: the bounds' {cost['bounds_convolution_calls']} take {cost['bounds_convolutions_s']:.3g} s "
              f"= {cost['convolutions_floor_ratio']:.2f}× the reference (its own {cost['reference_convolution_calls']} take "
              f"{cost['reference_convolutions_s']:.3g} s); however fast the rest of the bounds, they cost at least that")
    if "builtin" in parts:
        cost = builtin_cost(problem, repeats, device)
        figures["builtin"] = cost
        print(f"diagnosis of built-in native beyond its own run: {cost['diagnose_s']:.3g} s − {cost['candidate_s']:.3g} s "
              f"= {cost['extra_s']:.3g} s ({_met(cost['extra_s'], BUILTIN_EXTRA_TARGET_S)} the ≤ "
              f"{BUILTIN_EXTRA_TARGET_S:g} s target on a GPU)")
        print(f"default probes, each diagnosed alone: {cost['probes_alone_s']:.3g} s = {cost['probes_alone_share']:.1%} "
              f"of the requested problem's diagnosis ({_met(cost['probes_alone_share'], PROBES_TARGET)} the ≤ "
              f"{PROBES_TARGET:.0%} target); diagnosis with probes − without: "
              f"{cost['with_probes_s'] - cost['diagnose_s']:.3g} s = {cost['probes_share']:.0%} (noisier)")
    if "stages" in parts:
        cost = diagnosis_stages(problem, device)
        figures["stages"] = cost
        print(f"where a diagnosis of built-in native with its default probes spends {cost['diagnose_s']:.3g} s "
              f"(under cProfile):")
        for row in cost["stages"]:
            print(f"  {row['stage']:<46} {row['seconds']:8.3g} s  {row['share']:6.1%}")
    if "algorithms" in parts:
        runs = algorithms_table(algorithms_size, batch, seed, device)
        figures["algorithms"] = runs.to_dict(orient="records")
        print(f"convolution algorithms, float32 forward+backward at {algorithms_size}², batch {batch}:")
        print(runs.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(figures, indent=1, default=str) + "\n")
        except OSError as exc:
            raise LabInputError(f"{args.json}: cannot write the benchmark JSON ({exc.strerror})") from None
    return 0
