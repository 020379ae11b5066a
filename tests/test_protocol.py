"""precision_lab.protocol: a request in the user's layouts and dtype, a response checked and converted back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from precision_lab import protocol
from precision_lab.bundle import read_response, write_request
from precision_lab.layout import to_layout
from precision_lab.model import load_model
from precision_lab.problem import make_problem

CLASSIFIER = {"input_channels": 2, "layers": [
    {"name": "c1", "op": "conv2d", "in": 2, "out": 3, "kernel": 3, "padding": 1},
    {"op": "relu"}, {"op": "flatten"}, {"name": "fc", "op": "linear", "in": 3 * 4 * 5, "out": 4}], "loss": "mse"}


@pytest.fixture()
def problem():
    return make_problem((4, 5), 2, 3, network=load_model(CLASSIFIER))


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("request_layout,user_layout", [("HWIO", "OIHW"), ("OIHW", "HWIO"), ("IOHW", "OHWI")])
def test_request_arrives_in_the_users_layout_and_the_response_goes_back_in_the_requests(
        tmp_path, problem, raw, request_layout, user_layout):
    write_request(problem, tmp_path / "req", "float64", request_layout, raw=raw)
    request = protocol.read_request(tmp_path / "req", layout=user_layout, activations="NHWC")
    assert request.dtype == np.float64 and request.request_layout == request_layout and request.raw == raw
    np.testing.assert_array_equal(request.input, problem.input.transpose(0, 2, 3, 1))
    # 4-D weights in the user's layout, 2-D ones keep its relative order of O and I
    np.testing.assert_array_equal(request.params["c1.weight"], to_layout(problem.params["c1.weight"], user_layout))
    linear = problem.params["fc.weight"] if user_layout.index("O") < user_layout.index("I") else problem.params["fc.weight"].T
    np.testing.assert_array_equal(request.params["fc.weight"], linear)
    # distinct values per element: a response written back must land each one where the request had it
    grads = {name: value * 2 for name, value in request.params.items()}
    protocol.write_response(tmp_path / "resp", request, 1.5, grads)
    back = read_response(tmp_path / "resp", "float64", request_layout, problem.input.shape, problem.network)
    assert float(back.arrays["loss"]) == 1.5 and ("arrays" in back.manifest) == raw
    expected = {f"{n}.grad": 2 * to_layout(problem.params[n].astype(np.float64), request_layout)
                for n in problem.network.parameter_names}
    for name, value in expected.items():
        np.testing.assert_array_equal(back.arrays[name], value)


def _answer(request, **change):
    grads = {name: np.zeros(request.shape_of(name), request.dtype) for name in request.parameter_names}
    grads.update(change)
    return np.float32(0.5), {k: v for k, v in grads.items() if v is not None}


@pytest.mark.parametrize("change,message", [
    ({"fc.bias": None}, "no gradient for 'fc.bias'"),
    ({"fc.weight": np.zeros((60, 4), np.float32)}, "has shape (60, 4), expected (4, 60)"),
    ({"c1.bias": np.zeros(3, np.float64)}, "has dtype float64, expected float32"),
    ({"c1.bias": np.array([0, np.nan, 0], np.float32)}, "NaN or infinite"),
    ({"fc2.weight": np.zeros(3, np.float32)}, "'fc2.weight' is not a parameter"),
])
def test_a_broken_response_is_one_line_and_exit_2(tmp_path, problem, capsys, change, message):
    write_request(problem, tmp_path / "req", "float32", "OIHW")
    with pytest.raises(SystemExit) as stop:
        protocol.run(lambda request: _answer(request, **change), argv=[str(tmp_path / "req"), str(tmp_path / "resp")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_broken_request_is_one_line_and_exit_2(tmp_path, problem, capsys):
    write_request(problem, tmp_path / "req", "float32", "OIHW")
    manifest = json.loads((tmp_path / "req" / "bundle.json").read_text())
    (tmp_path / "req" / "bundle.json").write_text(json.dumps(dict(manifest, weight_layout="OIHX")))
    with pytest.raises(SystemExit) as stop:
        protocol.run(lambda request: None, argv=[str(tmp_path / "req"), str(tmp_path / "resp")])
    assert stop.value.code == 2 and "weight_layout" in capsys.readouterr().err


def test_output_is_taken_in_the_users_activation_layout(tmp_path, problem):
    write_request(problem, tmp_path / "req", "float32", "OIHW")
    request = protocol.read_request(tmp_path / "req", activations="NHWC")
    loss, grads = _answer(request)
    with pytest.raises(protocol.ProtocolError, match=r"'output' has shape \(2, 5\), expected \(2, 4\)"):
        protocol.write_response(tmp_path / "resp", request, loss, grads, np.zeros((2, 5), np.float32))
    protocol.write_response(tmp_path / "resp", request, loss, grads, np.ones((2, 4), np.float32))
