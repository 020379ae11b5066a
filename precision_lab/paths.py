"""One place for the lab's paths (cookiecutter-data-science style): everything hangs off ROOT."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
RUNS_DIR = DATA_DIR / "runs"
REPORTS_DIR = ROOT / "reports"
NOTEBOOKS_DIR = ROOT / "notebooks"
PARAMS_DIR = ROOT / "params"
