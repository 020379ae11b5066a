"""The op registry is the only table of ops: no module outside precision_lab/ops names an op or a loss by its
spec name (docs/design.md, "The op registry"), so adding one is writing one class."""
import ast
from pathlib import Path

from precision_lab.ops import LOSSES, OPS

PACKAGE = Path(__file__).resolve().parents[1] / "precision_lab"
NAMES = set(OPS) | set(LOSSES)


def _constants(node) -> list[ast.Constant]:
    """String constants in `node`, looking into tuples, lists and sets (`op in ("conv2d", "linear")`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for element in node.elts for c in _constants(element)]
    return []


def op_names_used(source: str) -> list[tuple[int, str]]:
    """(line, name) wherever an op or loss name is compared, looked up in OPS/LOSSES, or written as a layer's op."""
    found = []
    for node in ast.walk(ast.parse(source)):
        candidates = []
        if isinstance(node, ast.Compare):
            candidates = [c for part in [node.left, *node.comparators] for c in _constants(part)]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("OPS", "LOSSES"):
            candidates = _constants(node.slice)
        elif isinstance(node, ast.Dict):
            candidates = [c for key, value in zip(node.keys, node.values) if isinstance(key, ast.Constant)
                          and key.value in ("op", "loss", "activation") for c in _constants(value)]
        elif isinstance(node, ast.arguments):
            candidates = [c for default in [*node.defaults, *node.kw_defaults] if default for c in _constants(default)]
        found += [(c.lineno, c.value) for c in candidates if c.value in NAMES]
    return found


def test_no_op_or_loss_is_named_outside_the_registry():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "ops":
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {name!r}" for line, name in
                  op_names_used(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_check_sees_each_way_of_naming_an_op():
    source = ('TAGS = ("sub", "sup")\n'  # an HTML tag that happens to be an op's name: not a use
              'if layer.op == "relu": pass\n'
              'if layer.op in ("conv2d", "linear"): pass\n'
              'rule = OPS["add"]\n'
              'spec = {"op": "flatten"}\n'
              'def read(module, loss="mse"): pass\n')
    assert op_names_used(source) == [(2, "relu"), (3, "conv2d"), (3, "linear"), (4, "add"), (5, "flatten"),
                                     (6, "mse")]
