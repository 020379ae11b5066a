"""Networks as PyTorch modules, both ways (docs/design.md, "Networks").

* `SpecModule(network)`: the spec as an `nn.Module` (nn.Conv2d / nn.Linear under the layer names,
  functional ops between them), so `state_dict` names are the spec's parameter names; the
  `native` candidate runs it through autograd, as PyTorch users do.
* `from_module(module)`: an `nn.Sequential`, or a module `torch.fx` can trace, built from the
  supported ops, as a model spec; an unsupported op is named with the supported set.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import Network, parse_spec, symbolic_shapes
from .ops import LOSSES, OPS
from .ops.losses import MSE
from .tracing import module_spec


class SpecModule(nn.Module):
    """A Network as a PyTorch module: parameters under '<layer name>.weight' / '.bias'."""

    def __init__(self, network: Network, device=None, dtype=None):
        super().__init__()
        place = {"device": device, "dtype": dtype}  # built where it runs: no host copy to move
        self.network = network
        self.steps = []
        self.held = set()  # layers whose op has a module (parameters, or a training dropout's mask buffer)
        for layer in network.layers:
            module = OPS[layer.op].torch_module(layer.attrs, **place)
            if module is not None:
                self._add(layer.name, module)
                self.held.add(layer.name)

    def carry(self, masks: dict) -> None:
        """Hand each mask the request carries ('<layer>.mask') to its layer's module, as a buffer (not a parameter)."""
        for name, value in masks.items():
            layer, suffix = name.rsplit(".", 1)
            self._module(layer).register_buffer(suffix, value)

    def _add(self, name: str, module: nn.Module) -> None:
        # a dotted name ('enc.conv1') becomes nested modules, so state_dict keys read 'enc.conv1.weight'
        parent = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        for child_name, child in getattr(parent, leaf, nn.Module()).named_children():
            module.add_module(child_name, child)  # a layer named by a module whose sublayers came first (layer scale)
        parent.add_module(leaf, module)

    def _module(self, name: str) -> nn.Module:
        module = self
        for part in name.split("."):
            module = getattr(module, part)
        return module

    def forward(self, x):
        outputs = {-1: x}
        for layer in self.network.layers:
            op = OPS[layer.op]
            xs = [outputs[i] for i in layer.inputs]
            module = self._module(layer.name) if layer.name in self.held else None
            device = xs[0].device.type
            if op.autocast_float32 and torch.is_autocast_enabled(device):
                # CUDA's autocast runs it in float32 (PyTorch's CPU layer norm in bfloat16 sums its weight and bias
                # gradients in bfloat16: 4096 ones sum to 512)
                with torch.autocast(device, enabled=False):
                    outputs[layer.index] = op.torch_forward(layer.attrs, [t.float() for t in xs], module)
            else:
                outputs[layer.index] = op.torch_forward(layer.attrs, xs, module)
        return outputs[len(self.network.layers) - 1]

    def loss(self, y, target):
        return LOSSES[self.network.loss].torch_loss(y, target)


# ---------------------------------------------------------------------------------------------
# module → spec


def from_module(module: nn.Module, input_channels: int | None = None, loss: str = MSE.name, name: str | None = None) -> Network:
    """A Network from an nn.Sequential or a torch.fx-traceable module built from supported ops (precision_lab.tracing).

    Parameter names stay PyTorch's (`state_dict` keys). `input_channels` defaults to the first
    convolution's in_channels (plain or transposed); `loss` is "mse" or "cross_entropy" (a module does not say).
    """
    spec = module_spec(module, symbolic_shapes, input_channels, loss, name)
    return parse_spec(spec, spec["name"])
