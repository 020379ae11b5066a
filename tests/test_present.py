"""A single diagnosis as an HTML page (precision_lab.present, `diagnose --html`): self-contained, escaped, concluded."""
import re

import torch

from precision_lab import cli, present
from precision_lab.candidates import resolve
from precision_lab.device import describe_device
from precision_lab.verdict import judge


def test_page_is_self_contained_escaped_and_ends_the_verdict_in_words(small_problem, small_reference):
    candidate = resolve("fortran-replay-flip")
    judgement = judge(candidate.compute(small_problem, "float32", "cpu"),
                      small_reference, "float32", "<img src=x onerror=alert(1)>")
    page = present.diagnosis_page(judgement, small_problem, describe_device(torch.device("cpu")))
    assert "<script" not in page.lower() and "<img src=x" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert not re.search(r'(src|href)="https?:', page)  # nothing fetched
    assert 'id="conclusion"' in page and "What to do:" in page and "flip H and W" in page
    assert 'id="evidence"' in page and "max error ÷ bound (≤ 1: rounding)" in page
    assert "problem size</th><td>64 × 64 pixels" in page
    assert "{'" not in page  # no printed dict


def test_diagnose_writes_the_html_page(tmp_path, capsys):
    out = tmp_path / "sub" / "verdict.html"
    code = cli.main(["diagnose", "--candidate", "builtin:native", "--size", "32", "--html", str(out)])
    assert code == 0
    page = out.read_text(encoding="utf-8")
    assert "precision-lab diagnosis: native" in page and "The difference is rounding: nothing to fix." in page
    assert "verdict verdict-roundoff" in page


def test_diagnose_html_to_an_unwritable_place_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = cli.main(["diagnose", "--candidate", "builtin:native", "--size", "16", "--html", str(blocker / "x.html")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "cannot write the HTML diagnosis" in err
