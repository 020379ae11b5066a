#!/bin/sh
# Run the project on a machine without network access (a typical GPU node) whose python3 already
# has torch (a CUDA build): installs the wheels `make wheels` put in .whl/ into .whl/site (once,
# with --no-index), registers the notebooks' Jupyter kernel there, and runs one of:
#
#   scripts/gpu-run.sh test [PYTEST ARGS…]        the test suite (parametrised over cpu and cuda)
#   scripts/gpu-run.sh reports [RUN ARGS…]        precision-lab run --params ${PARAMS:-params/seed.yaml}
#   scripts/gpu-run.sh diagnose ARGS…             precision-lab diagnose ARGS…
#   scripts/gpu-run.sh python ARGS…               the project's Python with everything importable
#
# PYTHON picks the interpreter (default python3); it must be the one the wheels were fetched for.
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
wheels="$root/.whl"
site="$wheels/site"
usage="usage: scripts/gpu-run.sh test|reports|diagnose|python [ARGS…]"
case "${1:-}" in
  test|reports|diagnose|python) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "scripts/gpu-run.sh: $python cannot import torch: use a Python with a (CUDA) torch, e.g. PYTHON=/path/to/python3" >&2
  exit 2
fi
if [ ! -f "$site/.installed" ]; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "scripts/gpu-run.sh: no wheels in $wheels: run 'make wheels' on a machine with network and copy .whl/ here" >&2
    exit 2
  fi
  # the set was resolved by `make wheels`, less what the node has (WHEELS_PRESENT): install it as it is
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl; then
    echo "scripts/gpu-run.sh: the wheels in $wheels do not install on $("$python" --version): fetch them for this Python (make wheels WHEELS_PYTHON=X.Y)" >&2
    exit 2
  fi
  PYTHONPATH="$site" "$python" -m ipykernel install --prefix "$site" --name precision-lab \
    --display-name "Python (precision-lab)" >/dev/null
  touch "$site/.installed"
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export JUPYTER_PATH="$site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
export PATH="$site/bin:$PATH"
cd "$root"
command=$1
shift
case "$command" in
  test) exec "$python" -m pytest -q "$@" ;;
  reports) exec "$python" -m precision_lab.cli run --params "${PARAMS:-params/seed.yaml}" "$@" ;;
  diagnose) exec "$python" -m precision_lab.cli diagnose "$@" ;;
  python) exec "$python" "$@" ;;
esac
