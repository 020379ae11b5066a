"""`make help` tells the truth about the project: how many notebooks a run executes, which targets exist."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from precision_lab.paths import NOTEBOOKS_DIR, ROOT

NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _help_lines() -> list[str]:
    """The `## ` comments `make help` prints, read from the Makefile (make itself may be absent)."""
    return [line.split("## ", 1)[1] for line in (ROOT / "Makefile").read_text().splitlines()
            if re.match(r"^[a-zA-Z_-]+:.*## ", line)]


def test_help_counts_the_notebooks_there_are():
    notebooks = len(list(NOTEBOOKS_DIR.glob("[0-9][0-9]-*.ipynb")))
    counted = [(NUMBERS[m.group(1)], line) for line in _help_lines()
               for m in re.finditer(r"\b(\w+) (?:notebooks|experiments)\b", line) if m.group(1) in NUMBERS]
    assert counted, "make help never says how many notebooks a run executes"
    for number, line in counted:
        assert number == notebooks, f"make help says {line!r}; notebooks/ holds {notebooks}"


@pytest.mark.skipif(shutil.which("make") is None, reason="make not found")
def test_make_help_lists_every_target_the_readme_names():
    shown = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    shown = re.sub(r"\x1b\[[0-9;]*m", "", shown)  # the bold target names
    readme = (ROOT / "README.md").read_text()
    for target in sorted(set(re.findall(r"`make (\w[\w-]*)", readme))):
        assert re.search(rf"\b{target}\b", shown), f"README names `make {target}`, make help does not list it"
