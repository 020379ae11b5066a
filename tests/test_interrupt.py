"""An interrupted run (SIGTERM, Ctrl-C) publishes nothing that looks complete, stops its kernel, and says so."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precision_lab.paths import ROOT

FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"
#: seconds to wait for the slow fixture notebook to reach its sleep (kernel start-up on a busy 2-core machine)
START_TIMEOUT_S = 180


def lab(tmp: Path, *args) -> list[str]:
    return [sys.executable, "-m", "precision_lab.cli", "run", "--notebooks-dir", str(FIXTURES),
            "--reports-dir", str(tmp / "reports"), "--runs-dir", str(tmp / "runs"), *map(str, args)]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc): the papermill child and its Jupyter kernel."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    done = subprocess.run(lab(tmp, "--notebooks", "02", "--run-id", "earlier"), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return tmp


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to watch the kernel process")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_run_is_not_published(earlier_run, signum):
    tmp = earlier_run
    run_id = f"cut-{signum.name}"
    process = subprocess.Popen(lab(tmp, "--notebooks", "02", "-p", "sleep_s", "300", "--run-id", run_id),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not list((tmp / "runs").glob(f".incomplete-{run_id}.*/02-fixture-sleep/started")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the fixture notebook never started"
        time.sleep(0.2)
    below = descendants(process.pid)
    assert below, "papermill and its kernel should be running"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)

    assert process.returncode == 128 + signum
    assert f"interrupted ({signum.name}): run {run_id} is incomplete and was not published" in stderr
    assert "Traceback" not in stderr
    assert not (tmp / "reports" / run_id).exists() and not (tmp / "runs" / run_id).exists()
    assert os.readlink(tmp / "reports" / "latest") == "earlier"
    assert (tmp / "reports" / "earlier" / "index.html").is_file()
    for root in (tmp / "reports", tmp / "runs"):
        partial = list(root.glob(f".incomplete-{run_id}.*"))
        assert len(partial) == 1, partial
        assert (partial[0] / "INTERRUPTED.txt").read_text().startswith(f"run {run_id} was interrupted by {signum.name}")
        assert not (partial[0] / "index.html").exists() and not (partial[0] / "provenance.json").exists()
    assert [pid for pid in below if alive(pid)] == []
