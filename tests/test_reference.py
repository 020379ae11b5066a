"""The fast float64 reference equals stock PyTorch float64 and keeps what the error model needs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_lab.problem import make_problem
from precision_lab.ops import Kernels
from precision_lab.reference import (STOCK_AGREEMENT, agreement, intermediate_agreement, reference,
                                    relative_difference, stock_reference)
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names


@pytest.fixture(scope="module", params=[(64, 2), (37, 1)], ids=["64x64-batch2", "37x37-batch1"])
def traces(request):
    size, batch = request.param
    problem = make_problem(size=size, batch=batch, seed=1)
    return problem, reference(problem), stock_reference(problem)


def test_reference_equals_stock_float64(traces):
    _, fast, stock = traces
    differences = agreement(fast, stock)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= STOCK_AGREEMENT, f"{worst} differs from stock float64 by {differences[worst]:.2e}"
    assert abs(fast.loss - stock.loss) <= STOCK_AGREEMENT * abs(stock.loss)


def test_intermediates_agree_with_stock_to_their_storage(traces):
    _, fast, stock = traces
    for name, (difference, allowed) in intermediate_agreement(fast, stock).items():
        assert difference <= allowed, f"{name} differs from stock float64 by {difference:.2e} (allowed {allowed:.2e})"
    # float32 storage is a rounding, not a float32 computation: it differs from stock, but only that much
    from precision_lab.compute import forward_backward

    problem = traces[0]
    exact = forward_backward(problem, "float64", intermediates=True).intermediates["conv2.output.grad"]
    stored = fast.grad_at(problem.network.index_of("conv2"))
    assert stored.dtype == torch.float32
    difference = relative_difference(stored.double(), torch.from_numpy(exact))
    assert 0 < difference <= 2.0 ** -24 + STOCK_AGREEMENT


def test_reference_is_a_float64_trace(traces):
    problem, fast, _ = traces
    assert fast.meta["role"] == "reference" and fast.dtype == "float64"
    assert set(fast.grads) == set(PARAM_NAMES) and all(g.dtype == np.float64 for g in fast.grads.values())
    layers = len(problem.network.layers)
    assert len(fast.values) == len(fast.grads_at) == layers
    # float64 where the verdict rebuilds the problem (input, output, its gradient); float32 roundings elsewhere
    exact = (fast.input, fast.value(layers - 1), fast.grad_at(layers - 1))
    rounded = [fast.value(i) for i in range(layers - 1)] + [fast.grad_at(i) for i in range(layers - 1)]
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in exact)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in rounded)
    # a ReLU's output and the gradient at its input are recomputed, not stored (memory at 1024²)
    assert fast.values[1] is None and fast.grads_at[0] is None
    # the inputs are cast exactly from the float32 values the candidate received
    assert torch.equal(fast.input, torch.from_numpy(problem.input).double())


def test_reference_differs_from_float32():
    # a reference that silently ran in float32 would match float32 results bit for bit
    problem = make_problem(size=32, batch=1, seed=2)
    from precision_lab.compute import forward_backward
    single = forward_backward(problem, "float32")
    fast = reference(problem)
    diff = max(float(np.abs(fast.grads[n] - single.grads[n].astype(np.float64)).max()) for n in PARAM_NAMES)
    assert diff > 0


def test_bench_prints_the_reference_ratio_and_the_algorithms_table(capsys):
    from precision_lab.cli import main

    assert main(["bench", "--size", "32", "--batch", "1", "--repeats", "1", "--only", "reference",
                 "--only", "algorithms", "--algorithms-size", "16", "--check-stock"]) == 0
    out = capsys.readouterr().out
    assert "float64 reference ÷ float32 native forward+backward" in out and "target" in out
    assert "agrees with it to" in out
    for name in ("direct", "im2col", "fft", "winograd-f2x3", "winograd-f4x3", "native"):
        assert name in out


def test_bench_rejects_bad_sizes_in_one_line(capsys):
    from precision_lab.cli import main

    assert main(["bench", "--size", "61x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--size" in err


def test_bench_diagnosis_cost_says_why_it_is_unavailable(tmp_path):
    from precision_lab.bench import diagnosis_cost

    cost = diagnosis_cost(tmp_path / "missing.yaml", 16, 1, 0)
    assert cost == {"available": False, "reason": f"{tmp_path / 'missing.yaml'}: no such candidate YAML"}


def test_bench_diagnosis_cost_times_the_numpy_example_and_its_memory():
    from precision_lab.bench import diagnosis_cost
    from precision_lab.paths import ROOT

    cost = diagnosis_cost(ROOT / "examples" / "python" / "candidate.yaml", 24, 1, 0, repeats=2)
    assert cost["available"] and cost["verdict_exit_code"] == 0, cost
    assert len(cost["diagnose_runs_s"]) == len(cost["candidate_runs_s"]) == 2
    assert cost["diagnose_s"] == min(cost["diagnose_runs_s"]) and cost["ratio"] > 1  # the lab also imports torch
    assert 0.1 < cost["peak_rss_gb"] <= cost["peak_tree_rss_gb"] < 3  # at least the lab's interpreter with torch
    # the lab's own mark: torch imported (over 0.1 GB), no more than the largest process's
    assert 0.1 < cost["lab_peak_rss_gb"] <= cost["peak_rss_gb"]
    # the diagnosis ran the program five times (claimed and float64 builds, three probes) and the lab beside them
    assert cost["diagnose_cpu_s"] > cost["candidate_cpu_s"] > 0 and cost["cores"] >= 1
    # and the bench timed each of those calls alone: two at once, they take at least the longest
    from precision_lab.probes import select

    assert list(cost["calls_s"]) == ["float64 build"] + [probe.name for probe in select("default")]
    assert all(seconds > 0 for seconds in cost["calls_s"].values())
    assert max(cost["candidate_s"], *cost["calls_s"].values()) <= cost["calls_floor_s"] < cost["diagnose_s"]
    # the lab's floor: a fresh interpreter imports torch (over 0.2 s of CPU), and both claims' bounds are counted
    lab = cost["lab_floor"]
    assert lab["start_up_s"] > 0.2 and lab["reference_s"] > 0
    assert list(lab["bounds_convolutions_s"]) == ["float32", "float64"]
    assert all(seconds > 0 for seconds in lab["bounds_convolutions_s"].values())
    assert cost["floor_s"] >= max(cost["calls_floor_s"], (cost["calls_core_s"] + lab["cpu_s"]) / cost["cores"])


def test_the_calls_floor_is_their_sum_one_at_a_time_and_at_least_half_of_it_two_at_once():
    from precision_lab.bench import _calls_floor

    assert _calls_floor(3.0, {"probe a": 1.5, "probe b": 2.0}, two_at_once=False) == 6.5
    assert _calls_floor(3.0, {"float64 build": 4.0, "probe": 1.0}, two_at_once=True) == 4.0  # the longest call
    assert _calls_floor(2.0, {"float64 build": 2.0, "a": 2.0, "b": 2.0}, two_at_once=True) == 4.0  # two lanes


def test_the_convolutions_timer_counts_outermost_calls_and_puts_the_kernels_back():
    from precision_lab.bench import convolutions_timed

    original = Kernels.conv_weight_grad
    attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1, "kernel": (3, 3)}
    x, g = torch.rand(1, 2, 8, 8), torch.rand(1, 3, 8, 8)
    with convolutions_timed() as spent:
        squares = Kernels().conv_weight_grad_of_squares(x, g, attrs, (3, 2, 3, 3))  # PyTorch's: calls conv_weight_grad
    assert spent["calls"] == 1 and spent["by_kind"]["conv_weight_grad_of_squares"][1] == 1
    assert spent["by_kind"]["conv_weight_grad"] == [0.0, 0] and 0 < spent["seconds"]
    assert Kernels.conv_weight_grad is original  # restored
    assert torch.allclose(squares, torch.nn.grad.conv2d_weight(x * x, (3, 2, 3, 3), g * g, padding=1))


def test_bench_bounds_time_their_convolutions_and_the_references():
    from precision_lab.bench import bounds_ratio

    cost = bounds_ratio(make_problem(24, 1, 0), repeats=2)
    # the seed network's reference: three forwards, two input gradients (none for the image), three weight gradients
    assert cost["reference_convolution_calls"] == 8
    assert cost["bounds_convolution_calls"] > cost["reference_convolution_calls"]
    assert 0 < cost["bounds_convolutions_s"] <= cost["bounds_s"] and 0 < cost["reference_convolutions_s"] <= cost["reference_s"]
    assert cost["convolutions_floor_ratio"] == cost["bounds_convolutions_s"] / cost["reference_s"]
    assert {kind: calls for kind, (_, calls) in cost["reference_convolutions_by_kind"].items()} == {
        "conv_forward": 3, "conv_input_grad": 2, "conv_weight_grad": 3, "conv_weight_grad_of_squares": 0}


def test_in_place_reference_is_bit_identical_to_the_layer_by_layer_pass():
    # the in-place version saves memory only: same operations, same order, same bits
    from precision_lab.conv import DirectConv
    from precision_lab.compute import forward_backward

    problem = make_problem(size=40, batch=2, seed=4)
    fast, plain = reference(problem), forward_backward(problem, "float64", kernels=Kernels(conv=DirectConv()), keep_trace=True)
    assert fast.loss == plain.loss and np.array_equal(fast.output, plain.output)
    assert all(np.array_equal(fast.grads[n], plain.grads[n]) for n in PARAM_NAMES)
    for i in range(len(problem.network.layers)):  # kept as float64, or as its float32 rounding
        assert torch.equal(fast.value(i), plain.value(i).to(fast.value(i).dtype)), i
        assert torch.equal(fast.grad_at(i), plain.grad_at(i).to(fast.grad_at(i).dtype)), i


def test_bench_memory_is_the_diagnosis_own_not_its_parents_high_water_mark():
    """A child started by subprocess (vfork) inherits its parent's ru_maxrss at exec: from a test session that once
    held 3.4 GB, a 24² diagnosis read as 3.4 GB. The peak reported is the diagnosis's own."""
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "a = np.ones(int(1.5e9 / 8)); a.sum(); del a\n"
            "from precision_lab.bench import diagnosis_cost\n"
            "from precision_lab.paths import ROOT\n"
            "c = diagnosis_cost(ROOT / 'examples' / 'python' / 'candidate.yaml', 16, 1, 0)\n"
            "print(c['peak_rss_gb'], c['peak_tree_rss_gb'], c['lab_peak_rss_gb'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    single, tree, lab = map(float, out.split())
    assert 0.1 < lab <= single <= tree < 1.3, out  # the parent's 1.4 GB is not the diagnosis's


def test_bench_stages_name_functions_that_run_in_a_diagnosis():
    """Each stage of `precision-lab bench --only stages` is a function a diagnosis of native really calls: a renamed
    function would leave its row at zero."""
    from precision_lab.bench import diagnosis_stages
    from precision_lab.problem import make_problem

    cost = diagnosis_stages(make_problem(16, 2, 0))
    seconds = {row["stage"].strip(): row["seconds"] for row in cost["stages"]}
    assert all(value > 0 for stage, value in seconds.items() if stage != "the defect hypotheses"), seconds
    assert seconds["error bounds"] < cost["diagnose_s"] and seconds["sampled propagation"] < seconds["error bounds"]
