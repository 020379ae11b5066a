"""The op registry is the only table of ops: no module outside precision_lab/ops names an op or a loss by its
spec name (docs/design.md, "The op registry"), so adding one is writing one class."""
import ast
from pathlib import Path

from precision_lab.ops import LOSSES, OPS

PACKAGE = Path(__file__).resolve().parents[1] / "precision_lab"


def _docstrings(tree) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, nodes) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_no_op_or_loss_is_named_outside_the_registry():
    names = set(OPS) | set(LOSSES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "ops" in path.relative_to(PACKAGE).parts[:1]:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip]
    assert found == []


def test_the_check_would_see_a_name():
    tree = ast.parse('"""relu in a docstring"""\nif layer.op == "relu":\n    pass\n')
    skip = _docstrings(tree)
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in skip] == ["relu"]
