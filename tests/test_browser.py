"""Published reports in a real browser: headless Chromium opens the index and every report, offline.

Fails on console errors, images that did not load, links that lead nowhere, any resource
fetched from somewhere other than the run's own files, raw Python reprs in the text (a printed
dict, an object or array repr) and table cells cut short ("..." or "…"); with conclusions
required, every report must end in its conclusion and the index must open with its summary. The index's screenshot is saved in the
run directory. Run by hand to refresh the README's picture:
    .venv/bin/python tests/test_browser.py reports/latest docs/index-screenshot.png
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
#: the flags that work in this container (no sandbox as root, no GPU), plus everything networked off
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND")
SCREENSHOT = "index-screenshot.png"
#: what must never reach a reader: a printed dict, an object's or array's repr, a pandas Series footer
RAW_REPR = re.compile(r"\{'|\{\"|<[\w.]+ object at 0x|\barray\(|\bdtype: \w+|\bdtype=")
#: the words a conclusion always uses (precision_lab.conclusions.Conclusion.html)
CONCLUSION_WORDS = ("Conclusion", "What to do:")

SELENIUM = importlib.util.find_spec("selenium") is not None
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None or not SELENIUM,
    reason="headless Chromium or selenium not found: apt-get install chromium chromium-driver; "
           "pip install selenium (make test installs them)")


def open_browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument("--window-size=1280,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _ids(path: Path) -> set[str]:
    class Ids(HTMLParser):
        found: set = set()

        def handle_starttag(self, tag, attrs):
            value = dict(attrs).get("id")
            if value:
                self.found.add(value)

    parser = Ids()
    parser.found = set()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser.found


def page_problems(driver, page: Path) -> list[str]:
    """Everything wrong with one page as the browser saw it (empty when the page is sound)."""
    driver.get_log("browser")  # drops what an earlier page logged
    driver.get(page.resolve().as_uri())
    problems = [f"console: {e['message']}" for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    broken = driver.execute_script(
        "return Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => i.getAttribute('src').slice(0, 80))")
    problems += [f"image did not load: {src}" for src in broken]
    fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    problems += [f"fetched from outside the run: {url}" for url in fetched if urlsplit(url).scheme not in ("file", "data")]
    for href in driver.execute_script("return Array.from(document.links).map(a => a.href)"):
        problems += _link_problem(page, href)
    return problems + content_problems(driver)


def content_problems(driver) -> list[str]:
    """Raw reprs in the text a reader sees, and table cells cut short (the page must be loaded)."""
    text = driver.execute_script("return document.body.innerText")
    problems = [f"raw repr in the text: {text[max(0, m.start() - 40):m.end() + 40]!r}" for m in RAW_REPR.finditer(text)]
    cut = driver.execute_script("return Array.from(document.querySelectorAll('td, th')).map(c => c.innerText)"
                                ".filter(t => t.includes('...') || t.includes('\u2026'))")
    return problems + [f"table cell cut short: {cell[:100]!r}" for cell in cut]


def conclusion_problems(driver, page: Path) -> list[str]:
    """A report must end in its conclusion (the last cell), the index must open with the run's summary."""
    driver.get(page.resolve().as_uri())
    if page.name == "index.html":
        summary = driver.execute_script("const s = document.getElementById('summary'); return s ? s.innerText : ''")
        return [] if "What to do:" in summary else ["index: no summary in words (#summary with 'What to do:')"]
    found = driver.execute_script(
        "const c = document.getElementById('conclusion'); if (!c) return null;"
        "const cells = document.querySelectorAll('.jp-Cell');"
        "return {text: c.innerText, last: cells.length > 0 && cells[cells.length - 1].contains(c)};")
    if not found:
        return [f"{page.name}: no conclusion (#conclusion)"]
    problems = [f"{page.name}: the conclusion is not the last cell"] if not found["last"] else []
    return problems + [f"{page.name}: the conclusion lacks {word!r}" for word in CONCLUSION_WORDS
                       if word not in found["text"]]


def _link_problem(page: Path, href: str) -> list[str]:
    parts = urlsplit(href)
    if parts.scheme in ("http", "https", "mailto"):
        return []  # a citation to follow later: not loaded with the page, so offline is fine
    if parts.scheme != "file":
        return [f"link of unexpected kind: {href}"]
    target = Path(unquote(parts.path))
    if not target.is_file():
        return [f"broken link: {href}"]
    # a browser matches the fragment as written, then percent-decoded (HTML spec, "indicated part")
    if parts.fragment and target.suffix == ".html" and not {parts.fragment, unquote(parts.fragment)} & _ids(target):
        return [f"link to a missing anchor: {href}"]
    return []


def check_run_in_browser(report_dir: Path, screenshot: Path, profile: Path,
                         require_conclusions: bool = False) -> dict[str, list[str]]:
    """Open index.html and every report it links; save the index's screenshot. Problems per page.

    With `require_conclusions`, the index must open with its summary and every report end in its conclusion."""
    driver = open_browser(profile)
    try:
        index = report_dir / "index.html"
        problems = {"index.html": page_problems(driver, index)}
        reports = sorted({Path(unquote(urlsplit(h).path)) for h in
                          driver.execute_script("return Array.from(document.links).map(a => a.href)")
                          if h.startswith("file:") and urlsplit(h).path.endswith(".html")})
        driver.get(index.resolve().as_uri())
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(int(height), 800), 6000))
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(screenshot))
        for page in reports:
            if page.resolve() != index.resolve():
                problems[page.name] = page_problems(driver, page)
        if require_conclusions:
            for page in [index, *reports]:
                problems.setdefault(page.name, [])
                problems[page.name] += conclusion_problems(driver, page)
        return problems
    finally:
        driver.quit()


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    done = subprocess.run([sys.executable, "-m", "precision_lab.cli", "run", "--notebooks-dir", str(FIXTURES),
                           "--reports-dir", str(tmp / "reports"), "--runs-dir", str(tmp / "runs"), "--run-id", "web",
                           "-p", "fail", "true", "-p", "size", "16", "-p", "candidate_label", "<script>alert(1)</script>"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr  # 01 fails on purpose: its failure must render too
    return tmp


@needs_chromium
def test_index_and_reports_open_offline_without_errors(fixture_run, tmp_path):
    screenshot = fixture_run / "runs" / "web" / SCREENSHOT
    problems = check_run_in_browser(fixture_run / "reports" / "web", screenshot, tmp_path / "profile")
    assert set(problems) == {"index.html", "01-fixture-gradients.html", "02-fixture-sleep.html"}
    assert problems == {page: [] for page in problems}
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000


@needs_chromium
def test_the_checker_catches_broken_pages(tmp_path):
    """The browser check itself can fail: a page with each defect it looks for."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><img src="missing.png"><a href="nowhere.html">x</a>'
                    '<a href="#no-anchor">y</a><script>console.error("boom")</script>'
                    '<script src="https://cdn.example.org/require.js"></script></body></html>')
    driver = open_browser(tmp_path / "profile")
    try:
        problems = "\n".join(page_problems(driver, page))
    finally:
        driver.quit()
    for symptom in ("console:", "boom", "image did not load: missing.png", "broken link", "nowhere.html",
                    "missing anchor", "cdn.example.org"):
        assert symptom in problems, (symptom, problems)


@needs_chromium
def test_the_checker_catches_reprs_cut_cells_and_missing_conclusions(tmp_path):
    """What a reader must never see, and a report that does not end in its conclusion."""
    page = tmp_path / "report.html"
    page.write_text("<!DOCTYPE html><html><body><pre>device: {'device': 'cpu', 'torch': '2.13'}</pre>"
                    "<table><tr><td>layout (flip HW): worst conv2.weight error ÷ b...</td><td>x\u2026</td></tr></table>"
                    '<div class="jp-Cell"><div id="conclusion">Conclusion. What to do: nothing.</div></div>'
                    '<div class="jp-Cell">a later cell</div></body></html>', encoding="utf-8")
    index = tmp_path / "index.html"
    index.write_text("<!DOCTYPE html><html><body><p>verdicts only</p></body></html>", encoding="utf-8")
    driver = open_browser(tmp_path / "profile")
    try:
        problems = "\n".join(page_problems(driver, page) + conclusion_problems(driver, page)
                             + conclusion_problems(driver, index))
    finally:
        driver.quit()
    for symptom in ("raw repr in the text", "{'device'", "table cell cut short: 'layout (flip HW)", "'x\u2026'",
                    "the conclusion is not the last cell", "index: no summary in words"):
        assert symptom in problems, (symptom, problems)


if __name__ == "__main__":  # refresh a screenshot: python tests/test_browser.py REPORT_DIR OUT.png
    import tempfile

    with tempfile.TemporaryDirectory() as profile:
        found = check_run_in_browser(Path(sys.argv[1]), Path(sys.argv[2]), Path(profile), require_conclusions=True)
    for name, issues in found.items():
        print(name, "ok" if not issues else issues)
    sys.exit(1 if any(found.values()) else 0)
