"""A single diagnosis as an HTML page (precision_lab.present, `diagnose --html`): self-contained, escaped, concluded."""
import re

import torch

from precision_lab import cli, present
from precision_lab.candidates import resolve
from precision_lab.device import describe_device
from precision_lab.decision import Diagnosis
from precision_lab.verdict import judge


def test_page_is_self_contained_escaped_and_ends_the_verdict_in_words(small_problem, small_reference):
    candidate = resolve("fortran-replay-flip")
    judgement = judge(candidate.compute(small_problem, "float32", "cpu"),
                      small_reference, "float32", "<img src=x onerror=alert(1)>")
    page = present.diagnosis_page(Diagnosis(judgement), small_problem, describe_device(torch.device("cpu")))
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


def _text_of(html: str) -> str:
    """The page's words, tags dropped and entities read back."""
    import html as html_module

    return html_module.unescape(re.sub(r"<[^>]+>", " ", html))


def test_page_and_text_say_the_same_from_one_summary(small_problem):
    from precision_lab.diagnosis import diagnose
    from precision_lab.probes import select

    diagnosis = diagnose(resolve("relu-mask-missing"), small_problem, "cpu", probes=select("odd-61x67"))
    summary = diagnosis.summary()
    text = diagnosis.to_text()
    words = " ".join(_text_of(present.diagnosis_page(diagnosis, small_problem)).split())
    assert summary.verdict == "defect" and summary.named
    for said in [summary.headline, summary.first_failing, summary.cause, summary.fix]:
        if said:
            assert said in text and " ".join(said.split()) in words, said
    assert [p[0] for p in summary.probes] == ["61x67-batch2-seed0"]  # the label says what ran
    assert "probe 61x67-batch2-seed0" in words and f"61x67-batch2-seed0 {summary.probes[0][2]}" in text
    for _, q in summary.failing:  # the first failing quantity of the text is the page's too
        assert q.quantity in words


def test_the_text_verdict_is_short_and_verbose_has_the_details(small_problem):
    from precision_lab.diagnosis import diagnose
    from precision_lab.probes import select

    diagnosis = diagnose(resolve("fortran-replay-flip"), small_problem, "cpu", probes=select("default"))
    short, verbose = diagnosis.to_text(), diagnosis.to_text(verbose=True)
    assert short.splitlines()[1] == "verdict: layout (flip HW)"
    assert len(short.splitlines()) <= 12 < len(verbose.splitlines())
    assert "conv1.bias" not in short.split("within the bound:")[0]  # only what fails is listed with evidence
    assert "matches within the bound after" in verbose and "matches within the bound after" not in short
