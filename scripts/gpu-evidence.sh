#!/bin/bash
# The seed-scale evidence on a CUDA machine, through scripts/gpu-run.sh (after `make wheels`): the
# device-parametrised tests, the six notebooks at params/seed.yaml, diagnoses of the built-in candidates
# at 1024², the bench, then as much of the whole suite as the time left allows. Everything lands in
# data/gpu-runs/<run-id>/ (or $DEST): machine.txt, the run's reports/ and tables/, one .txt and .json per
# diagnosis, bench.txt, tests-*.log, and times.txt (wall seconds of each step).
#
#   bash scripts/gpu-evidence.sh [SECONDS]     SECONDS: the whole budget (default 540); the suite gets the rest
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
budget=${1:-540}
start=$(date +%s)
run_id=gpu-$(date -u +%Y%m%d-%H%M%S)
dest=${DEST:-$root/data/gpu-runs/$run_id}
mkdir -p "$dest"
lab="bash scripts/gpu-run.sh"
export PYTHONUNBUFFERED=1

# step NAME LIMIT COMMAND…: runs COMMAND with its output in $dest/NAME.txt, wall time and exit code in times.txt
step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 5 ] && { echo "$name skipped: budget spent" | tee -a "$dest/times.txt"; return; }
  timeout "$limit" "$@" > "$dest/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc wall_s=$(( $(date +%s) - t0 ))" | tee -a "$dest/times.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; } > "$dest/machine.txt" 2>&1
step setup 120 $lab python -c "import torch, papermill, nbconvert, ipykernel, jupyter_client, mrcfile, dask.distributed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
cat "$dest/setup.txt" >> "$dest/machine.txt"
step tests-devices 150 $lab test -q -p no:cacheprovider tests/test_devices.py tests/test_conv.py
step run 330 $lab reports --run-id "$run_id"
[ -d "reports/$run_id" ] && cp -r "reports/$run_id" "$dest/reports"
[ -d "data/runs/$run_id" ] && cp -r "data/runs/$run_id" "$dest/tables"
for candidate in native native-tf32 fortran-replay-flip; do
  step "diagnose-$candidate" 90 $lab diagnose --candidate "builtin:$candidate" --size 1024 --device cuda \
    --json "$dest/diagnose-$candidate.json"
done
step bench 120 $lab python -m precision_lab.cli bench --only reference --only diagnose --size 1024 --device cuda
left=$(( budget - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
  workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n $(( $(nproc) - 2 ))")
  step tests-suite "$left" $lab test -q -p no:cacheprovider $workers --ignore=tests/test_browser.py
fi
echo "evidence in $dest"
