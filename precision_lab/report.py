"""`precision-lab run`: execute the notebooks with papermill, render them to HTML, write the index.

A run is built in hidden temporary folders (`reports/.incomplete-<run-id>.<pid>` and
`data/runs/.incomplete-<run-id>.<pid>`) and renamed to `reports/<run-id>` and
`data/runs/<run-id>` only when every notebook has run and the index is written; then
`reports/latest` is pointed at it. An existing run is never overwritten. A failing notebook is
still rendered (papermill writes it with the failing cell marked) and the others still run; the
command then exits 1. Ctrl-C or SIGTERM leaves the temporary folders marked INTERRUPTED, says
so, and exits 130 / 143.
"""
from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import psutil
import yaml

from . import params as run_params
from . import provenance as prov
from .errors import LabInputError
from .paths import NOTEBOOKS_DIR, REPORTS_DIR, RUNS_DIR

KERNEL = "precision-lab"
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
#: papermill marks the cell that raised with this HTML id (papermill/execute.py, ERROR_MARKER_TAG)
ERROR_ANCHOR = "papermill-error-cell"
HEADLINE_FIGURE = "headline.png"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
INCOMPLETE_PREFIX = ".incomplete-"
MARKER = "INCOMPLETE.txt"
#: shell convention: 128 + signal number
EXIT_SIGNAL_BASE = 128
#: seconds papermill gets to shut its kernel down after SIGTERM before it is killed
CHILD_GRACE_S = 30
#: seconds the kernel gets to exit on its own (ipykernel polls its parent every second), then again after SIGTERM
KERNEL_GRACE_S = 5
#: how often the progress line re-reads the notebook papermill saves after each cell
PROGRESS_POLL_S = 0.5
_CURRENT_CHILD: dict = {"process": None}


class RunInterrupted(BaseException):
    """SIGTERM/SIGINT arrived during a run (a BaseException so that no `except Exception` eats it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class RunPlan:
    """A validated run: nothing here can fail for bad input any more."""

    run_id: str
    notebooks: list[Path]
    declared: dict[str, dict[str, run_params.Declared]]
    values: dict
    params_file: str | None
    reports_dir: Path
    runs_dir: Path
    notebooks_dir: Path
    show_code: bool = False
    cell_timeout: int | None = None
    rerun_of: str | None = None
    command_line: list[str] = field(default_factory=lambda: list(sys.argv))


@dataclass
class NotebookOutcome:
    name: str
    ok: bool
    seconds: float
    error: str | None = None
    failed_cell: int | None = None
    has_error_anchor: bool = False
    executed: bool = False


# ---------------------------------------------------------------------------------------------
# CLI


def configure(parser) -> None:
    parser.add_argument("--params", metavar="FILE", help="parameters YAML, e.g. params/quick.yaml")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", dest="overrides", metavar=("NAME", "VALUE"),
                        help="override one parameter; VALUE is a YAML literal (64, 1e-3, cpu, null, [64, 128])")
    parser.add_argument("--notebooks", metavar="LIST", help="comma-separated notebook prefixes to run, e.g. 01,03")
    parser.add_argument("--run-id", help="name of the run (default: UTC time, e.g. 20260101-120000)")
    parser.add_argument("--show-code", action="store_true", help="keep code cells in the HTML reports")
    parser.add_argument("--cell-timeout", type=int, default=None, metavar="S", help="seconds allowed per cell")
    parser.add_argument("--notebooks-dir", type=Path, default=NOTEBOOKS_DIR, help="notebooks to run (default: notebooks/)")
    parser.add_argument("--reports-dir", type=Path, default=REPORTS_DIR, help="where reports go (default: reports/)")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help="where tables go (default: data/runs/)")


def main(args) -> int:
    plan = plan_run(params_file=args.params, overrides=args.overrides, notebooks=args.notebooks,
                    run_id=args.run_id, show_code=args.show_code, cell_timeout=args.cell_timeout,
                    notebooks_dir=args.notebooks_dir, reports_dir=args.reports_dir, runs_dir=args.runs_dir)
    return execute(plan)


# ---------------------------------------------------------------------------------------------
# planning: every check on the user's input happens here, before anything runs


def plan_run(params_file=None, overrides=None, notebooks=None, run_id=None, show_code=False, cell_timeout=None,
             notebooks_dir=NOTEBOOKS_DIR, reports_dir=REPORTS_DIR, runs_dir=RUNS_DIR, values=None,
             rerun_of=None, command_line=None) -> RunPlan:
    """Validate notebooks, parameters and run id; `values` (already merged) is what rerun passes."""
    notebooks_dir, reports_dir, runs_dir = Path(notebooks_dir), Path(reports_dir), Path(runs_dir)
    every_notebook = find_notebooks(notebooks_dir)
    selected = select_notebooks(every_notebook, notebooks)
    declared = {nb.stem: run_params.notebook_parameters(nb) for nb in every_notebook}
    if values is None:
        file_values = run_params.load_params_file(params_file)
        values, sources = run_params.merge(file_values, run_params.parse_overrides(overrides), params_file)
    else:
        sources = {name: f"provenance: parameter {name!r}" for name in values}
    values = run_params.validate(values, sources, declared)
    if cell_timeout is not None and cell_timeout <= 0:
        raise LabInputError(f"--cell-timeout {cell_timeout}: expected a positive number of seconds")
    check_kernel(KERNEL)
    run_id = choose_run_id(run_id, reports_dir, runs_dir)
    return RunPlan(run_id, selected, {nb.stem: declared[nb.stem] for nb in selected}, values,
                   str(params_file) if params_file is not None else None, reports_dir, runs_dir, notebooks_dir,
                   show_code, cell_timeout, rerun_of, list(sys.argv if command_line is None else command_line))


def find_notebooks(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise LabInputError(f"{folder}: no such notebooks folder")
    found = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if not found:
        raise LabInputError(f"{folder}: no notebooks (*.ipynb) to run")
    return found


def select_notebooks(every_notebook: list[Path], selection: str | None) -> list[Path]:
    """The notebooks whose names start with one of the comma-separated prefixes (all when None)."""
    if selection is None:
        return every_notebook
    prefixes = [p.strip() for p in selection.split(",") if p.strip()]
    if not prefixes:
        raise LabInputError(f"--notebooks {selection!r}: expected comma-separated prefixes such as 01,03")
    for prefix in prefixes:
        if not any(nb.stem.startswith(prefix) for nb in every_notebook):
            names = ", ".join(nb.stem for nb in every_notebook)
            raise LabInputError(f"--notebooks: no notebook starts with {prefix!r}; there are: {names}")
    return [nb for nb in every_notebook if any(nb.stem.startswith(p) for p in prefixes)]


def check_kernel(name: str) -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        raise LabInputError(f"Jupyter kernel {name!r} is not registered: run `make setup` "
                            f"(or `python -m ipykernel install --sys-prefix --name {name}`)") from None


def choose_run_id(run_id: str | None, reports_dir: Path, runs_dir: Path) -> str:
    """The given id if valid and unused; otherwise the UTC time, suffixed -2, -3 … when taken."""
    if run_id is not None:
        if not RUN_ID_PATTERN.match(run_id) or run_id == "latest":
            raise LabInputError(f"--run-id {run_id!r}: expected letters, digits, '.', '_' or '-' "
                                "(not starting with '.' and not 'latest'), at most 100 characters")
        if (reports_dir / run_id).exists() or (runs_dir / run_id).exists():
            raise LabInputError(f"--run-id {run_id!r}: {reports_dir / run_id} or {runs_dir / run_id} exists; "
                                "a run never overwrites another, choose a new id")
        return run_id
    base = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    candidate, n = base, 1
    while (reports_dir / candidate).exists() or (runs_dir / candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


# ---------------------------------------------------------------------------------------------
# execution


def execute(plan: RunPlan) -> int:
    """Run the plan; 0 when every notebook ran, 1 when one failed, 128+signal when interrupted."""
    token = f"{INCOMPLETE_PREFIX}{plan.run_id}.{os.getpid()}"
    report_tmp, data_tmp = plan.reports_dir / token, plan.runs_dir / token
    for folder in (report_tmp, data_tmp):
        folder.mkdir(parents=True)
        (folder / MARKER).write_text(f"run {plan.run_id} is being built here; "
                                     "this folder is not a complete run.\n", encoding="utf-8")
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    started = time.monotonic()
    try:
        provenance = prov.collect(plan.run_id, plan.values, params_file=plan.params_file,
                                  notebooks=[nb.stem for nb in plan.notebooks], notebooks_dir=str(plan.notebooks_dir),
                                  command_line=plan.command_line, rerun_of=plan.rerun_of,
                                  options={"show_code": plan.show_code, "cell_timeout": plan.cell_timeout,
                                           "reports_dir": str(plan.reports_dir.resolve()),
                                           "runs_dir": str(plan.runs_dir.resolve())})
        _say(f"run {plan.run_id}: {len(plan.notebooks)} notebook(s), device {provenance['device'].get('device')}")
        outcomes = []
        for index, notebook in enumerate(plan.notebooks, 1):
            _say(f"[{index}/{len(plan.notebooks)}] {notebook.stem}: running")
            outcome = run_notebook(notebook, plan, report_tmp, data_tmp)
            render_isolated(report_tmp / f"{notebook.stem}.ipynb", report_tmp / f"{notebook.stem}.html",
                            outcome, plan.show_code)
            outcomes.append(outcome)
            state = "ok" if outcome.ok else f"FAILED ({outcome.error})"
            _say(f"[{index}/{len(plan.notebooks)}] {notebook.stem}: {state} in {outcome.seconds:.1f} s")
        provenance["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        provenance["seconds"] = round(time.monotonic() - started, 1)
        provenance["outcome"] = [outcome.__dict__ for outcome in outcomes]
        provenance["kernels"] = prov.kernels_that_ran(data_tmp)
        prov.write(provenance, report_tmp)
        prov.write(provenance, data_tmp)
        write_index(report_tmp, data_tmp, plan, provenance, outcomes)
        for signum in previous:  # the two renames take milliseconds: finish them rather than half-publish
            signal.signal(signum, signal.SIG_IGN)
        report_final = publish(plan, report_tmp, data_tmp)
    except RunInterrupted as stop:
        return _interrupted(plan, stop.signum, report_tmp, data_tmp)
    except KeyboardInterrupt:
        return _interrupted(plan, signal.SIGINT, report_tmp, data_tmp)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    failed = [o.name for o in outcomes if not o.ok]
    _say(f"run {plan.run_id}: report {report_final / 'index.html'}")
    if failed:
        _say(f"run {plan.run_id}: {len(failed)} notebook(s) failed: {', '.join(failed)}")
        return 1
    return 0


def _raise_interrupted(signum, _frame):
    raise RunInterrupted(signum)


def _interrupted(plan: RunPlan, signum: int, report_tmp: Path, data_tmp: Path) -> int:
    """Mark the temporary folders as an interrupted run and say so; nothing is published."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the cleanup short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = signal.Signals(signum).name
    note = (f"run {plan.run_id} was interrupted by {name} and is INCOMPLETE: it was not published "
            f"(no reports/{plan.run_id}, reports/latest unchanged); partial output is left here for inspection.\n")
    for folder in (report_tmp, data_tmp):
        if folder.exists():
            (folder / MARKER).unlink(missing_ok=True)
            (folder / "INTERRUPTED.txt").write_text(note, encoding="utf-8")
    _stop_notebook_process()
    print(f"precision-lab: interrupted ({name}): run {plan.run_id} is incomplete and was not published; "
          f"partial output left in {report_tmp} and {data_tmp}", file=sys.stderr, flush=True)
    return EXIT_SIGNAL_BASE + int(signum)


def _stop_notebook_process() -> None:
    """Stop the running papermill child and every process below it (the Jupyter kernel).

    nbclient asks the kernel to shut down on SIGTERM, but the kernel runs in its own session
    (jupyter_client launches it with start_new_session) and can outlive a papermill that exits
    first, so the whole tree is collected before the signal and waited for (then killed) after it.
    """
    child = _CURRENT_CHILD.get("process")
    if child is None or child.poll() is not None:
        return
    try:
        below = psutil.Process(child.pid).children(recursive=True)
    except psutil.Error:  # papermill exited between poll() and here
        below = []
    child.terminate()
    try:
        child.wait(timeout=CHILD_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    _, survivors = psutil.wait_procs(below, timeout=KERNEL_GRACE_S)
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        survivors = _with_descendants(survivors)  # what they started since the first look
        for process in survivors:
            with contextlib.suppress(psutil.Error):
                stop(process)
        _, survivors = psutil.wait_procs(survivors, timeout=KERNEL_GRACE_S)


def _with_descendants(processes: list) -> list:
    """The processes and everything now running below them."""
    found = {process.pid: process for process in processes}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            found.update((child.pid, child) for child in process.children(recursive=True))
    return list(found.values())


def _say(message: str) -> None:
    print(f"precision-lab: {message}", file=sys.stderr, flush=True)


def run_notebook(notebook: Path, plan: RunPlan, report_tmp: Path, data_tmp: Path) -> NotebookOutcome:
    """Execute one notebook into `report_tmp/<name>.ipynb`; a failure is an outcome, not an exception.

    papermill runs in a child process (its own session) so that this process alone decides what
    Ctrl-C and SIGTERM do: nbclient would otherwise take over both signals while a cell runs.
    """
    output = report_tmp / f"{notebook.stem}.ipynb"
    folder = data_tmp / notebook.stem
    folder.mkdir(parents=True, exist_ok=True)
    injected = run_params.for_notebook(plan.values, plan.declared[notebook.stem], data_tmp.resolve())
    parameters_file = folder / "parameters.yaml"
    parameters_file.write_text(yaml.safe_dump(injected, sort_keys=True), encoding="utf-8")
    command = [sys.executable, "-m", "papermill", str(notebook), str(output), "-f", str(parameters_file),
               "-k", KERNEL, "--cwd", str(Path.cwd()), "--log-level", "WARNING", "--no-progress-bar"]
    if plan.cell_timeout is not None:
        command += ["--execution-timeout", str(plan.cell_timeout)]
    started = time.monotonic()
    with open(folder / "papermill.log", "wb") as log:
        # the kernel inherits this: notebooks' own progress bars stay out of the rendered reports
        environment = dict(os.environ, PRECISION_LAB_PROGRESS="0")
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=environment)
        _CURRENT_CHILD["process"] = child
        try:
            _wait_showing_progress(child, output, notebook.stem)
        finally:
            _stop_notebook_process()
            _CURRENT_CHILD["process"] = None
    outcome = NotebookOutcome(notebook.stem, ok=child.returncode == 0, seconds=round(time.monotonic() - started, 1),
                              executed=output.exists())
    if not outcome.ok:
        outcome.error, outcome.failed_cell, outcome.has_error_anchor = _failure(output, folder / "papermill.log")
    return outcome


def _wait_showing_progress(child: subprocess.Popen, output: Path, name: str) -> None:
    """Wait for papermill; on a terminal, show `cell k/n` from the notebook it saves after each cell."""
    interactive = sys.stderr.isatty()
    while child.poll() is None:
        time.sleep(PROGRESS_POLL_S)
        if interactive:
            done, total = _cells_done(output)
            if total:
                print(f"\r  {name}: cell {done}/{total}", end="", file=sys.stderr, flush=True)
    if interactive:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)


def _cells_done(output: Path) -> tuple[int, int]:
    try:
        cells = json.loads(output.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):  # not written yet, or caught mid-write
        return 0, 0
    code = [c for c in cells if c.get("cell_type") == "code"]
    done = sum(c.get("metadata", {}).get("papermill", {}).get("status") == "completed" for c in code)
    return done, len(code)


def _failure(output: Path, log: Path) -> tuple[str, int | None, bool]:
    """What failed: the failing cell's exception (from the saved notebook) or the log's last line."""
    if output.exists():
        try:
            notebook = json.loads(output.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            notebook = {"cells": []}
        for cell in notebook.get("cells", []):
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if cell.get("metadata", {}).get("papermill", {}).get("exception") and errors:
                anchor = ERROR_ANCHOR in output.read_text(encoding="utf-8")
                return f"{errors[0].get('ename')}: {errors[0].get('evalue')}", cell.get("execution_count"), anchor
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return (lines[-1] if lines else "papermill failed without a message"), None, False


# ---------------------------------------------------------------------------------------------
# rendering


def render_isolated(executed: Path, html_path: Path, outcome: NotebookOutcome, show_code: bool) -> None:
    """Render, and if rendering itself fails, mark the notebook failed with a page that says why."""
    try:
        render_report(executed, html_path, outcome, show_code)
    except Exception as exc:  # noqa: BLE001 - one unrenderable notebook must not lose the run
        outcome.ok, outcome.has_error_anchor = False, True
        outcome.error = f"could not render the report ({type(exc).__name__}: {exc})"
        html_path.write_text(_environment().get_template("failed-notebook.html.j2").render(outcome=outcome),
                             encoding="utf-8")


def render_report(executed: Path, html_path: Path, outcome: NotebookOutcome, show_code: bool = False) -> Path:
    """Self-contained HTML of an executed notebook (figures inline, no code unless asked, no network)."""
    if not executed.exists():
        html_path.write_text(_environment().get_template("failed-notebook.html.j2").render(outcome=outcome),
                             encoding="utf-8")
        return html_path
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", template_file="offline-notebook.html.j2",
                            extra_template_basedirs=[str(TEMPLATES_DIR)], extra_template_paths=[str(TEMPLATES_DIR)],
                            exclude_input=not show_code, exclude_input_prompt=not show_code,
                            exclude_output_prompt=not show_code, embed_images=True, sanitize_html=True)
    exporter.register_filter("clean_html", sanitize_html)
    notebook = nbformat.read(executed, as_version=4)
    if not show_code:
        _drop_stderr(notebook)
    body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": outcome.name}})
    html_path.write_text(body, encoding="utf-8")
    return html_path


def _drop_stderr(notebook) -> None:
    """Remove what cells wrote to stderr (library logs such as the profiler's, warnings): a reader of the
    report needs the results; the executed notebook beside it keeps everything."""
    for cell in notebook.cells:
        if cell.get("cell_type") == "code":
            cell.outputs = [o for o in cell.get("outputs", [])
                            if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


#: what a notebook's HTML may keep: text structure, tables (pandas), inline images; never scripts,
#: event handlers, forms, iframes or styles (CSS can fetch from the network)
SAFE_TAGS = ("a", "abbr", "b", "blockquote", "br", "caption", "code", "dd", "details", "div", "dl", "dt", "em",
             "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "img", "kbd", "li", "ol", "p", "pre", "s", "samp",
             "small", "span", "strong", "sub", "summary", "sup", "table", "tbody", "td", "tfoot", "th", "thead",
             "tr", "u", "ul", "var")
SAFE_ATTRIBUTES = {"*": ["class", "id", "title"], "a": ["href", "title", "class", "id"],
                   "img": ["src", "alt", "width", "height", "class"], "td": ["colspan", "rowspan", "class"],
                   "th": ["colspan", "rowspan", "class"], "table": ["class", "border"]}
_STYLE_BLOCK = re.compile(r"<style\b[^>]*>.*?</style\s*>", re.IGNORECASE | re.DOTALL)


def sanitize_html(html) -> str:
    """Notebook HTML (markdown and outputs) with anything executable or fetching removed.

    Replaces nbconvert's `clean_html`, whose allowlist drops headings and pandas' table heads.
    Disallowed tags are escaped (shown as text), `<style>` blocks (pandas) are dropped.
    """
    import bleach

    html = html.decode() if isinstance(html, bytes) else str(html)
    return bleach.clean(_STYLE_BLOCK.sub("", html), tags=SAFE_TAGS, attributes=SAFE_ATTRIBUTES,
                        protocols=["http", "https", "mailto", "data"], strip=False)


def _environment():
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)), autoescape=True,
                              undefined=jinja2.StrictUndefined)


def write_index(report_tmp: Path, data_tmp: Path, plan: RunPlan, provenance: dict,
                outcomes: list[NotebookOutcome]) -> Path:
    """The index page: the run in words, verdict matrix, links, headline figures, provenance (all text escaped)."""
    from .conclusions import run_summary
    from .results import load_conclusions, load_summaries
    from .tables import VERDICT_MEANINGS

    tables_rel = Path(os.path.relpath(plan.runs_dir / plan.run_id, plan.reports_dir / plan.run_id))
    notebooks = [_notebook_row(o, data_tmp, tables_rel) for o in outcomes]
    summaries = load_summaries(data_tmp)
    matrix = verdict_matrix(summaries, notebooks, data_tmp)
    page = _environment().get_template("index.html.j2").render(
        run_id=plan.run_id, provenance=provenance, notebooks=notebooks,
        failed=[nb for nb in notebooks if not nb["ok"]],
        matrix=matrix, summary=run_summary(load_conclusions(data_tmp), summaries),
        context=context_rows(plan, provenance),
        legend=[(v, meaning) for v, meaning in VERDICT_MEANINGS.items()
                if any(e["verdict"] == v for cell in matrix["cells"].values() for e in cell)],
        parameters=_parameter_rows(plan, provenance),
        device_rows=_device_rows(provenance),
        duration=f"{provenance.get('seconds', 0):.0f} s",
        git_commit_short=(provenance["git"].get("commit") or "unknown")[:12],
        command_line=shlex.join(shown_path(arg) for arg in provenance["command_line"]),
        cwd=shown_path(provenance.get("cwd") or "."),
        params_file=shown_path(provenance["params_file"]) if provenance.get("params_file") else None)
    path = report_tmp / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def shown_path(text: str) -> str:
    """A path as the index shows it: relative to the project when inside it, `~` for the home folder;
    provenance.json keeps it as run (a rerun needs it), a page forwarded to others need not show the machine's."""
    from .paths import ROOT

    path = Path(text)
    if not path.is_absolute():
        return text
    if path == ROOT or path.is_relative_to(ROOT):
        relative = path.relative_to(ROOT).as_posix()
        return "." if relative == "." else relative
    home = Path.home()
    if home != Path("/") and path.is_relative_to(home):
        return "~/" + path.relative_to(home).as_posix()
    return text


def _value_used(plan: RunPlan, name: str):
    """A parameter's value in this run: given, else the first declaring notebook's default (None if undeclared)."""
    if name in plan.values:
        return plan.values[name]
    return next((declared[name].default for declared in plan.declared.values() if name in declared), None)


def context_rows(plan: RunPlan, provenance: dict) -> list[tuple[str, str]]:
    """Where and on what the run ran, in words: device, torch, cuDNN, sizes, batch, seed, image source."""
    from .tables import describe_device_in_words, image_source_in_words

    device = provenance.get("device", {})
    rows = [("device", describe_device_in_words(device)), ("torch", str(provenance.get("versions", {}).get("torch")))]
    cudnn = provenance.get("backend_flags", {}).get("cudnn_version")
    rows.append(("cuDNN", str(cudnn) if str(device.get("device", "")).startswith("cuda") and cudnn else
                 "not used (CPU run)"))
    size, sizes = _value_used(plan, "size"), _value_used(plan, "sizes")
    if size is not None:
        rows.append(("problem size", f"{size} × {size} pixels"))
    if sizes:
        rows.append(("size sweep", ", ".join(map(str, sizes)) + " pixels per side"))
    for name in ("batch", "seed"):
        if _value_used(plan, name) is not None:
            rows.append((name, str(_value_used(plan, name))))
    if "image" in plan.values or any("image" in d for d in plan.declared.values()):
        image = _value_used(plan, "image")
        rows.append(("image source", image_source_in_words("synthetic" if image is None else str(image),
                                                           _value_used(plan, "seed"))))
    return rows


def _device_rows(provenance: dict) -> list[tuple[str, str]]:
    """The device and the kernel-library flags, named as torch names them (so they can be searched)."""
    names = {"device": "device", "name": "processor or GPU", "torch": "torch", "threads": "CPU threads",
             "mkldnn": "oneDNN available", "cuda": "CUDA", "cudnn": "cuDNN", "capability": "compute capability"}
    rows = [(names.get(key, key.replace("_", " ")), str(value)) for key, value in provenance.get("device", {}).items()]
    rows += [(f"torch flag {key}", str(value)) for key, value in provenance.get("backend_flags", {}).items()]
    return rows


def _notebook_row(outcome: NotebookOutcome, data_tmp: Path, tables_rel: Path) -> dict:
    href = quote(f"{outcome.name}.html")
    error_href = None
    if not outcome.ok:
        error_href = f"{href}#{ERROR_ANCHOR}" if outcome.has_error_anchor else href
    folder = data_tmp / outcome.name
    tables = [{"name": p.name, "href": quote((tables_rel / outcome.name / p.name).as_posix())}
              for p in sorted(folder.glob("*.csv"))] if folder.is_dir() else []
    headline = folder / HEADLINE_FIGURE
    from .results import figure_caption

    return {"name": outcome.name, "ok": outcome.ok, "status": "ok" if outcome.ok else "failed",
            "error": outcome.error, "seconds": f"{outcome.seconds:.1f}", "href": href, "error_href": error_href,
            "ipynb_href": quote(f"{outcome.name}.ipynb") if outcome.executed else None, "tables": tables,
            "headline_uri": _data_uri(headline) if headline.is_file() else None,
            "headline_caption": figure_caption(headline) if headline.is_file() else ""}


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def verdict_matrix(summaries, notebooks: list[dict], data_dir: Path) -> dict:
    """Candidates × experiments, each cell the verdict(s) and headline(s) of the summary rows."""
    candidates, experiments, cells = [], [], {}
    for row in summaries.to_dict("records"):
        candidate, experiment = _text(row.get("candidate")), _text(row.get("experiment"))
        candidates += [candidate] if candidate not in candidates else []
        experiments += [experiment] if experiment not in experiments else []
        verdict = _text(row.get("verdict"))
        unprobed = row.get("probed") is False or row.get("probed") == 0  # said beside it: no probes ran
        cells.setdefault((candidate, experiment), []).append(
            {"verdict": verdict, "headline": ("unprobed: " if unprobed else "") + _text(row.get("headline")),
             "verdict_class": re.sub(r"[^a-z0-9-]", "", verdict.lower()) or "none"})
    missing = [nb for nb in notebooks if not (data_dir / nb["name"] / "summary.csv").is_file()]
    return {"candidates": candidates, "experiments": experiments, "cells": cells, "missing": missing}


def _text(value) -> str:
    """A table cell as text ('—' for missing values; pandas reads empty cells as NaN)."""
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    return str(value)


def _parameter_rows(plan: RunPlan, provenance: dict) -> list[dict]:
    """Every declared parameter with the value used (given or default) and who declares it."""
    rows = {}
    for notebook, declared in plan.declared.items():
        for name, item in declared.items():
            if name in run_params.RESERVED:
                continue
            value = plan.values[name] if name in plan.values else item.default
            origin = "" if name in plan.values else " (default)"
            row = rows.setdefault(name, {"name": name, "value": f"{json.dumps(value)}{origin}", "notebooks": []})
            row["notebooks"].append(notebook)
    return [{**row, "notebooks": ", ".join(row["notebooks"])} for _, row in sorted(rows.items())]


# ---------------------------------------------------------------------------------------------
# publishing


def publish(plan: RunPlan, report_tmp: Path, data_tmp: Path) -> Path:
    """Rename the finished run into place (never over an existing one) and point `latest` at it."""
    report_final, data_final = plan.reports_dir / plan.run_id, plan.runs_dir / plan.run_id
    if report_final.exists() or data_final.exists():
        raise LabInputError(f"{report_final} appeared while the run was going; the finished run stays in "
                            f"{report_tmp} and {data_tmp}")
    for folder in (report_tmp, data_tmp):
        (folder / MARKER).unlink(missing_ok=True)
    os.rename(data_tmp, data_final)
    os.rename(report_tmp, report_final)
    point_latest(plan.reports_dir, plan.run_id)
    return report_final


def point_latest(reports_dir: Path, run_id: str) -> None:
    """`reports/latest` → run_id, replaced atomically (a relative symlink)."""
    link, staging = reports_dir / "latest", reports_dir / f".latest.{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(run_id, staging)
    os.replace(staging, link)
