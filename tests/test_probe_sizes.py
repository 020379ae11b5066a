"""Probes fit any network: every example network and a network around every op (a flatten + linear
network once got a 3×18 probe that the size parser refused, so `diagnose` exited 2)."""
from __future__ import annotations

from pathlib import Path

import pytest

from precision_lab import probes
from precision_lab.model import load_model
from precision_lab.ops import OPS
from precision_lab.problem import MIN_SIDE, make_problem, parse_size

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_NETWORKS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.json")
                          if '"layers"' in p.read_text() or '"channels"' in p.read_text())

CONV = {"name": "c", "op": "conv2d", "in": 1, "out": 2, "kernel": 3, "padding": 1}
#: a small network around each op: the op where it can act, with what it needs before and after
AROUND = {
    "conv2d": [dict(CONV, stride=2)],
    "conv_transpose2d": [dict(CONV, stride=2), {"name": "t", "op": "conv_transpose2d", "in": 2, "out": 1, "kernel": 3,
                                                "stride": 2, "padding": 1, "output_padding": 1}],
    "linear": [CONV, {"op": "flatten"}, {"name": "fc", "op": "linear", "in": 2 * 6 * 6, "out": 3}],
    "max_pool2d": [CONV, {"op": "max_pool2d", "kernel": 2}],
    "avg_pool2d": [CONV, {"op": "avg_pool2d", "kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False}],
    "adaptive_avg_pool2d": [CONV, {"op": "adaptive_avg_pool2d", "size": [3, 2]}],
    "zero_pad2d": [CONV, {"op": "zero_pad2d", "padding": [0, 1, 2, 0]}, dict(CONV, name="s", stride=2, padding="same",
                                                                          **{"in": 2})],
    "upsample_nearest": [CONV, {"op": "upsample_nearest", "scale": 2}],
    "add": [CONV, {"name": "r", "op": "relu"}, {"op": "add", "from": "c"}],
    "sub": [CONV, {"name": "r", "op": "relu"}, {"op": "sub", "inputs": ["c", "r"]}],
    "mul": [CONV, {"name": "r", "op": "sigmoid"}, {"op": "mul", "from": "c"}],
    "concat": [CONV, {"name": "r", "op": "relu"}, {"op": "concat", "from": "c"}],
    "batch_norm2d": [CONV, {"name": "bn", "op": "batch_norm2d", "channels": 2}],
    "group_norm": [CONV, {"name": "gn", "op": "group_norm", "groups": 2, "channels": 2}],
    "layer_norm": [CONV, {"op": "flatten_pixels"}, {"op": "transpose"}, {"name": "ln", "op": "layer_norm", "features": 2}],
    "transpose": [CONV, {"op": "flatten_pixels"}, {"op": "transpose"}],
    "matmul": [CONV, {"name": "p", "op": "flatten_pixels"}, {"name": "t", "op": "transpose"},
               {"op": "matmul", "inputs": ["p", "t"]}],
    "scale": [CONV, {"op": "scale", "factor": 0.5}],
    "reshape": [CONV, {"op": "reshape", "shape": [-1, 2]}],
    "permute": [CONV, {"op": "permute", "dims": [1, 2, 0]}],
    "channel_slice": [CONV, {"op": "channel_slice", "chunk": [1, 2]}],
    "attention": [CONV, {"op": "flatten_pixels"}, {"op": "transpose"}, {"name": "a", "op": "attention", "dim": 2}],
    "dot_product_attention": [CONV, {"op": "flatten_pixels"}, {"name": "t", "op": "transpose"},
                              {"op": "dot_product_attention", "inputs": ["t", "t", "t"]}],
    "scale_by_parameter": [CONV, {"name": "s", "op": "scale_by_parameter", "parameter": "gamma", "shape": [2, 1, 1]}],
    "add_parameter": [CONV, {"name": "a", "op": "add_parameter", "parameter": "offset", "shape": [1, 2, 1, 1]}],
    "flatten": [CONV, {"op": "max_pool2d", "kernel": 2}, {"op": "flatten"},
                {"name": "fc", "op": "linear", "in": 2 * 3 * 3, "out": 2}],
}


def _network(op: str):
    layers = AROUND.get(op, [CONV, {"op": op}])
    return load_model({"input_channels": 1, "layers": layers, "loss": "mse"})


def test_every_op_has_a_network_here():
    assert set(OPS) <= set(AROUND) | {name for name in OPS if not OPS[name].parametrised and name not in AROUND}
    for op in OPS:
        assert any(layer["op"] == op for layer in AROUND.get(op, [CONV, {"op": op}]))


@pytest.mark.parametrize("network", [*EXAMPLE_NETWORKS, *(f"op:{op}" for op in OPS)])
def test_every_probe_fits_the_network_and_the_size_parser(network):
    net = _network(network[3:]) if network.startswith("op:") else load_model(ROOT / network)
    main = make_problem(net.default_size(24), 2, 0, network=net)
    note = probes.fixed_size_note(net, main)
    seen = {(main.height, main.width, main.batch, main.seed, main.targets)}
    for probe in probes.DEFAULT_PROBES:
        problem = probes.probe_problem(probe, main)  # make_problem refuses any size the network cannot take
        assert parse_size(problem.size_text.replace("×", "x")) == (problem.height, problem.width)
        assert min(problem.height, problem.width) >= MIN_SIDE
        if net.has_fixed_size:  # the network's own size; batch, seed or targets differ instead
            assert note and (problem.height, problem.width) == (main.height, main.width)
        else:
            assert note is None
        key = (problem.height, problem.width, problem.batch, problem.seed, problem.targets)
        assert key not in seen, f"{probe.name} repeats another problem: {key}"
        seen.add(key)


def test_a_six_by_six_classifier_gets_its_own_size_not_the_same_area():
    net = load_model({"input_channels": 1, "layers": [CONV, {"op": "flatten"},
                                                      {"name": "fc", "op": "linear", "in": 72, "out": 3}]})
    assert (3, 12) in net.sizes_near(61, 67, limit=64)  # what the probes used to choose (3 < MIN_SIDE)
    main = make_problem((6, 6), 2, 0, network=net)
    assert {probes.probe_problem(p, main).size_text for p in probes.DEFAULT_PROBES} == {"6×6"}


def test_a_probe_label_says_what_ran_on_a_network_of_one_input_size():
    """A flatten feeding a linear layer takes one size: the probes run there, and their labels say so (they read
    'odd-61x67, odd-33x47-batch3' before, for problems that were neither)."""
    from precision_lab import probes as probe_set
    from precision_lab.model import load_model
    from precision_lab.paths import ROOT
    from precision_lab.problem import make_problem

    network = load_model(ROOT / "examples" / "models" / "lenet-classifier.json")
    assert network.has_fixed_size
    main = make_problem(network.default_size(32), 2, 0, network=network)
    runs = [probe_set.ProbeRun.of(p, probe_set.probe_problem(p, main)) for p in probe_set.DEFAULT_PROBES]
    h, w = main.height, main.width
    assert [run.name for run in runs] == [f"{h}x{w}-batch3-seed2", f"{h}x{w}-batch3-seed0",
                                          f"{h}x{w}-batch2-seed1-random-targets"]
    for run in runs:
        assert (run.height, run.width) == (h, w) and run.text().startswith(f"{h}×{w}, batch {run.batch}")
