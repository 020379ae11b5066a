"""The seed CNN in tinygrad on precision_lab.protocol: weights OIHW, as tinygrad holds them.

`--slip` plants a natural slip: the weights are kept HWIO (a Keras habit), permuted to OIHW for
tinygrad's conv2d, and the OIHW gradient is handed back with .reshape instead of a permute.
"""
import sys

from tinygrad import Tensor

from precision_lab import protocol

SLIP = "--slip" in sys.argv


def compute(request):
    x, t = Tensor(request.input), Tensor(request.target)
    params = {name: Tensor(value) for name, value in request.params.items()}
    oihw = {n: p.permute(3, 2, 0, 1) if SLIP and p.ndim == 4 else p for n, p in params.items()}
    a = x
    for k in (1, 2, 3):
        a = a.conv2d(oihw[f"conv{k}.weight"], oihw[f"conv{k}.bias"], padding=1)
        a = a.relu() if k < 3 else a
    loss = ((a - t) ** 2).mean()
    grads = loss.gradient(*oihw.values())
    return loss.numpy(), {n: g.numpy().reshape(request.shape_of(n)) for n, g in zip(params, grads)}, a.numpy()


protocol.run(compute, layout="HWIO" if SLIP else "OIHW", argv=sys.argv[1:3])
