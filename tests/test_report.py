"""`precision-lab run` end to end on small fixture notebooks (tests/fixtures/notebooks), plus the
real notebooks with params/quick.yaml (slow)."""
import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pandas as pd
import pytest
import torch
import yaml

from precision_lab import report
from precision_lab.candidates import resolve
from precision_lab.paths import NOTEBOOKS_DIR, PARAMS_DIR, ROOT

FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"
XSS = "<script>alert(1)</script>"
CHROMIUM_FOUND = bool(shutil.which("chromium") and shutil.which("chromedriver") and importlib.util.find_spec("selenium"))


def run_lab(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "precision_lab.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def fixture_run(tmp, *args, notebooks_dir=FIXTURES):
    return run_lab("run", "--notebooks-dir", notebooks_dir, "--reports-dir", tmp / "reports",
                   "--runs-dir", tmp / "runs", *args)


class Page(HTMLParser):
    """Links, images, scripts and element ids of an HTML page."""

    def __init__(self, text):
        super().__init__()
        self.links, self.images, self.scripts, self.ids, self.stylesheets = [], [], [], set(), []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        elif tag == "img":
            self.images.append(attrs.get("src", ""))
        elif tag == "script":
            self.scripts.append(attrs.get("src"))
        elif tag == "link":
            self.stylesheets.append(attrs.get("href"))


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """Both fixture notebooks; 01 fails in its last cell; its candidate carries a script-tag name."""
    tmp = tmp_path_factory.mktemp("lab")
    done = fixture_run(tmp, "--run-id", "first", "-p", "fail", "true", "-p", "candidate_label", XSS,
                       "-p", "candidates", "[native]", "-p", "size", "16")
    return tmp, done


def test_failing_notebook_makes_the_command_fail_after_the_others_ran(failing_run):
    tmp, done = failing_run
    assert done.returncode == 1, done.stderr
    assert "1 notebook(s) failed: 01-fixture-gradients" in done.stderr
    assert "[2/2] 02-fixture-sleep: ok" in done.stderr
    assert (tmp / "runs" / "first" / "02-fixture-sleep" / "sleep.csv").is_file()


def test_run_layout_and_latest(failing_run):
    tmp, _ = failing_run
    reports, runs = tmp / "reports", tmp / "runs"
    for name in ("index.html", "provenance.json", "01-fixture-gradients.html", "02-fixture-sleep.html",
                 "01-fixture-gradients.ipynb", "02-fixture-sleep.ipynb"):
        assert (reports / "first" / name).is_file(), name
    for name in ("summary.csv", "summary.json", "errors.csv", "errors.json", "headline.png", "parameters.yaml"):
        assert (runs / "first" / "01-fixture-gradients" / name).is_file(), name
    assert os.readlink(reports / "latest") == "first"
    leftovers = [p.name for p in (*reports.iterdir(), *runs.iterdir()) if p.name.startswith(".")]
    assert leftovers == []


def test_index_marks_the_failure_and_links_to_the_failing_cell(failing_run):
    tmp, _ = failing_run
    index = (tmp / "reports" / "first" / "index.html").read_text()
    assert 'href="01-fixture-gradients.html#papermill-error-cell"' in index
    assert "RuntimeError: fixture failure requested (fail=True)" in index
    failing = (tmp / "reports" / "first" / "01-fixture-gradients.html").read_text()
    assert "papermill-error-cell" in Page(failing).ids
    assert "fixture failure requested" in failing
    statuses = re.findall(r'class="status-(ok|failed)"', index)
    assert sorted(statuses) == ["failed", "ok"]


def test_user_strings_are_escaped_everywhere(failing_run):
    tmp, _ = failing_run
    pages = sorted((tmp / "reports" / "first").glob("*.html"))
    assert len(pages) == 3
    for page in pages:
        text = page.read_text()
        assert XSS not in text, page.name
        assert "<script" not in text.lower(), page.name  # reports run no script, so none can be injected
    report_page = (tmp / "reports" / "first" / "01-fixture-gradients.html").read_text()
    assert "Judged: &lt;script&gt;" in report_page  # the notebook's raw Markdown output, sanitized
    index = (tmp / "reports" / "first" / "index.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index
    assert Page(index).scripts == []  # the index runs no script at all


def test_verdict_matrix_shows_the_notebooks_summary(failing_run):
    tmp, _ = failing_run
    summary = pd.read_csv(tmp / "runs" / "first" / "01-fixture-gradients" / "summary.csv")
    index = (tmp / "reports" / "first" / "index.html").read_text()
    row = summary.iloc[0]
    assert row["candidate"] == XSS
    shown = re.search(r'<span class="verdict verdict-([a-z-]+)">([^<]+)</span>\s*<div class="headline">([^<]+)</div>',
                      index)
    assert shown is not None
    assert shown.group(2) == row["verdict"] and shown.group(3) == row["headline"]


def test_figures_are_inline_and_nothing_comes_from_the_network(failing_run):
    tmp, _ = failing_run
    folder = tmp / "reports" / "first"
    index = Page((folder / "index.html").read_text())
    headline = (tmp / "runs" / "first" / "01-fixture-gradients" / "headline.png").read_bytes()
    inline = [base64.b64decode(src.split(",", 1)[1]) for src in index.images if src.startswith("data:image/png")]
    assert headline in inline
    for page in folder.glob("*.html"):
        parsed = Page(page.read_text())
        external = [u for u in parsed.scripts + parsed.stylesheets + parsed.images
                    if u and urlsplit(u).scheme in ("http", "https", "")]
        assert external == [], (page.name, external)
    report_page = Page((folder / "01-fixture-gradients.html").read_text())
    assert any(src.startswith("data:image/png;base64,") for src in report_page.images)


def test_code_is_hidden_by_default_and_shown_on_request(failing_run, tmp_path):
    tmp, _ = failing_run
    hidden = (tmp / "reports" / "first" / "01-fixture-gradients.html").read_text()
    assert "make_problem" not in hidden
    outcome = report.NotebookOutcome("01-fixture-gradients", ok=True, seconds=0.0)
    shown = report.render_report(tmp / "reports" / "first" / "01-fixture-gradients.ipynb", tmp_path / "x.html",
                                 outcome, show_code=True).read_text()
    assert "make_problem" in shown


def test_every_link_of_the_index_resolves(failing_run):
    tmp, _ = failing_run
    folder = tmp / "reports" / "first"
    for href in Page((folder / "index.html").read_text()).links:
        parts = urlsplit(href)
        assert parts.scheme == "", href
        target = (folder / unquote(parts.path)).resolve() if parts.path else folder / "index.html"
        assert target.is_file(), href
        if parts.fragment:
            assert parts.fragment in Page(target.read_text()).ids, href


def test_provenance_holds_what_a_rerun_needs(failing_run):
    tmp, _ = failing_run
    provenance = json.loads((tmp / "reports" / "first" / "provenance.json").read_text())
    assert provenance["run_id"] == "first"
    assert provenance["parameters"] == {"fail": True, "candidate_label": XSS, "candidates": ["native"], "size": 16}
    assert provenance["notebooks"] == ["01-fixture-gradients", "02-fixture-sleep"]
    assert re.fullmatch(r"[0-9a-f]{40}", provenance["git"]["commit"])
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["device"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "cudnn_version" in provenance["backend_flags"]
    assert provenance["command_line"][1] == "run"
    assert [o["ok"] for o in provenance["outcome"]] == [False, True]
    injected = yaml.safe_load((tmp / "runs" / "first" / "02-fixture-sleep" / "parameters.yaml").read_text())
    assert set(injected) == {"run_dir"}  # 02 declares none of the given parameters


def test_index_shows_no_path_of_the_machine_it_ran_on(failing_run):
    from precision_lab.report import shown_path

    tmp, _ = failing_run
    index = (tmp / "reports" / "first" / "index.html").read_text()
    provenance = json.loads((tmp / "reports" / "first" / "provenance.json").read_text())
    assert provenance["cwd"] == str(ROOT)  # kept as run, for a rerun
    assert str(ROOT) not in index and "<code>.</code> (paths relative to the project)" in index
    assert shown_path(str(ROOT / "params" / "seed.yaml")) == "params/seed.yaml"
    assert shown_path(str(Path.home() / "x" / "y.yaml")) == "~/x/y.yaml" and shown_path("p.yaml") == "p.yaml"


def test_a_second_run_moves_latest_and_never_touches_the_first(failing_run):
    tmp, _ = failing_run
    before = (tmp / "reports" / "first" / "index.html").read_bytes()
    done = fixture_run(tmp, "--notebooks", "02", "--run-id", "second")
    assert done.returncode == 0, done.stderr
    assert os.readlink(tmp / "reports" / "latest") == "second"
    assert (tmp / "reports" / "first" / "index.html").read_bytes() == before
    again = fixture_run(tmp, "--notebooks", "02", "--run-id", "second")
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "never overwrites" in again.stderr


def test_default_run_ids_do_not_collide(tmp_path):
    (tmp_path / "reports").mkdir()
    first = report.choose_run_id(None, tmp_path / "reports", tmp_path / "runs")
    (tmp_path / "reports" / first).mkdir()
    second = report.choose_run_id(None, tmp_path / "reports", tmp_path / "runs")
    assert second != first and (second.startswith(first) or second > first)


@pytest.mark.slow
def test_real_notebooks_with_quick_parameters(quick_run, tmp_path):
    """The suite's notebooks, run as `make quick` does (conftest.quick_run): every notebook ok, every candidate on the
    index."""
    if not sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        pytest.skip("notebooks/ holds no notebooks yet")
    quick = PARAMS_DIR / "quick.yaml"
    run, done = quick_run
    assert done.returncode == 0, done.stderr[-3000:]
    index = (run / "reports" / "quick" / "index.html").read_text()
    notebooks = [nb.stem for nb in sorted(NOTEBOOKS_DIR.glob("*.ipynb"))]
    for name in notebooks:
        assert (run / "reports" / "quick" / f"{name}.html").is_file()
    assert len(re.findall(r'class="status-ok"', index)) == len(notebooks)
    summaries = pd.concat([pd.read_csv(p) for p in (run / "runs" / "quick").glob("*/summary.csv")])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runnable = [c for c in yaml.safe_load(quick.read_text())["candidates"] if resolve(c).supports(device)]
    assert runnable
    for candidate in runnable:
        assert f"<th>{candidate}</th>" in index
        assert candidate in set(summaries["candidate"])
    if CHROMIUM_FOUND:  # the same run in the browser (tests/test_browser.py), rather than running it twice
        from test_browser import check_run_in_browser

        problems = check_run_in_browser(run / "reports" / "quick", tmp_path / "index.png",
                                        tmp_path / "profile", require_conclusions=True)
        assert problems == {page: [] for page in problems}


def test_a_notebook_that_cannot_render_still_gets_a_page(tmp_path):
    outcome = report.NotebookOutcome("03-broken", ok=True, seconds=1.0)
    executed = tmp_path / "03-broken.ipynb"
    executed.write_text("{ this is not a notebook")
    report.render_isolated(executed, tmp_path / "03-broken.html", outcome, show_code=False)
    assert not outcome.ok and "could not render the report" in outcome.error
    page = (tmp_path / "03-broken.html").read_text()
    assert 'id="papermill-error-cell"' in page and "could not render" in page


def test_kernel_that_never_started_gets_a_page_with_the_reason(tmp_path):
    outcome = report.NotebookOutcome("04-x", ok=False, seconds=0.5, error=f"NoSuchKernel: {XSS}")
    report.render_isolated(tmp_path / "absent.ipynb", tmp_path / "04-x.html", outcome, show_code=False)
    page = (tmp_path / "04-x.html").read_text()
    assert "NoSuchKernel: &lt;script&gt;" in page and XSS not in page
