"""The op registry: the one place where each op of a model spec is defined (docs/design.md, "Networks").

Every op is one class registered under its spec name. It says, for itself:

* which attributes it takes and what they default to (`keys`), and checks them (`normalise`);
* its output shape for given input shapes (`out_shape`, `axis_length`), refusing a size that a
  layer cannot take (as PyTorch: strides and pools floor); its parameters and their canonical shapes (`param_shapes`);
* its forward and its backward in any dtype (`forward`, `backward`), through `Kernels` (which
  convolution algorithm, which operand rounding), so the same walk gives the float32 candidates,
  the float64 reference and the emulated formats;
* the masks a request carries for it beyond its parameters (`request_masks`, `draw_mask`: a training
  dropout's `<layer>.mask`, drawn by the lab from the seed, handed to forward and backward with the parameters);
* its part of the rounding-error model (`forward_error`, `backward_error`): term counts n,
  absolute-term sums S, how an upstream error propagates through it (ReLU flips within the bound,
  max-pool switches between near-tied inputs, routing through upsample and concat, add).

`precision_lab.compute` walks a network forward and backward with these rules and
`precision_lab.errmodel` walks the bounds; nothing else knows op names (tinygrad's
`pm_gradient` table is the model: adding an op is adding a class here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import roundoff

#: marks an attribute without a default
REQUIRED = object()
#: the reserved name of the network's input among a layer's `inputs`
NETWORK_INPUT = "input"


class _BatchSize:
    """The batch size as a traced module reads it (`x.shape[0]`, `x.size(0)`): a reshape's first size."""

    def __repr__(self):
        return "x.shape[0]"


#: what modules.from_module passes an op's `from_torch_call` in place of a traced `x.shape[0]`
BATCH_SIZE = _BatchSize()


class OpSpecError(ValueError):
    """An attribute or shape an op cannot take; model.py prefixes the spec and the layer."""


# ---------------------------------------------------------------------------------------------
# attribute helpers


def as_pair(value, key: str, minimum: int) -> tuple[int, int]:
    """An int or [h, w] attribute as a pair of ints ≥ minimum (OpSpecError otherwise)."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        pair = (int(value[0]), int(value[1]))
    else:
        raise OpSpecError(f"'{key}' is {value!r}: expected an integer or [height, width]")
    if min(pair) < minimum:
        raise OpSpecError(f"'{key}' is {value!r}: expected values ≥ {minimum}")
    return pair


def positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OpSpecError(f"'{key}' is {value!r}: expected a positive integer")
    return value


# ---------------------------------------------------------------------------------------------
# what the error model carries from op to op


@dataclass
class Field:
    """A tensor of the forward pass as the error model sees it.

    `value`: the exact value (float32 rounding of the float64 reference); `error`: an elementwise
    bound on |candidate − exact| (None: exact, e.g. the network input); `radius`: how far (in pixels
    of this tensor's grid) the roundings behind an element's error reach (None: anywhere in the
    sample, after a flatten); `flips`: ReLU-like decisions upstream that the errors could flip;
    `memo`: what the op's backward_error needs from its forward_error (flip masks, switches).
    """

    value: torch.Tensor | None
    error: torch.Tensor | None
    radius: int | None = 0
    flips: int = 0
    memo: dict = field(default_factory=dict)
    nonnegative: bool = False  # value ≥ 0 everywhere (a ReLU output): |value| is value itself
    consumable: bool = False  # set by the walk: the one reader may overwrite `error` (nobody reads it after)
    coupled: bool = False  # errors shared across the batch's samples (a batch norm's statistics): sums over samples see them dependent


@dataclass
class GradField:
    """An output gradient's error as the backward walk carries it.

    `error` (E): modelled as mean-zero rounding errors, summed with the dependency bound in long sums;
    `flips` (F): deterministic errors of flipped ReLUs and switched max-pools (the whole gradient may
    be passed or blocked), added in absolute value; `radius` as in Field; `flip_count`: flip points
    upstream of this gradient (evidence).
    """

    error: torch.Tensor
    flips: torch.Tensor | None = None
    radius: int | None = 0
    flip_count: int = 0
    owned: bool = True  # False when the tensors are held elsewhere too (an add's two inputs, a view of them): never overwrite them
    coupled: bool = False  # as Field.coupled: errors shared across the batch's samples


@dataclass
class Parts:
    """The bound of one quantity (a parameter gradient, the output, the loss), element by element."""

    n: int
    abs_sum: torch.Tensor  # S
    accumulation: torch.Tensor  # γ̃ₙ(λ)·S
    input_rounding: torch.Tensor | float  # reduced-format operand rounding
    propagated: torch.Tensor | float  # upstream errors entering this sum
    flips: int = 0
    drifted: torch.Tensor | None = None  # elements whose own part is a repeated-value sum's simulated drift
    # the share of `accumulation` a reduced format's sampled runs draw themselves (an attention block's operand
    # roundings inside it, Op.forward_rounded): left out of the own part where those runs bound the quantity
    drawn: torch.Tensor | None = None


@dataclass
class BoundContext:
    """What every op's error rule needs: the claimed arithmetic and the bound's own convolutions."""

    precision: str  # the claimed precision (operands rounded when reduced)
    u: float  # unit roundoff of the accumulation
    lam: float
    kernels: "Kernels"  # float32 IEEE convolutions for the bounds
    # sums every claim's bound forms alike (errmodel: one dict per trace), and the layer whose rule runs
    shared: dict | None = None
    layer: int | None = None
    _formed: int = 0

    def at_layer(self, index: int) -> None:
        """The layer whose error rule runs next (its shared sums are keyed by it)."""
        self.layer, self._formed = index, 0

    def shared_sum(self, compute) -> torch.Tensor:
        """compute(), a sum of the trace's own values only (no error, no claim: S = Σ|a|·|g|), formed once per trace
        and layer and handed to each claim's bound as a copy; the k-th such sum of a layer's rule is the k-th of
        every claim's, since the rules are the same."""
        if self.shared is None or self.layer is None:
            return compute()
        key = (self.layer, self._formed)
        self._formed += 1
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key].clone()

    def gamma(self, n: int) -> float:
        """γ̃ₙ(λ) at the accumulation's unit roundoff."""
        return roundoff.probabilistic_gamma(max(1, n), self.u, self.lam)

    def rounding_term(self, op, x, y) -> torch.Tensor | float:
        return roundoff.rounding_term(op, x, y, self.precision, self.lam)

    def sum_of_errors(self, deterministic, squares, chi: int):
        return roundoff.sum_of_errors(deterministic, squares, chi, self.lam)


@dataclass
class SharedDraw:
    """A rounding shared by a group of elements (a normalisation's statistic) in the sampled propagation
    (precision_lab.sampled): one draw per element of `scale` (the groups' shape), reaching every element of the
    group through `coefficient` (signed, broadcastable against `scale`; the product reshaped to the tensor's)."""

    coefficient: torch.Tensor
    scale: torch.Tensor


def coupled_terms(n: int, *fields) -> int | None:
    """A sum's term count n where any of `fields` (Field, GradField) carries errors shared across the batch's
    samples (roundoff.dependency_count's `coupled_terms`), else None."""
    return n if any(f is not None and f.coupled for f in fields) else None


# ---------------------------------------------------------------------------------------------
# the registry


class Op:
    """Base of every op: no attributes, no parameters, shape unchanged, identity rules."""

    name = ""
    keys: dict = {}
    parametrised = False
    combines = False  # reads a second input named by `from`
    arity = None  # how many inputs it reads where not 2 (combines) or 1: named by `inputs`
    joins_many = False  # a traced call may pass it more inputs than its arity, named by `inputs` (expand chains them)
    elementwise = False  # output element i depends on input element i only
    masks = False  # its backward masks by its forward's decisions: the local bound reads the forward's flips
    windowed = False  # a convolution: its weight gradient sums windows of its input (the zoo's window slips plant there)
    # what the defect doctor shifts by a pixel to recompute its weight gradient (weight_grad_from): "input", "gradient"
    window_shifts = None
    flattens = False  # turns an image into features: the image size is then fixed by the reader's fan-in
    reads_error_backward = False  # backward_error reads its input's forward error (parametrised and smooth ops)
    returns_pair = False  # its PyTorch module returns (output, extra), read as module(x)[0] (nn.MultiheadAttention)
    pieces: tuple = ()  # those of its torch_calls that return several tensors (x.chunk), each a layer read by [i]
    weight_letters = None  # what O and I of a weight layout mean for its weight, where not a convolution's out and in
    # a reduced format's rounded operands (ctx.rounding_term): its float inputs and these parameters, which the sampled
    # runs perturb by their rounding (precision_lab.sampled); None: its products read no rounded operand
    rounded_params: tuple[str, ...] | None = None
    # its products read intermediates of its own (an attention block): a reduced format's sampled runs draw their
    # rounding through forward_rounded and backward_rounded, as no draw on its inputs reaches them
    rounds_inside = False
    # its backward follows a decision of its forward (a ReLU's sign, a max pool's largest input): a reduced format's
    # sampled runs take the decision from the reference and add its flips' mean and spread (switch_flips)
    switches = False

    def expand(self, raw: dict) -> list[dict]:
        """The spec layers one written layer stands for (a convolution's "same" padding: a pad, then the conv)."""
        return [raw]

    def normalise(self, attrs: dict) -> dict:
        unknown = sorted(set(map(str, attrs)) - set(self.keys))
        if unknown:
            allowed = ", ".join(self.keys) or "none"
            raise OpSpecError(f"unknown key {unknown[0]!r} for op {self.name} (its keys: {allowed})")
        filled = {}
        for key, default in self.keys.items():
            if key in attrs:
                filled[key] = attrs[key]
            elif default is REQUIRED:
                raise OpSpecError(f"op {self.name} needs key {key!r}")
            else:
                filled[key] = default
        return self.check(filled)

    def check(self, attrs: dict) -> dict:
        return attrs

    def out_shape(self, attrs: dict, in_shapes: list[tuple]) -> tuple:
        return in_shapes[0]

    def axis_length(self, attrs: dict, lengths: list, axis: int):
        """Length along spatial `axis` (0: H, 1: W) of the output for input lengths (None: not spatial)."""
        return lengths[0]

    def param_shapes(self, attrs: dict) -> dict[str, tuple[int, ...]]:
        return {}

    def describe(self, attrs: dict) -> str:
        return self.name

    # arrays the request carries beyond the parameters (a training dropout's mask) ----------------------
    def request_masks(self, attrs: dict) -> tuple[str, ...]:
        """Suffixes of the masks a request carries for this layer ('<layer>.mask'), each of the layer's output shape,
        batch included: drawn by the lab from the problem's seed, read by forward and backward through `params`,
        never differentiated, answered or judged."""
        return ()

    def draw_mask(self, attrs: dict, suffix: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """One mask of `request_masks` (float64 on the host), drawn from `generator`."""
        raise NotImplementedError(f"op {self.name} carries no mask {suffix!r}")

    def couples_batch(self, attrs: dict) -> bool:
        """Whether one sample's output reads the other samples (a training-mode batch norm): a sub-batch then computes
        another function, and errors shared across samples are marked `coupled` (Field)."""
        return False

    #: CUDA's torch.autocast runs it in float32 (its float32 list: layer_norm, group_norm, softmax): the builtin
    #: autocast candidates run it so on every device (modules.SpecModule), as GPU users' programs do
    autocast_float32 = False

    def autocast_cpu_runs(self, attrs: dict) -> bool:
        """Whether PyTorch's CPU autocast runs the op on a reduced-format input (False: PyTorch refuses it there)."""
        return True

    # as PyTorch runs it (modules.SpecModule) -----------------------------------------------------
    def torch_module(self, attrs: dict, device=None, dtype=None):
        """The nn.Module holding a parametrised op's parameters (None: a functional op)."""
        return None

    def torch_forward(self, attrs: dict, xs: list[torch.Tensor], module) -> torch.Tensor:
        """The forward as a PyTorch user writes it (autograd gives the backward): `module` is torch_module's."""
        raise NotImplementedError(f"op {self.name} has no PyTorch form")

    # compute -----------------------------------------------------------------------------------
    def forward(self, attrs, xs: list[torch.Tensor], params: dict, kernels: "Kernels") -> torch.Tensor:
        raise NotImplementedError

    def backward(self, attrs, g: torch.Tensor, xs: list, y: torch.Tensor, params: dict, kernels: "Kernels",
                 need: list[bool]) -> tuple[list, dict]:
        """(gradients of the inputs, None where not needed; parameter gradients by suffix)."""
        raise NotImplementedError

    # read from a PyTorch module (modules.from_module) --------------------------------------------
    #: nn.Module classes this op is read from, and the functions or tensor-method names of a traced graph
    torch_modules: tuple = ()
    torch_calls: tuple = ()

    def from_torch_module(self, module) -> dict:
        """The spec attributes of an nn.Module of torch_modules (OpSpecError for settings the op cannot take)."""
        return {}

    def from_torch_call(self, target, args: tuple, kwargs: dict) -> dict:
        """The spec attributes of a traced call of one of torch_calls with these arguments (tensors among them)."""
        return {}

    def from_torch_piece(self, target, args: tuple, kwargs: dict, index: int) -> dict:
        """The spec attributes of piece `index` of a traced call of one of `pieces`."""
        raise NotImplementedError(f"op {self.name} returns one tensor")

    def call_inputs(self, tensors: list, args: tuple) -> list:
        """The tensor arguments a traced call reads (a concat's are in a list)."""
        return tensors

    # read from an ONNX graph (precision_lab.onnx_import; ops.onnx_reading) ----------------------
    #: ONNX node types this op reads (a decomposed op, as SiLU's Sigmoid then Mul: the type of its first node)
    onnx_ops: tuple = ()

    def from_onnx_node(self, node, graph):
        """The layer (ops.onnx_reading.OnnxRead) an ONNX node of onnx_ops stands for, with the nodes after it that it
        absorbs; None when the node is another op's of the same type; OpSpecError for a setting it cannot take.
        This default reads a node of one computed input and no attributes (Relu, Tanh, GlobalAveragePool)."""
        from .onnx_reading import unary

        return unary(node, graph)

    # sampled propagation (precision_lab.sampled) ------------------------------------------------
    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u: float, lam: float):
        """Scale σ of the Gaussian draw standing for the output's rounding (None: an exact copy or selection)."""
        return None

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u: float, lam: float) -> list:
        """Scale σ of the draw on each input gradient (None where exact or not needed)."""
        return [None] * len(need)

    def forward_rounded(self, attrs, xs, params, kernels, rounded) -> torch.Tensor:
        """For an op that `rounds_inside`: its forward with each intermediate a product reads passed through
        `rounded(name, t, stored=False, gradient=False, unless_stored=False)`, which returns t plus this run's draw of
        its rounding to the claimed format (`stored`: only where results are stored in the format, autocast;
        `unless_stored`: only where they are not; the same name, the same draw within a run, so the backward reads
        what the forward read)."""
        raise NotImplementedError

    def backward_rounded(self, attrs, g, xs, y, params, kernels, need, rounded) -> tuple[list, dict]:
        """backward with forward_rounded's intermediates, and each intermediate gradient a product reads rounded."""
        raise NotImplementedError

    def switch_flips(self, attrs, x: torch.Tensor, variance: torch.Tensor, g: torch.Tensor, samples: int):
        """For a switching op: (mean, standard deviation) of the change its flips make to its input gradient, and the
        expected number of flips, given the reference input `x`, the variance of its deviation over `samples` forward
        runs and the reference output gradient `g` (precision_lab.switching); None for any other op."""
        return None

    # what a port gets wrong (the defect doctor's named hypotheses) -------------------------------
    def weight_grad_from(self, attrs, x: torch.Tensor, g: torch.Tensor, weight_shape: tuple, kernels: "Kernels"):
        """Its weight gradient from an input and an output gradient (the defect doctor's window slips recompute it)."""
        raise NotImplementedError(f"{self.name} has no windows (window_shifts is None)")

    def port_slips(self, attrs, in_shape: tuple) -> list["PortSlip"]:
        """The ways a port plausibly computes this layer otherwise; `in_shape` is its input's per-sample shape."""
        return []

    def local_slip(self, attrs, g, theirs, expected, bound, u: float, ratio) -> str | None:
        """A local slip's name when it fits the candidate's input gradient `theirs` (`ratio(got, expected, bound)`
        ≤ 1), given the output gradient `g` and the correct input gradient `expected`."""
        return None

    # error model ------------------------------------------------------------------------------
    def forward_error(self, attrs, ins: list[Field], y: torch.Tensor, params: dict, ctx: BoundContext) -> Field:
        raise NotImplementedError

    def backward_error(self, attrs, g: torch.Tensor, grad: GradField, ins: list[Field], out: Field, params: dict,
                       ctx: BoundContext, need: list[bool]) -> tuple[list, dict[str, Parts]]:
        raise NotImplementedError


OPS: dict[str, Op] = {}
LOSSES: dict = {}


def arity(op: Op) -> int:
    """How many inputs an op reads: its own `arity`, else 2 for one that combines, else 1."""
    return op.arity or (2 if op.combines else 1)


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} registered twice")
    OPS[op.name] = op
    return op


def register_loss(loss) -> object:
    LOSSES[loss.name] = loss
    return loss


# ---------------------------------------------------------------------------------------------
# how a computation is carried out: convolution algorithm, operand rounding


#: the convolution the hand-written algorithms of precision_lab.conv implement
SEED_CONV = {"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}


def is_seed_conv(attrs: dict) -> bool:
    return all(attrs.get(key) == value for key, value in SEED_CONV.items())


class Kernels:
    """The kernels a forward + backward runs on: a convolution algorithm, operand rounding, flags.

    `conv`: a 3×3 stride-1 padding-1 algorithm of precision_lab.conv (ConvOps protocol: forward(x, w),
    input_grad(g, w), weight_grad(x, g)) used where a conv2d layer has that shape, PyTorch's native
    kernels elsewhere (None: native everywhere). `round_operands`: applied to both operands of every
    convolution and linear product in the passes named by `rounded_passes` ("forward", "input_grad",
    "weight_grad"): TF32/bf16/fp16 emulation. `weight_grad_sum`: an alternative reduction for weight
    gradients (legitimate summation orders), given the per-term products.
    """

    PASSES = ("forward", "input_grad", "weight_grad")

    def __init__(self, conv=None, round_operands=None, rounded_passes=PASSES, name: str | None = None,
                 weight_grad=None):
        self.conv = conv
        self.round_operands = round_operands
        self.rounded_passes = frozenset(rounded_passes)
        self.weight_grad_override = weight_grad
        self.name = name or getattr(conv, "name", "native")

    def rnd(self, t: torch.Tensor, pass_name: str) -> torch.Tensor:
        if self.round_operands is None or pass_name not in self.rounded_passes:
            return t
        return self.round_operands(t)

    def _algorithm(self, attrs):
        """(algorithm, takes attributes): a hand-written 3×3 algorithm only where the layer has that shape."""
        if self.conv is None:
            return None, False
        if getattr(self.conv, "any_shape", False):
            return self.conv, True
        return (self.conv, False) if is_seed_conv(attrs) else (None, False)

    def conv_forward(self, x, w, attrs, pass_name: str = "forward"):
        """`pass_name`: the pass whose operand rounding applies (a transposed convolution's input gradient is a
        convolution's forward)."""
        x, w = self.rnd(x, pass_name), self.rnd(w, pass_name)
        algorithm, general = self._algorithm(attrs)
        if algorithm is not None:
            return algorithm.forward(x, w, attrs) if general else algorithm.forward(x, w)
        return torch.nn.functional.conv2d(x, w, None, attrs["stride"], attrs["padding"], attrs["dilation"],
                                          attrs["groups"])

    def conv_input_grad(self, g, w, attrs, input_shape, pass_name: str = "input_grad"):
        g, w = self.rnd(g, pass_name), self.rnd(w, pass_name)
        algorithm, general = self._algorithm(attrs)
        if algorithm is not None:
            return algorithm.input_grad(g, w, attrs, input_shape) if general else algorithm.input_grad(g, w)
        return torch.nn.grad.conv2d_input(input_shape, w, g, attrs["stride"], attrs["padding"], attrs["dilation"],
                                          attrs["groups"])

    def conv_weight_grad(self, x, g, attrs, weight_shape):
        x, g = self.rnd(x, "weight_grad"), self.rnd(g, "weight_grad")
        if self.weight_grad_override is not None:
            return self.weight_grad_override.conv(x, g, attrs, weight_shape)
        algorithm, general = self._algorithm(attrs)
        if algorithm is not None:
            return algorithm.weight_grad(x, g, attrs, weight_shape) if general else algorithm.weight_grad(x, g)
        return torch.nn.grad.conv2d_weight(x, weight_shape, g, attrs["stride"], attrs["padding"], attrs["dilation"],
                                           attrs["groups"])

    def conv_weight_grad_of_squares(self, x, g, attrs, weight_shape):
        """conv_weight_grad(x², g²) (an error bound's sums of squared terms): squared block by block where the
        shift-and-GEMM computes it, the same products without two image-sized squares; else squared here."""
        algorithm, general = self._algorithm(attrs)
        if (self.round_operands is None and self.weight_grad_override is None and not general
                and getattr(algorithm, "squares_in_blocks", False)):
            return algorithm.weight_grad(x, g, squares=True)
        return self.conv_weight_grad(x * x, g * g, attrs, weight_shape)

    def linear_forward(self, x, w):
        return torch.matmul(self.rnd(x, "forward"), self.rnd(w, "forward").T)

    def linear_input_grad(self, g, w):
        return torch.matmul(self.rnd(g, "input_grad"), self.rnd(w, "input_grad"))

    def linear_weight_grad(self, x, g):
        x, g = self.rnd(x, "weight_grad"), self.rnd(g, "weight_grad")
        if self.weight_grad_override is not None:
            return self.weight_grad_override.linear(x, g)
        return torch.matmul(g.T, x)


@dataclass(frozen=True)
class PortSlip:
    """One way a port computes a layer of an op otherwise, recomputed in float64 by the defect doctor as a named
    hypothesis (docs/design.md, "Explaining a verdict")."""

    family: str  # which family of hypotheses: families are tested in doctors.hypotheses.HYPOTHESES's order
    text: str  # what the port does, after its layer's label; "{first}", "{skip}": its inputs, "{other}": another layer
    rule: Callable  # () → a rule replacing the op for one recomputation; (other layer's input) → rule where `borrows`
    forward: bool = False  # the forward differs too: the output and the loss are expected otherwise as well
    every: tuple[str, ...] = ()  # group names: the same slip in several layers is also one hypothesis, "every …"
    borrows: bool = False  # the rule takes another layer's input of the same shape (another ReLU's mask)
    feature_order: Any = None  # a reordered flatten's feature order: the next layer's weight columns read so


class Rule:
    """An op's rules replaced for one recomputation: computed plainly (no in-place forward or backward, nothing
    derived from a neighbour)."""

    forward_inplace = None
    derive_output = None
    derive_input_grad = None
    backward_inplace = None


class OtherAttributes(Rule):
    """An op computed, forward and backward, with some of its attributes changed (another framework's default)."""

    def __init__(self, op, changes: dict):
        self.op, self.changes = op, changes

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward({**attrs, **self.changes}, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.op.backward({**attrs, **self.changes}, g, xs, y, params, kernels, need)


def dropping(which: int):
    """A backward that passes no gradient to input `which` (for BackwardReplaced)."""
    def backward(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        grads = list(grads)
        if grads[which] is not None:
            grads[which] = torch.zeros_like(grads[which])
        return grads, param_grads

    return backward


def dropping_slips(op) -> list[PortSlip]:
    """A two-input op's backward that passes no gradient to one of its inputs."""
    return [PortSlip("routing", "backward passes no gradient to the skip from {skip}",
                     lambda: BackwardReplaced(op, dropping(1))),
            PortSlip("routing", "backward passes no gradient to the main branch", lambda: BackwardReplaced(op, dropping(0)))]


class BackwardReplaced:
    """An op with its backward replaced by `backward(op, attrs, g, xs, y, params, kernels, need)`, forward unchanged:
    the zoo's planted slips and the defect doctor's hypotheses (a rule for `compute.forward_backward`)."""

    forward_inplace = None
    derive_output = None
    derive_input_grad = None
    backward_inplace = None

    def __init__(self, op, backward):
        self.op, self._backward = op, backward

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self._backward(self.op, attrs, g, xs, y, params, kernels, need)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def spread(radius: int | None, reach: int, stride: int = 1) -> int | None:
    """Radius after an op whose output at q reads inputs within `reach` of stride·q (None stays None)."""
    return None if radius is None else ceil_div(radius + reach, stride)


def gather_radius(radius: int | None, reach: int, stride: int = 1) -> int | None:
    """Radius of an input gradient: the output-gradient errors within `radius` (output grid) of the
    outputs that read input p, seen from the input grid (stride·radius + reach)."""
    return None if radius is None else stride * radius + reach


#: flip fields with at most this many non-zeros are convolved point by point, not by a full convolution:
#: at float32 a few hundred of 33 M elements at 1024² (tests/test_errmodel.py); 2¹⁴·16·9 int64 indices ≈ 19 MB
SPARSE_LIMIT = 2 ** 14


def sparse_enough(count: int) -> bool:
    """Whether a field of `count` non-zeros goes point by point (SPARSE_LIMIT, read at call time)."""
    return 0 < count <= SPARSE_LIMIT


def sparse_points(t: torch.Tensor | None):
    """The non-zeros of a flip field as index tensors, when there are few (else None; None for no field)."""
    if t is None:
        return None
    if not sparse_enough(int(torch.count_nonzero(t))):
        return None
    return t.nonzero(as_tuple=True)


def gamma_over_lambda(n: int, u: float, lam: float) -> float:
    """γ̃ₙ(λ)/λ ≥ √n·u: the scale of a sum's rounding before the tail factor λ (Higham & Mary 2019)."""
    return roundoff.probabilistic_gamma(max(1, n), u, lam) / lam


def abs_params(params: dict) -> dict:
    return {k: v.abs() for k, v in params.items()}


def nonzero(t: torch.Tensor) -> torch.Tensor:
    """1 where a term's factor is nonzero: an op applied to these counts a sum's nonzero terms."""
    return (t != 0).to(t.dtype)


def has_values(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))


def n_spatial(shape) -> int:
    return math.prod(shape[2:]) if len(shape) > 2 else 1


from . import layers, losses, pointwise, dropout, routing  # noqa: E402,F401 - each registers its ops
from . import transposed  # noqa: E402,F401 - registered after layers: its rules are a convolution's, roles swapped
from . import arithmetic  # noqa: E402,F401 - registered after routing: its ops build on add
from . import normalisation  # noqa: E402,F401 - registers batch_norm2d, group_norm
from . import tokens  # noqa: E402,F401 - registered after routing: flatten(2) is read after flatten refuses it
from . import attention  # noqa: E402,F401 - after tokens: softmax and matmul act on tokens
from . import multihead  # noqa: E402,F401 - after attention: its rules are linear's, matmul's and softmax's
from . import clipped  # noqa: E402,F401 - after pointwise: its rules reuse the ReLU's mask and flip test
from . import channels  # noqa: E402,F401 - after tokens: torch.split and x.chunk are read only as channel pieces
from . import parameters  # noqa: E402,F401 - after arithmetic and attention: mul and scale refuse a parameter first
from . import stochastic_depth  # noqa: E402,F401 - after dropout: its rules are a training dropout's

__all__ = ["BATCH_SIZE", "BackwardReplaced", "BoundContext", "Field", "GradField", "Kernels", "LOSSES", "OPS", "Op", "OpSpecError",
           "OtherAttributes", "Parts", "PortSlip", "REQUIRED", "Rule", "SEED_CONV", "SPARSE_LIMIT", "SharedDraw", "has_values", "is_seed_conv", "register", "register_loss",
           "sparse_points"]
