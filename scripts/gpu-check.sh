#!/usr/bin/env bash
# The GPU path on a machine with a GPU and no network (an instructor's server, a lent node):
#   1. installs what the machine lacks from the wheels in .whl/ (`make gpu-wheels` fetched them
#      on a machine with network; nothing comes from the internet), into $GPU_SITE;
#   2. `python -m course_lib gpu-check`: the roofline's two ceilings, the GPT step's MFU, the
#      planner's and ZeRO's memory against CUDA's allocator, every collective and parallelism
#      on CUDA tensors (NCCL for 1 rank, Gloo for 2 and 4 on one GPU) -> OUT/gpu.json, .md;
#   3. `pytest -m gpu tests/test_gpu.py`: the same, checked;
#   4. nbval on the notebooks with GPU cells (05, 06, 10, 16, 18).
# Usage: scripts/gpu-check.sh [OUT]   (default ./gpu-check; STEPS="report tests notebooks" and
# NOTEBOOKS=... pick what runs). Each step has its own deadline and
# the next runs even if one fails; the exit status is the first failure's. Copy OUT/gpu.json to
# course_lib/reference/gpu.json to make it the notebooks' stored reference.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/course-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: run with a deadline, log to OUT/NAME.log; the exit
    local name=$1 seconds=$2; shift 2  # status is the command's (124: past its deadline)
    echo "== $name ($(date +%T), at most ${seconds}s)" >&2
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc ($(date +%T))" >&2
    [ "$status" = 0 ] && status=$rc
    return "$rc"
}
if [ -d .whl ]; then
    # only what is missing: the machine's own numpy, torch and pytest stay; MPI always comes
    # from the wheels, mpi4py with the mpich it is built for (a machine's own mpi4py may be
    # built for another MPI than the mpiexec found first: ranks that all think they are 0)
    "$PY" - "$SITE" <<'PY'
import glob, importlib.metadata as md, os, subprocess, sys
site, wheels = sys.argv[1], []
for w in sorted(glob.glob(".whl/*.whl")):
    name = os.path.basename(w).split("-")[0]
    try:
        if name not in ("mpi4py", "mpich"):
            md.version(name)
            continue
    except md.PackageNotFoundError:
        pass
    wheels.append(w)
print(f"installing {len(wheels)} wheels into {site}:",
      " ".join(os.path.basename(w).split("-")[0] for w in wheels))
pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
       "--no-cache-dir"]
# MPICH's mpiexec and libmpi are data files, which --target leaves out: it gets a prefix
mpich = [w for w in wheels if os.path.basename(w).startswith("mpich-")]
if mpich:
    subprocess.run(pip + ["--ignore-installed", "--prefix", site + "/mpich", *mpich], check=True)
rest = [w for w in wheels if w not in mpich]
if rest:
    subprocess.run(pip + ["--upgrade", "--target", site, *rest], check=True)
PY
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
if [ -e "$SITE/mpich/lib/libmpi.so.12" ]; then  # the wheels' MPICH, whatever MPI the machine has
    export PATH="$SITE/mpich/bin:$PATH" MPI4PY_MPIABI=mpich \
        MPI4PY_LIBMPI="$SITE/mpich/lib/libmpi.so.12" \
        LD_LIBRARY_PATH="$SITE/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  command -v mpiexec && timeout 30 mpiexec -n 2 "$PY" -c "from mpi4py import MPI
print(MPI.COMM_WORLD.Get_rank(), MPI.Get_library_version().splitlines()[0], MPI.__file__)" \
      || echo "no working mpiexec"; } 2>&1 | tee "$OUT/machine.txt"
STEPS=${STEPS:-report tests notebooks}  # e.g. STEPS=notebooks NOTEBOOKS=notebooks/05_*.ipynb
NOTEBOOKS=${NOTEBOOKS:-notebooks/05_allreduce.ipynb notebooks/06_data_parallel_sgd.ipynb \
notebooks/10_sharded_data_parallelism.ipynb notebooks/16_planning_a_run.ipynb \
notebooks/18_serving_across_devices.ipynb}
case " $STEPS " in *" report "*)
    step report "${REPORT_S:-240}" "$PY" -m course_lib gpu-check --out "$OUT";; esac
# the tests and the notebooks side by side (16 cores, one GPU); the report ran alone: its timings
tests=
case " $STEPS " in *" tests "*)
    step tests "${TESTS_S:-300}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --junitxml "$OUT/tests.xml" tests/test_gpu.py > /dev/null &
    tests=$!;; esac
case " $STEPS " in *" notebooks "*)
    # shellcheck disable=SC2086  # NOTEBOOKS is a list of paths
    step notebooks "${NOTEBOOKS_S:-300}" "$PY" -m pytest -q -n 4 --dist loadfile \
        -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-cell-timeout=240 \
        --sanitize-with tests/nbval_sanitize.cfg $NOTEBOOKS > /dev/null;; esac
if [ -n "$tests" ]; then wait "$tests" || { [ "$status" = 0 ] && status=1; }; fi
for name in tests notebooks; do [ -f "$OUT/$name.log" ] && tail -n 30 "$OUT/$name.log"; done
exit "$status"
