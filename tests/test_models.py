"""Any network, not only the seed's: model specs, the op registry, PyTorch modules, and the examples."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab import cli
from precision_lab.candidates import resolve
from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import SEED_SPEC, ModelSpecError, load_model, parse_spec
from precision_lab.modules import from_module  # the public name: precision_lab.model never imports modules
from precision_lab.paths import ROOT
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

EXAMPLES = ROOT / "examples" / "models"
SPECS = {"unet": EXAMPLES / "small-unet.json", "resnet": EXAMPLES / "dilated-resnet.yaml",
         "classifier": EXAMPLES / "lenet-classifier.json"}
#: small, non-square sizes each network takes (the classifier's linear layer fixes its input at 28×28)
SIZES = {"unet": (20, 26), "resnet": (17, 23), "classifier": (28, 28), "projection": (18, 22)}


def test_seed_form_expands_to_the_seed_network():
    network = parse_spec(SEED_SPEC)
    assert network.parameter_names == ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "conv3.weight",
                                       "conv3.bias")
    assert [layer.name for layer in network.layers] == ["conv1", "act1", "conv2", "act2", "conv3"]
    assert network.param_shapes["conv2.weight"] == (16, 16, 3, 3)


@pytest.mark.parametrize("spec, message", [
    ({"layers": [{"name": "a", "op": "swish"}]}, r"unknown op 'swish': supported ops are conv2d, linear, relu"),
    ({"layers": [{"name": "c", "op": "conv2d", "in": 2, "out": 4, "kernel": 3}]}, r"c: receives 1 channels but declares 'in': 2"),
    ({"layers": [{"name": "c", "op": "conv2d", "in": 1, "out": 4, "kernel": 3}, {"op": "add", "from": "nope"}]},
     r"'from' is 'nope', which names no earlier layer"),
    ({"layers": [{"name": "c", "op": "conv2d", "in": 1, "out": 1, "kernel": 3},
                 {"name": "c", "op": "conv2d", "in": 1, "out": 1, "kernel": 3}]}, r"c: duplicate layer name"),
    ({"layers": [{"op": "conv2d", "in": 1, "out": 1, "kernel": 3}]}, r"needs a unique 'name'"),
    ({"layers": [{"name": "c", "op": "conv2d", "in": 1, "out": 1, "kernel": 3, "stide": 2}]},
     r"unknown key 'stide' for op conv2d"),
    ({"layers": [{"name": "f", "op": "linear", "in": 4, "out": 2}]}, r"f: linear needs features .* put a flatten"),
    ({"layers": [{"name": "c", "op": "conv2d", "in": 1, "out": 2, "kernel": 3}], "loss": "hinge"},
     r"unknown loss 'hinge'"),
    ({"channels": [1, 4, 1], "activation": "swish"}, r"key 'activation' is 'swish'"),
])
def test_bad_specs_name_the_layer_in_one_line(spec, message):
    with pytest.raises(ModelSpecError, match=message) as info:
        parse_spec(spec, "spec.json")
    assert "\n" not in str(info.value) and "spec.json" in str(info.value)


def test_sizes_the_network_cannot_take_name_the_layer():
    """Strides and pools floor as PyTorch's (an odd input drops its last row); what refuses a size is a layer that
    needs it: the upsample that must bring a stride back to the skip's size, the linear layer's fan-in."""
    unet = load_model(SPECS["unet"])
    with pytest.raises(ModelSpecError, match=r"skip: concatenates a height of 22 with a height of 21"):
        unet.check_size(21, 26)
    classifier = load_model(SPECS["classifier"])
    with pytest.raises(ModelSpecError, match=r"fc1: receives 768 features but declares 'in': 300"):
        classifier.check_size(40, 40)
    # the linear layer fixes the input size up to what the pools floor: 28 to 31 all reach 5×5 features
    assert [n for n in range(20, 40) if classifier.fits(n, n)] == [28, 29, 30, 31]
    assert classifier.default_size(1024) == (31, 31)
    assert unet.sizes_near(61, 67, limit=1) == [(62, 68)]


def test_diagnose_refuses_a_size_the_network_cannot_take(capsys):
    code = cli.main(["diagnose", "--candidate", "native", "--model", str(SPECS["unet"]), "--size", "31x32",
                     "--probes", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "skip: concatenates a height of 32 with a height of 31" in err


@pytest.mark.parametrize("name", list(SPECS))
def test_walk_equals_pytorch_autograd_on_every_example(name):
    problem = make_problem(SIZES[name], 3, 1, network=load_model(SPECS[name]))
    mine = forward_backward(problem, "float64")
    torch_result = autograd_forward_backward(problem, "float64")
    assert abs(mine.loss - torch_result.loss) <= 1e-13 * abs(torch_result.loss)
    for parameter in problem.network.parameter_names:
        scale = np.abs(torch_result.grads[parameter]).max()
        assert np.abs(mine.grads[parameter] - torch_result.grads[parameter]).max() <= 1e-12 * scale, parameter


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_in_place_walk_equals_the_plain_float64_walk(name):
    # the in-place float64 reference (ReLUs overwrite their input, gradients masked in place) changes nothing
    from precision_lab.reference import reference_kernels

    problem = make_problem(SIZES[name], 2, 2, network=load_model(SPECS[name]))
    fast, plain = reference(problem), forward_backward(problem, "float64", kernels=reference_kernels("cpu"))
    for parameter in problem.network.parameter_names:
        assert np.array_equal(fast.grads[parameter], plain.grads[parameter]), parameter


def test_from_module_reads_sequential_and_traced_modules():
    sequential = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3, padding=1))
    network = from_module(sequential)
    assert network.parameter_names == ("0.weight", "0.bias", "3.weight", "3.bias")
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "max_pool2d", "conv2d"]

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.body = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            h = torch.relu(self.stem(x))
            return torch.tanh(self.body(h)) + h

    traced = from_module(Residual())
    assert [layer.op for layer in traced.layers] == ["conv2d", "relu", "conv2d", "tanh", "add"]
    assert traced.layers[-1].source == 1  # the add reads the ReLU's output
    _assert_module_computes_as_the_walk(Residual(), make_problem(12, 1, 0, network=traced))


def _assert_module_computes_as_the_walk(module, problem):
    """The module, given the problem's parameters, has the walk's float64 output."""
    module = module.double()
    with torch.no_grad():
        for key, value in module.state_dict().items():
            value.copy_(torch.from_numpy(problem.params[key]))
    x = torch.from_numpy(problem.input).double()
    assert torch.allclose(module(x), torch.from_numpy(forward_backward(problem, "float64").output), atol=1e-14)


def test_a_parameter_free_module_called_twice_is_two_layers_and_shared_weights_are_refused():
    class TwoLevels(nn.Module):
        """A U-Net's encoder as often written: one nn.MaxPool2d reused at every level."""

        def __init__(self, share: bool = False):
            super().__init__()
            self.c0, self.c1 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.c2 = self.c1 if share else nn.Conv2d(4, 4, 3, padding=1)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x):
            return self.c2(self.pool(self.c1(self.pool(self.c0(x)))))

    network = from_module(TwoLevels())
    assert [(layer.op, layer.name) for layer in network.layers] == [
        ("conv2d", "c0"), ("max_pool2d", "pool"), ("conv2d", "c1"), ("max_pool2d", "pool_1"), ("conv2d", "c2")]
    _assert_module_computes_as_the_walk(TwoLevels(), make_problem(8, 1, 0, network=network))
    with pytest.raises(ModelSpecError, match="c1: called more than once"):
        from_module(TwoLevels(share=True))


def test_from_module_names_an_unsupported_op():
    with pytest.raises(ModelSpecError, match=r"1: unsupported module PixelShuffle: supported ops are conv2d"):
        from_module(nn.Sequential(nn.Conv2d(1, 4, 3), nn.PixelShuffle(2)))


def test_cross_entropy_targets_are_class_indices():
    problem = make_problem(28, 3, 0, network=load_model(SPECS["classifier"]))
    assert problem.target.dtype == np.int64 and problem.target.shape == (3,)
    assert problem.target.min() >= 0 and problem.target.max() < 10


# ---------------------------------------------------------------------------------------------
# the examples as command candidates: right ones roundoff, each planted slip caught with its cause


def _diagnose(capsys, tmp_path, yaml_name, size, probes="none"):
    out_json = tmp_path / "verdict.json"
    code = cli.main(["diagnose", "--candidate", str(EXAMPLES / yaml_name), "--size", f"{size[0]}x{size[1]}",
                     "--batch", "2", "--probes", probes, "--json", str(out_json)])
    capsys.readouterr()
    return code, json.loads(out_json.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("yaml_name, size", [("unet.yaml", SIZES["unet"]), ("resnet.yaml", SIZES["resnet"]),
                                             ("classifier.yaml", SIZES["classifier"]),
                                             ("resnet-projection.yaml", SIZES["projection"]),
                                             ("unet-autocast-bf16.yaml", SIZES["unet"]),
                                             ("classifier-autocast-fp16.yaml", SIZES["classifier"])])
def test_right_example_candidates_are_roundoff_with_probes(capsys, tmp_path, yaml_name, size):
    code, verdict = _diagnose(capsys, tmp_path, yaml_name, size, probes="default")
    assert code == 0 and verdict["verdict"] == "roundoff", verdict["evidence"]
    assert len(verdict["probes"]) == 3 and all(p["verdict"] == "roundoff" for p in verdict["probes"])
    if "autocast-bf16" in yaml_name:  # a small probe's bfloat16 bound certifies little: its own float64 build settles it
        assert any(p["float64_build"] is not None for p in verdict["probes"])


@pytest.mark.slow
@pytest.mark.parametrize("yaml_name, size, verdict_, cause", [
    ("unet-upsample-slip.yaml", SIZES["unet"], "defect", "up backward takes each block's first gradient"),
    ("unet-flip-slip.yaml", SIZES["unet"], "layout", "flip HW"),
    ("unet-tf32-slip.yaml", SIZES["unet"], "reduced-precision", "tf32"),
    ("resnet-skip-slip.yaml", SIZES["resnet"], "defect", "res backward passes no gradient to the skip from act0"),
    ("resnet-ohwi-slip.yaml", SIZES["resnet"], "layout", "layout OHWI"),
    ("resnet-projection-shortcut-slip.yaml", SIZES["projection"], "defect",
     "join backward passes no gradient to the skip from proj"),
    ("classifier-sum-ce-slip.yaml", SIZES["classifier"], "defect", "scaled by the batch size"),
    ("classifier-mask-slip.yaml", SIZES["classifier"], "defect", "mask missing"),
    ("unet-autocast-bf16-as-float32.yaml", SIZES["unet"], "reduced-precision", "bfloat16"),
    # bfloat16's error in the slipped program exceeds the right one's bound on c2.weight: the cause fits 3 of 4
    ("classifier-autocast-bf16-mask-slip.yaml", SIZES["classifier"], "defect", "fits only c1.bias, c1.weight, c2.bias"),
])
def test_planted_slips_are_caught_with_their_cause(capsys, tmp_path, yaml_name, size, verdict_, cause):
    code, verdict = _diagnose(capsys, tmp_path, yaml_name, size)
    assert code == 1 and verdict["verdict"] == verdict_, verdict["evidence"]
    # no cause that explains every defect quantity: the defect doctor's partial fit is in the evidence
    named = verdict["layout_fix"] or verdict["format"] or verdict["cause"] or " ".join(verdict["evidence"])
    assert cause in named, named


@pytest.mark.slow
def test_intermediates_name_the_first_op_that_fails(tmp_path):
    # the response carries every named layer's output and output gradient: the ReLU backward is named
    from precision_lab.candidates.command import load_command_candidate

    yaml_path = tmp_path / "cand.yaml"
    yaml_path.write_text(f"name: masked\nmodel: {SPECS['classifier']}\n"
                         f"command: ['{{python}}', {EXAMPLES / 'candidate.py'}, '{{request}}', '{{response}}', "
                         f"--slip, mask, --intermediates]\n")
    candidate = load_command_candidate(yaml_path)
    problem = make_problem(28, 2, 0, network=candidate.network)
    result = candidate.compute(problem)
    assert "r2.output.grad" in result.intermediates
    judgement = judge(result, reference(problem), "float32", candidate.name)
    assert judgement.verdict == "defect"
    assert judgement.localisation.startswith("r2 backward"), judgement.localisation
    assert "mask missing" in judgement.localisation


def test_a_command_candidate_refuses_another_network(tmp_path):
    candidate = resolve(str(EXAMPLES / "unet.yaml"))
    with pytest.raises(ValueError, match="computes the network 'small-unet'"):
        candidate.compute(make_problem(16, 1, 0))


@pytest.mark.parametrize("size, batch", [((62, 68), 2), ((34, 48), 3)])
def test_tf32_is_named_tf32_where_float16_rounds_the_same_operands_alike(size, batch):
    """TF32 and float16 share a 10-bit significand: where no value leaves float16's range their emulations
    agree to the bit and the level cannot choose; the lab names TF32 (the silent GPU default) and says why."""
    from precision_lab.candidates import get_builtin
    from precision_lab.diagnosis import diagnose
    from precision_lab.problem import make_problem

    problem = make_problem(size, batch, 0, network=load_model(str(SPECS["unet"])))
    diagnosis = diagnose(get_builtin("tf32-emulated"), problem, "cpu", probes=[])
    assert diagnosis.verdict == "reduced-precision" and diagnosis.to_json()["format"] == "tf32"
    assert any("round these operands alike" in line for line in diagnosis.main.evidence)


UNSEEN = {
    # an even kernel at stride 2, a 1×3 bias-free conv, sigmoid into an add skip, avg-pool then a 4× upsample,
    # and a per-pixel cross-entropy over 4 classes, on 3 input channels
    "segmenter": ({"name": "segmenter", "input_channels": 3, "loss": "cross_entropy", "layers": [
        {"name": "a", "op": "conv2d", "in": 3, "out": 6, "kernel": 4, "stride": 2, "padding": 1},
        {"name": "ra", "op": "leaky_relu", "slope": 0.2},
        {"name": "b", "op": "conv2d", "in": 6, "out": 6, "kernel": [1, 3], "padding": [0, 1], "bias": False},
        {"op": "sigmoid"}, {"name": "res", "op": "add", "from": "ra"},
        {"op": "avg_pool2d", "kernel": 2}, {"op": "upsample_nearest", "scale": 4},
        {"name": "head", "op": "conv2d", "in": 6, "out": 4, "kernel": 1}]}, (48, 40), 2),
    # an unpadded stride-2 conv, tanh, an overlapping padded max-pool (most upstream gradients zero), two linears
    "pooled-mlp": ({"name": "pooled-mlp", "input_channels": 2, "loss": "cross_entropy", "layers": [
        {"name": "c", "op": "conv2d", "in": 2, "out": 4, "kernel": 3, "stride": 2}, {"op": "tanh"},
        {"op": "max_pool2d", "kernel": 3, "stride": 2, "padding": 1}, {"op": "flatten"},
        {"name": "l1", "op": "linear", "in": 64, "out": 16}, {"op": "gelu"},
        {"name": "l2", "op": "linear", "in": 16, "out": 5, "bias": False}]}, (16, 16), 3),
}


@pytest.mark.parametrize("name", UNSEEN)
def test_every_zoo_verdict_is_right_on_architectures_the_zoo_was_not_written_for(name):
    from precision_lab.calibration import judge_zoo
    from precision_lab.problem import make_problem

    spec, size, batch = UNSEEN[name]
    table = judge_zoo(make_problem(size, batch, 1, network=parse_spec(spec)), "cpu")
    assert len(table) >= 24
    wrong = table[~table["correct"]]
    assert wrong.empty, wrong[["candidate", "expected", "verdict", "detail", "worst_ratio"]].to_string()
