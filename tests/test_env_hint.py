"""A program that fails at start-up for want of a variable of the user's shell: the one-line error says `env`."""
from __future__ import annotations

import pytest

from precision_lab import cli


@pytest.mark.parametrize("source,hint", [
    ("import os\nos.environ['MY_BACKEND']\n", True),           # KeyError: 'MY_BACKEND'
    ("import a_module_only_my_shell_finds\n", True),           # ModuleNotFoundError (PYTHONPATH)
    ("import sys\nsys.exit('wrong answer format')\n", False),  # a failure of its own: no hint
])
def test_a_start_up_failure_suggests_the_yamls_env(tmp_path, capsys, source, hint):
    (tmp_path / "prog.py").write_text(source)
    (tmp_path / "c.yaml").write_text('name: needs-env\ncommand: ["{python}", prog.py, "{request}", "{response}"]\n'
                                     'precision: float32\nweight_layout: OIHW\n')
    assert cli.main(["diagnose", "--candidate", str(tmp_path / "c.yaml"), "--size", "8", "--probes", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exited with status 1" in err
    assert ("add them to the YAML's `env`" in err) == hint
