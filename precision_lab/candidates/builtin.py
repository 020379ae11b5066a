"""Built-in candidates: PyTorch native, precision emulation, and the motivating-case replay."""
from __future__ import annotations

import numpy as np
import torch

from .. import formats
from ..compute import Result, autocast_forward_backward, autograd_forward_backward, forward_backward
from ..layout import from_layout, to_layout
from ..ops import OPS, Kernels
from ..problem import Problem
from . import Candidate, register


def _native(tf32: bool, **knobs):
    """PyTorch autograd; on a GPU with cuDNN/cuBLAS float32 precision 'tf32' or 'ieee' and any cuDNN knobs
    (benchmark, deterministic), restored afterwards (conv.backends.native_flags)."""
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        if device.type != "cuda":
            return autograd_forward_backward(problem, precision, device)
        from ..conv.backends import native_flags

        mode = "tf32" if tf32 and precision == "float32" else "ieee"
        with native_flags(fp32_precision=mode, **knobs):
            result = autograd_forward_backward(problem, precision, device)
        result.meta.update(fp32_precision=mode, cudnn=torch.backends.cudnn.version(), **knobs)
        return result

    return run


register(Candidate(
    name="native",
    description="PyTorch autograd on the device, float32 IEEE arithmetic (TF32 off on GPU)",
    run=_native(tf32=False),
))

register(Candidate(
    name="native-tf32",
    description="PyTorch autograd on GPU with TF32 allowed (cuDNN's default), claimed as float32",
    run=_native(tf32=True),
    devices=("cuda",),
    expected="reduced-precision", expected_detail="tf32",
))


register(Candidate(
    name="native-benchmark",
    description="PyTorch autograd on GPU, TF32 off, cuDNN autotuner on (benchmark=True: the fastest kernel per shape)",
    run=_native(tf32=False, benchmark=True),
    devices=("cuda",),
))

register(Candidate(
    name="native-deterministic",
    description="PyTorch autograd on GPU, TF32 off, cuDNN restricted to deterministic kernels (no autotuning)",
    run=_native(tf32=False, deterministic=True, benchmark=False),
    devices=("cuda",),
))


def emulated(fmt: str, passes=Kernels.PASSES):
    """A float32 forward + backward with every sum's operands rounded to `fmt` (the float64 build: none)."""
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        if precision == "float64":  # the recompiled build has no reduced-precision inputs
            return forward_backward(problem, "float64", device)
        kernels = Kernels(round_operands=lambda a: formats.round_to(a, fmt), rounded_passes=passes,
                          name=f"{fmt}-emulated")
        return forward_backward(problem, "float32", device, kernels=kernels)

    return run


def autocast(fmt: str, loss_scale: float = 1.0):
    """PyTorch autograd under torch.autocast(dtype=fmt) on the problem's device, the loss multiplied by `loss_scale`
    before the backward and the gradients divided by it after, as GradScaler does (the float64 build: none)."""
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        if precision == "float64":
            return autograd_forward_backward(problem, "float64", device)
        return autocast_forward_backward(problem, fmt, device, loss_scale)

    return run


def _autocast_runs(network) -> bool:
    """Whether PyTorch's CPU autocast runs the network: an evaluation-mode batch norm of a bfloat16 input with float32
    running statistics is refused there ("mixed dtype (CPU)"), as it is for any user."""
    return all(OPS[layer.op].autocast_cpu_runs(layer.attrs) for layer in network.layers)


#: GradScaler's initial scale (torch.amp.GradScaler(init_scale=2.0**16)): what a float16 program starts from
GRAD_SCALER_INIT = 2.0 ** 16

register(Candidate(
    name="autocast-bfloat16",
    description="PyTorch autograd under torch.autocast with bfloat16 (results stored in bfloat16), claimed as bfloat16",
    run=autocast("bfloat16"), claimed_precision="bfloat16", applies=_autocast_runs,
))

register(Candidate(
    name="autocast-float16",
    description="PyTorch autograd under torch.autocast with float16 and GradScaler's initial loss scale 2^16, claimed "
                "as float16 with that scale",
    run=autocast("float16", GRAD_SCALER_INIT), claimed_precision="float16", loss_scale=GRAD_SCALER_INIT,
    applies=_autocast_runs,
))

register(Candidate(
    name="autocast-bfloat16-as-float32",
    description="PyTorch autograd under torch.autocast with bfloat16, claimed as float32 (autocast left on)",
    run=autocast("bfloat16"), expected="reduced-precision", expected_detail="bfloat16", applies=_autocast_runs,
))

register(Candidate(
    name="tf32-emulated",
    description="float32 arithmetic with every convolution operand rounded to TF32 (10 mantissa bits), claimed as float32",
    run=emulated("tf32"),
    expected="reduced-precision", expected_detail="tf32",
))


# --- the motivating case ----------------------------------------------------------------------
# The seed's Fortran code stores weights (H, W, In, Out); cuDNN returns weight gradients
# (Out, In, H, W); the code converts them back. The right conversion is a pure transpose
# (cuDNN in CROSS_CORRELATION mode, as PyTorch); the slip adds a spatial flip.

FORTRAN_LAYOUT = "HWIO"


def _fortran_replay(flip_slip: bool):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        weights = problem.network.weight_names
        # weights as the Fortran program holds them, converted to cuDNN's layout for the call
        stored = {name: to_layout(problem.params[name], FORTRAN_LAYOUT) for name in weights}
        cudnn_params = dict(problem.params, **{name: from_layout(w, FORTRAN_LAYOUT) for name, w in stored.items()})
        result = forward_backward(problem.with_params(cudnn_params), precision, device)
        for name in weights:
            grad = result.grads[name]  # as cuDNN returns it: (Out, In, H, W)
            if flip_slip and grad.ndim == 4:
                grad = grad[:, :, ::-1, ::-1]
            written = to_layout(np.ascontiguousarray(grad), FORTRAN_LAYOUT)
            # the lab reads the gradient back through the layout the program declares
            result.grads[name] = from_layout(written, FORTRAN_LAYOUT)
        result.meta["weight_layout"] = FORTRAN_LAYOUT
        return result

    return run


register(Candidate(
    name="fortran-replay",
    description="the seed's Fortran/cuDNN design (weights H,W,In,Out), gradient conversion right",
    run=_fortran_replay(flip_slip=False),
    weight_layout=FORTRAN_LAYOUT,
    meta={"motivating_case": True},
))

register(Candidate(
    name="fortran-replay-flip",
    description="the seed's Fortran/cuDNN design with the conversion slip: a spatial flip on the weight gradients",
    run=_fortran_replay(flip_slip=True),
    weight_layout=FORTRAN_LAYOUT,
    expected="layout", expected_detail="flip HW",
    meta={"motivating_case": True},
    applies=lambda network: any(len(s) == 4 and s[2] * s[3] > 1 for s in network.param_shapes.values()),
))
