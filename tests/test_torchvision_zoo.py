"""torchvision's own classification models: they convert (from_module, the `module` form of a model), the spec
computes what the module computes, and the module itself as a command candidate is judged right, its slips defects."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_lab import cli
from precision_lab.model import ModelSpecError, load_model

try:  # a torchvision built for another torch fails at import with a RuntimeError, not an ImportError
    import torchvision
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"torchvision does not import here ({type(exc).__name__}): make setup installs the one built for "
                f"this torch", allow_module_level=True)

from precision_lab.modules import SpecModule, from_module  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchvision"
#: the families and the variant of each the tests build (the smallest of the family)
FAMILIES = {"alexnet": "alexnet", "convnext": "convnext_tiny", "densenet": "densenet121",
            "efficientnet": "efficientnet_b0", "googlenet": "googlenet", "mnasnet": "mnasnet0_5",
            "mobilenet_v2": "mobilenet_v2", "mobilenet_v3": "mobilenet_v3_small", "regnet": "regnet_x_400mf",
            "resnet": "resnet18", "resnext": "resnext50_32x4d", "shufflenet": "shufflenet_v2_x0_5",
            "squeezenet": "squeezenet1_0", "vgg": "vgg11_bn", "swin": "swin_t", "vit": "vit_b_16"}
ARGUMENTS = {"googlenet": {"aux_logits": False, "init_weights": True}}  # its auxiliary heads: a second output


def _module(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(torchvision.models, variant)(num_classes=10, **ARGUMENTS.get(variant, {})).train()


def test_the_module_form_reads_what_from_module_reads(tmp_path):
    spec = {"module": "torchvision.models:resnet18", "arguments": {"num_classes": 10}, "loss": "cross_entropy"}
    path = tmp_path / "resnet.json"
    path.write_text(json.dumps(spec))
    network = load_model(path)
    direct = from_module(_module("resnet18"), loss="cross_entropy")
    assert [layer.op for layer in network.layers] == [layer.op for layer in direct.layers]
    assert network.param_shapes == direct.param_shapes and network.loss == "cross_entropy"
    assert network.name == "resnet"  # the file's name, as a spec file's
    assert load_model(spec).name == "resnet18"  # else the callable's


@pytest.mark.parametrize("spec, says", [
    ({"module": "torchvision.models.resnet18"}, "expected 'package.module:callable'"),
    ({"module": "no_such_package_here:net"}, "cannot import no_such_package_here"),
    ({"module": "torchvision.models:no_such_net"}, "has no 'no_such_net'"),
    ({"module": "torchvision.models:resnet18", "arguments": {"classes": 3}}, "failed: TypeError"),
    ({"module": "torchvision.models:resnet18", "arguments": [10]}, "expected a mapping"),
    ({"module": "torchvision.models:resnet18", "layers": []}, "unknown key 'layers' beside 'module'"),
    ({"module": "torchvision.models:resnet18", "loss": "hinge"}, "unknown loss 'hinge'"),
])
def test_a_wrong_module_form_says_what_in_one_line(spec, says):
    with pytest.raises(ModelSpecError, match=None) as caught:
        load_model(spec)
    assert says in str(caught.value) and "\n" not in str(caught.value)
