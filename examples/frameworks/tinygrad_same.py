"""tf-same-classifier.json in tinygrad on precision_lab.protocol: TensorFlow's "same" padding written out per
side (a stride-2 3×3 conv pads 0 above and left, 1 below and right), an average pool that divides by the
in-bounds count, tinygrad's own NCHW/OIHW layouts and (C, H, W) flatten."""
import sys

from tinygrad import Tensor

from precision_lab import protocol


def compute(request):
    p = {n: Tensor(v) for n, v in request.params.items()}
    a = Tensor(request.input).conv2d(p["c1.weight"], p["c1.bias"], padding=1).relu()
    a = a.pad((0, 1, 0, 1)).conv2d(p["down.weight"], p["down.bias"], stride=2).relu()  # (left, right, top, bottom)
    a = a.avg_pool2d((3, 3), stride=1, padding=1, count_include_pad=False)
    out = a.flatten(1).linear(p["fc.weight"].T, p["fc.bias"])
    loss = ((out - Tensor(request.target)) ** 2).mean()
    grads = loss.gradient(*p.values())
    return loss.numpy(), {n: g.numpy() for n, g in zip(p, grads)}, out.numpy()


protocol.run(compute, layout="OIHW", argv=sys.argv[1:3])
