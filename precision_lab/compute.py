"""One forward and backward of any network, by the op registry (docs/design.md, "Networks").

`forward_backward(problem, dtype, device, kernels)` walks the problem's network forward, takes
the loss and ∂loss/∂output, and walks back, each layer by its op's rules (precision_lab.ops).
The same walk gives the float32 candidates (native kernels, the hand-written convolution
algorithms, emulated TF32/bf16/fp16 operands, alternative summation orders), the defect zoo
(one rule replaced), and the float64 reference with `keep_trace` (precision_lab.reference).

A `Result` holds what a candidate produced, gradients in the canonical layout (OIHW, OI); a
`Trace` adds the intermediates the error model reads: every layer's output and ∂loss/∂output,
kept as float32 roundings except the network's output and its gradient (float64), a ReLU's output
and the gradient at a ReLU's input recomputed on demand from its neighbour (memory at 1024²).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .model import Network
from .ops import LOSSES, OPS, Kernels
from .problem import Problem

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class GradBuffer:
    """A gradient as the candidate wrote it: its values in memory order and the layout it declared.

    `flat` is the buffer read in the order it was written (C order of an npz array, the file
    order of a raw binary); `declared` is the layout the candidate claimed (e.g. HWIO, or IO for
    a linear weight); `order` says how the declared shape was read ("C" or "F").
    """

    flat: np.ndarray
    declared: str
    order: str = "C"


@dataclass
class Result:
    """What one forward + backward produced, gradients in the canonical layout (OIHW / OI).

    Arrays keep the dtype the computation stored them in (float32 for a float32 candidate).
    `intermediates` holds '<layer>.output' and '<layer>.output.grad' when a candidate sends them;
    `buffers` the gradients as written (for the layout doctor), when they came through a bundle.
    """

    loss: float
    grads: dict[str, np.ndarray]
    output: np.ndarray | None = None
    dtype: str = "float32"
    meta: dict = field(default_factory=dict)
    intermediates: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, GradBuffer] = field(default_factory=dict)


@dataclass
class Trace(Result):
    """A Result plus what the error model reads, on the problem's device.

    `values[i]`/`grads_at[i]`: layer i's output and ∂loss/∂(output of layer i), float32 roundings
    (float64 for the last layer), None where recomputed from a neighbour (`value`, `grad_at`).
    `input` (float64, exact float32 values), `target`, `params` (float32, canonical).
    """

    problem: Problem | None = None
    values: list = field(default_factory=list)
    grads_at: list = field(default_factory=list)
    input: torch.Tensor | None = None
    target: torch.Tensor | None = None
    params: dict = field(default_factory=dict)

    @property
    def network(self) -> Network:
        return self.problem.network

    @property
    def device(self) -> torch.device:
        return self.input.device

    def value(self, index: int) -> torch.Tensor:
        """Layer `index`'s output (−1: the network input), recomputed when it was not stored."""
        if index == -1:
            return self.input
        stored = self.values[index]
        if stored is not None:
            return stored
        layer = self.network.layers[index]
        return OPS[layer.op].derive_output(layer.attrs, self.value(layer.inputs[0]))

    def grad_at(self, index: int) -> torch.Tensor:
        """∂loss/∂(output of layer `index`), recomputed when it was not stored."""
        stored = self.grads_at[index]
        if stored is not None:
            return stored
        reader = self.network.layers[self.network.consumers[index][0]]
        return OPS[reader.op].derive_input_grad(reader.attrs, self.grad_at(reader.index), self.value(index))


def to_tensors(problem: Problem, dtype: str = "float32", device: str | torch.device = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Input, target and parameters as tensors, cast exactly from the float32 values (targets of a
    cross-entropy stay int64 class indices); the request's masks ('<layer>.mask', exact 0/1) ride with the
    parameters, where their layer's op reads them, but are never differentiated."""
    torch_dtype = TORCH_DTYPES[dtype]
    x = torch.from_numpy(problem.input).to(device=device, dtype=torch_dtype)
    target = torch.from_numpy(problem.target).to(device=device)
    if target.is_floating_point():
        target = target.to(torch_dtype)
    params = {k: torch.from_numpy(v).to(device=device, dtype=torch_dtype)
              for k, v in {**problem.params, **problem.masks}.items()}
    return x, target, params


def layer_params(params: dict[str, torch.Tensor], layer) -> dict[str, torch.Tensor]:
    """The parameters of one layer by suffix ('weight', 'bias'), and the masks the request carries for it ('mask')."""
    if not layer.name:
        return {}
    op = OPS[layer.op]
    # 'weight', 'bias'; an attention's 'in_proj_weight', …; a training dropout's 'mask'
    suffixes = (*op.param_shapes(layer.attrs), *op.request_masks(layer.attrs))
    return {suffix: params[f"{layer.name}.{suffix}"] for suffix in suffixes if f"{layer.name}.{suffix}" in params}


def _derivable_output(network: Network, index: int) -> bool:
    """A layer whose output is recomputed from its input (a ReLU) need not be stored."""
    layer = network.layers[index]
    op = OPS[layer.op]
    return (getattr(op, "derive_output", None) is not None and len(layer.inputs) == 1
            and index != len(network.layers) - 1)


def _derivable_grad(network: Network, index: int) -> bool:
    """∂loss/∂(output of `index`) is recomputed from its one reader's output gradient (a ReLU's mask)."""
    readers = network.consumers[index]
    if len(readers) != 1 or index == len(network.layers) - 1:
        return False
    reader = network.layers[readers[0]]
    return getattr(OPS[reader.op], "derive_input_grad", None) is not None and len(reader.inputs) == 1


def forward_backward(problem: Problem, dtype: str = "float32", device: str | torch.device = "cpu",
                     kernels: Kernels | None = None, keep_trace: bool = False, rules: dict | None = None,
                     intermediates: bool = False, backward: bool = True) -> Result | Trace:
    """One forward and backward of `problem.network` in `dtype` on `device`, layer by layer.

    `kernels` chooses the convolution algorithm and operand rounding (default: PyTorch native).
    `rules` replaces an op's rules for this call, by layer index, layer name or op name (the defect zoo's
    slips). With `keep_trace`, a Trace for the error model (float32 roundings of the
    intermediates); in float64 the walk then applies ReLUs in place and frees each value once the
    backward is past it (the reference's peak memory at 1024²). With `intermediates`, named
    layers' outputs and output gradients go into `Result.intermediates`. Without `backward`, the forward and the
    loss only: `Result.grads` is empty (the sampled runs that estimate forward quantities alone).
    """
    from .conv.backends import native_flags

    # float32 means IEEE float32: cuDNN's default TF32 would make every float32 walk on a GPU a tf32 one
    # (a kernel that asks for TF32, like the native-tf32 backend, sets it around its own call)
    with native_flags(fp32_precision="ieee"):
        return _forward_backward(problem, dtype, device, kernels, keep_trace, rules, intermediates, backward)


def _forward_backward(problem, dtype, device, kernels, keep_trace, rules, intermediates, backward=True):
    network = problem.network
    kernels = kernels or Kernels()
    rules = rules or {}
    device = torch.device(device)
    x, target, params = to_tensors(problem, dtype, device)
    layers, last = network.layers, len(network.layers) - 1
    saving = keep_trace and dtype == "float64"  # the reference: in-place ReLUs, float32 storage
    stored_values, stored_grads, kept = [None] * len(layers), [None] * len(layers), {}

    def rule(layer):
        return rules.get(layer.index) or (layer.name and rules.get(layer.name)) or rules.get(layer.op) or OPS[layer.op]

    def keep(t: torch.Tensor, index: int) -> torch.Tensor:
        return t if index == last or t.dtype == torch.float32 else t.to(torch.float32)

    with torch.no_grad():
        values: dict[int, torch.Tensor] = {-1: x}
        for layer in layers:
            op = rule(layer)
            inputs = [values[i] for i in layer.inputs]
            source = layer.inputs[0]
            in_place = (saving and getattr(op, "forward_inplace", None) is not None and source >= 0
                        and len(network.consumers[source]) == 1 and len(layer.inputs) == 1)
            if keep_trace and source >= 0 and in_place:
                stored_values[source] = keep(inputs[0], source) if stored_values[source] is None else stored_values[source]
            y = op.forward_inplace(layer.attrs, inputs[0]) if in_place else op.forward(
                layer.attrs, inputs, layer_params(params, layer), kernels)
            values[layer.index] = y
            if keep_trace and not _derivable_output(network, layer.index):
                if stored_values[layer.index] is None and not (saving and _will_be_overwritten(network, layer.index, rules)):
                    stored_values[layer.index] = keep(y, layer.index)
            if intermediates and layer.name:
                kept[f"{layer.name}.output"] = y.detach().cpu().numpy()
        output = values[last]
        loss, grad = (rules.get("loss") or LOSSES[network.loss]).forward_backward(output, target)
        output_np = output.detach().cpu().numpy()

        pending: dict[int, list[torch.Tensor]] = {last: [grad]}
        grads: dict[str, torch.Tensor] = {}
        for layer in reversed(layers if backward else []):
            contributions = pending.pop(layer.index, [])
            if not contributions:  # a branch that reaches no loss (never in a validated network)
                continue
            g = contributions[0]
            for more in contributions[1:]:
                g = g + more
            if keep_trace and not _derivable_grad(network, layer.index):
                stored_grads[layer.index] = keep(g, layer.index)
            if intermediates and layer.name:
                kept[f"{layer.name}.output.grad"] = g.detach().cpu().numpy()
            need = [i >= 0 for i in layer.inputs]
            op = rule(layer)
            owned = saving and len(contributions) == 1 and layer.index != last and not _shared(g, pending)
            if owned and getattr(op, "backward_inplace", None) is not None and values.get(layer.index) is not None:
                input_grads, param_grads = [op.backward_inplace(layer.attrs, g, values[layer.index])], {}
            else:
                input_grads, param_grads = op.backward(layer.attrs, g, [values.get(i) for i in layer.inputs],
                                                       values.get(layer.index), layer_params(params, layer), kernels,
                                                       need)
            for suffix, value in param_grads.items():
                grads[f"{layer.name}.{suffix}"] = value
            for i, gi in zip(layer.inputs, input_grads):
                if gi is not None:
                    pending.setdefault(i, []).append(gi)
            if saving:
                values.pop(layer.index, None)  # every reader of this output is behind us
            del g, contributions
    result_grads = {name: grads[name].detach().cpu().numpy() for name in network.parameter_names if backward}
    meta = {"conv": kernels.name, "device": str(device)}
    common = dict(loss=float(loss), grads=result_grads, output=output_np, dtype=dtype, meta=meta, intermediates=kept)
    if not keep_trace:
        return Result(**common)
    x64 = torch.from_numpy(problem.input).to(device=device, dtype=torch.float64)
    params32 = {k: torch.from_numpy(v).to(device=device, dtype=torch.float32)
                for k, v in {**problem.params, **problem.masks}.items()}
    target_kept = target if not target.is_floating_point() else target.to(torch.float64)
    return Trace(**common, problem=problem, values=stored_values, grads_at=stored_grads, input=x64,
                 target=target_kept, params=params32)


def _shared(t: torch.Tensor, pending: dict) -> bool:
    """Whether the same tensor also waits as another layer's gradient (an add hands g to both inputs)."""
    return any(other is t for contributions in pending.values() for other in contributions)


def _will_be_overwritten(network: Network, index: int, rules: dict) -> bool:
    """True when this output is about to be overwritten by an in-place reader (it is stored then)."""
    readers = network.consumers[index]
    if len(readers) != 1:
        return False
    reader = network.layers[readers[0]]
    op = rules.get(reader.index) or (reader.name and rules.get(reader.name)) or rules.get(reader.op) or OPS[reader.op]
    return getattr(op, "forward_inplace", None) is not None and len(reader.inputs) == 1


# ---------------------------------------------------------------------------------------------
# PyTorch as users run it


def autograd_forward_backward(problem: Problem, dtype: str = "float32", device: str | torch.device = "cpu") -> Result:
    """One step of the network as a PyTorch module (precision_lab.modules) through autograd."""
    from .modules import SpecModule

    network = problem.network
    module = SpecModule(network, device=device, dtype=TORCH_DTYPES[dtype])
    x, target, params = to_tensors(problem, dtype, device)
    with torch.no_grad():
        for name, value in module.named_parameters():
            value.copy_(params[name])
    module.carry({name: params[name] for name in problem.masks})  # the request's masks: no draw of PyTorch's own
    y = module(x)
    loss = module.loss(y, target)
    loss.backward()
    grads = {name: value.grad.detach().cpu().numpy() for name, value in module.named_parameters()}
    return Result(float(loss.detach()), {n: grads[n] for n in network.parameter_names}, y.detach().cpu().numpy(),
                  dtype, {"conv": "native-autograd", "device": str(device)})


#: torch.autocast's dtype for each format a program may store results in (formats.STORED_FORMATS)
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_forward_backward(problem: Problem, fmt: str, device: str | torch.device = "cpu",
                              loss_scale: float = 1.0) -> Result:
    """One step of the network as a PyTorch module under torch.autocast(dtype=fmt) (float32 parameters, results of
    convolutions, linear layers and matmuls stored in the format, the loss in float32), the loss multiplied by
    `loss_scale` before the backward and the gradients divided by it after (GradScaler's unscale)."""
    from .modules import SpecModule

    network = problem.network
    device = torch.device(device)
    module = SpecModule(network, device=device, dtype=torch.float32)
    x, target, params = to_tensors(problem, "float32", device)
    with torch.no_grad():
        for name, value in module.named_parameters():
            value.copy_(params[name])
    module.carry({name: params[name] for name in problem.masks})
    while True:
        module.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=AUTOCAST_DTYPES[fmt]):
            y = module(x)
            loss = module.loss(y, target)
        (loss.float() * loss_scale).backward()
        finite = all(bool(torch.isfinite(value.grad).all()) for value in module.parameters())
        if finite or loss_scale <= 1.0:
            break
        loss_scale = max(1.0, loss_scale / 2)  # GradScaler's backoff: a scaled gradient overflowed, step skipped
    grads = {name: (value.grad / loss_scale).detach().cpu().numpy().astype(np.float32)
             for name, value in module.named_parameters()}
    return Result(float(loss.detach().float()), {n: grads[n] for n in network.parameter_names},
                  y.detach().float().cpu().numpy(), "float32",
                  {"conv": f"autocast-{fmt}", "device": str(device), "loss_scale": loss_scale})
