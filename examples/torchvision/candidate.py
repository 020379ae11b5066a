"""A torchvision model as a command candidate: the lab's problem in, torchvision's own forward and backward out.

Usage: python candidate.py [REQUEST_DIR RESPONSE_DIR] [--model resnet18] [--slip bias-one-sample|first-conv-1pct|
                                                      first-conv-zeroed]
(without the two folders and with PRECISION_LAB_WORKER=1 it answers every request on stdin: `worker: true`)
The YAML's `model:` is the same module ({"module": "torchvision.models:resnet18", …}), so the lab's spec and this
program are one definition. `--slip` plants a bug a hand-written port makes, so the example shows what the lab says.
"""
import argparse

import torch
import torch.nn.functional as F
import torchvision

from precision_lab import protocol


class LabMask(torch.nn.Module):
    """A training dropout or stochastic depth applying the lab's mask (request.masks) instead of drawing its own."""

    def __init__(self, mask, p):
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x):
        return x * self.mask / (1 - self.p)


def compute(request, name, slip):
    dtype = torch.float64 if request.dtype == "float64" else torch.float32
    classes = request.network.output_shape(*request.input.shape[2:])[0]
    model = getattr(torchvision.models, name)(num_classes=classes).to(dtype).train()
    for layer, module in list(model.named_modules()):
        if f"{layer}.mask" in request.masks:  # the lab's draw, so both sides drop the same units
            parent, _, child = layer.rpartition(".")
            setattr(model.get_submodule(parent), child, LabMask(torch.from_numpy(request.masks[f"{layer}.mask"]), module.p))
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in request.params.items()}, strict=False)
    assert not unexpected and not set(missing) & set(dict(model.named_parameters())), (missing, unexpected)
    x, target = torch.from_numpy(request.input), torch.from_numpy(request.target)
    output = model(x)
    loss = F.cross_entropy(output, target)
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    first_conv = next(k for k, p in model.named_parameters() if p.dim() == 4)
    last_bias = [k for k, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1] + ".bias"
    if slip == "bias-one-sample":  # the batch loop kept the first sample's term instead of summing
        grads[last_bias] = (F.softmax(output[:1], 1) - F.one_hot(target[:1], classes)).sum(0).detach() / len(target)
    elif slip == "first-conv-1pct":
        grads[first_conv] = grads[first_conv] * 1.01
    elif slip == "first-conv-zeroed":
        grads[first_conv] = torch.zeros_like(grads[first_conv])
    return loss.item(), {k: g.numpy() for k, g in grads.items()}, output.detach().numpy()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("request", nargs="?")  # none in worker mode: the requests come on stdin
    parser.add_argument("response", nargs="?")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--slip", choices=["bias-one-sample", "first-conv-1pct", "first-conv-zeroed"])
    args = parser.parse_args()
    protocol.run(lambda request: compute(request, args.model, args.slip),
                 argv=[a for a in (args.request, args.response) if a is not None])
