"""The repository explains itself: every file a tracked file cites exists in it, and no import circles.

A newcomer who follows "see docs/x.md" or "examples/y/" must find it; a path that leaves the
repository (`../…`) cannot be followed from a fresh clone at all.
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

import pytest

from precision_lab.paths import ROOT

#: top-level folders whose paths, when cited, must exist (the ones a fresh clone has)
CITED_FOLDERS = ("docs", "examples", "params", "notebooks", "benchmarks", "tests", "precision_lab", "data", "scripts")
#: where runs and builds go: absent from a fresh clone by design (docs/reports.md); .gitignore names the rest
GENERATED = ("data/runs", "data/gpu-runs", "reports/")
#: a metavariable in a usage line (`FILE.md`, `examples/models/Y.yaml`): upper case, names nothing
PLACEHOLDER = re.compile(r"(^|/)[A-Z]{1,4}(\.\w+)?/?$")
PATH = re.compile(r"(?<![\w./$-])((?:\.\./)+[\w./-]*\w|(?:" + "|".join(CITED_FOLDERS) + r")/[\w./-]*[\w/]|[A-Za-z][\w-]*\.md\b)")
SECTION = re.compile(r"docs/design\.md, \"([^\"]+)\"")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = []
    for name in names:
        path = ROOT / name
        # this file plants dangling references to show the checker sees them
        if path.suffix in (".png", ".mrc", ".npz", ".npy", ".bin") or not path.is_file() or path == Path(__file__):
            continue
        try:
            files.append((path, path.read_text()))
        except UnicodeDecodeError:
            continue
    return files


def _ignored(cited: str) -> bool:
    """Whether git ignores `cited` (a build or output folder the repository never holds)."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", cited], cwd=ROOT).returncode == 0


@functools.cache
def _tracked_folders() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted({(ROOT / name).parent for name in names})


def _relative_exists(path: Path, cited: str) -> bool:
    """A `../` path exists inside the repository, from the citing file's folder or a folder below it.

    Specs cite paths relative to themselves; a doc quoting a spec (docs/campaigns.md quotes
    examples/campaign/) reads them from the spec's folder.
    """
    for folder in [path.parent, *_tracked_folders()]:
        target = (folder / cited).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return True
    return False


def dangling_references(files) -> list[str]:
    """`file:line: cited` for every cited path the repository does not have."""
    tracked_names = {path.name for path, _ in files}
    found = []
    for path, text in files:
        # tests plant paths that escape a folder on purpose (../../etc/passwd must be refused)
        in_tests = path.is_relative_to(ROOT / "tests")
        for number, line in enumerate(text.splitlines(), 1):
            for cited in PATH.findall(line):
                where = f"{path.relative_to(ROOT)}:{number}: {cited}"
                if PLACEHOLDER.search(cited):
                    continue
                if cited.startswith("../"):
                    if not in_tests and not _relative_exists(path, cited):
                        found.append(f"{where} (outside the repository)")
                elif "/" not in cited:
                    if cited not in tracked_names:
                        found.append(where)
                elif not cited.startswith(GENERATED) and not (ROOT / cited.rstrip(".")).exists() and not _ignored(cited):
                    found.append(where)
    return found


def missing_design_sections(files) -> list[str]:
    """`file:line: "Section"` for every `docs/design.md, "Section"` without such a heading."""
    headings = [line.lstrip("#").strip() for line in (ROOT / "docs/design.md").read_text().splitlines()
                if line.startswith("#")]
    found = []
    for path, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for section in SECTION.findall(line):
                if section not in headings:
                    found.append(f"{path.relative_to(ROOT)}:{number}: \"{section}\"")
    return found


def test_the_checker_sees_a_dangling_reference():
    outside = "../" + "shared/tools/gpu-prepare"  # spelled in two parts: this file must not cite it itself
    planted = [(ROOT / "docs/example.md", f"see DESIGN.md and docs/nowhere.md,\nor {outside};\n"
                                          "docs/design.md, \"No such section\" but docs/verdicts.md is fine")]
    assert dangling_references(planted) == ["docs/example.md:1: DESIGN.md", "docs/example.md:1: docs/nowhere.md",
                                            f"docs/example.md:2: {outside} (outside the repository)"]
    assert missing_design_sections(planted) == ['docs/example.md:3: "No such section"']


def test_every_cited_file_exists():
    files = _tracked_text_files()
    assert dangling_references(files) == []
    assert missing_design_sections(files) == []


def _imports(path: Path, package: str) -> set[str]:
    """The precision_lab modules `path` imports, at the top or inside a function (both are edges)."""
    module = package + "." + ".".join(path.relative_to(ROOT / package).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
            target = (base + ("." + node.module if node.module else "")) if node.level else node.module or ""
            if target.startswith(package):
                edges.add(target)
                edges |= {f"{target}.{alias.name}" for alias in node.names}
    # a module always imports its own packages first: that edge is Python's, not a design choice
    return {e for e in edges if not module.startswith(e + ".") and e != module}


def import_graph(package: str = "precision_lab") -> dict[str, set[str]]:
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = package + "." + ".".join(path.relative_to(ROOT / package).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return {name: {e for e in _imports(path, package) if e in modules} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(groups)


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["precision_lab"])
def test_no_import_circles(package):
    assert circles(import_graph(package)) == []
