#!/usr/bin/env bash
# Engine v4 on the GPU: the fixed-shape private step (dpsynth.dpsgd.fixed_shape) captured as one CUDA graph.
#
#   bash experiments/gpu_engine_v4.sh                                       # on the GPU machine, repository root
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1 OUT=/tmp/v4 bash experiments/gpu_engine_v4.sh   # the same steps on a CPU
#
# Steps (each time-boxed; one failing does not stop the others; output in $OUT/log.txt):
#   1. nvidia-smi, python / torch versions                                               -> log.txt
#   2. the fixed-shape privacy tests (tests/dpsgd/test_fixed_shape.py) and, on CUDA, the clip-bound tests on the
#      device (tests/dpsgd/test_tap_safety.py)                                             -> log.txt
#   3. experiments/graph_capture_check.py: the captured step (CUDA) against the exact step, cnn and unet-0.8m,
#      parameters and EMA equal to float rounding                                         -> capture_check.json
#   4. experiments/dpsgd_step.py graph rows: non-private, graph-non-private (captured), engine (eager),
#      graph-engine (captured fixed-shape step) and Opacus' rows for comparison; cnn, unet-0.8m, unet-6m; K = 1, 4
#                                                                                         -> dpsgd_step_graph.json
#   summary.tsv: each step's exit status and seconds.
#
# Environment: OUT (default experiments/results/gpu/engine_v4_<tag>, tag h200 / h100 / gpu / cpu[-tiny]),
# GPU_CHECK_DEVICE (cuda), GPU_CHECK_TINY (0: 1 = one model, K = 1, 1 rep), GPU_CHECK_PY (python3; .venv/bin/python
# on a CPU when present), GPU_CHECK_REPS (30), GPU_CHECK_STEPS (1,2,3,4).

set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TINY=${GPU_CHECK_TINY:-0}
STEPS=${GPU_CHECK_STEPS:-1,2,3,4}
. "$(dirname "$0")/gpu_env.sh"  # TAG and PY
OUT=${OUT:-experiments/results/gpu/engine_v4_$TAG}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
exec > >(tee -a "$OUT/log.txt") 2>&1
: > "$OUT/summary.tsv"
say() { echo "[gpu_engine_v4 +$(($(date +%s) - START))s] $*"; }
wants() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run_step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    say "START $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUT/summary.tsv"
    say "END $name rc=$rc"
}

if wants 1; then
    timeout 20 nvidia-smi 2>/dev/null || say "no nvidia-smi"
    "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
fi
if wants 2; then
    run_step fixed-shape-tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/dpsgd/test_fixed_shape.py
    if [ "$DEVICE" != cpu ]; then
        run_step tap-safety-cuda 200 "$PY" -m pytest -q -p no:cacheprovider tests/dpsgd/test_tap_safety.py
    fi
fi
if wants 3; then
    if [ "$TINY" = 1 ]; then CHECK=(--models cnn --steps 2 --records 640); else CHECK=(--models cnn,unet-0.8m --steps 5); fi
    run_step capture-check 240 "$PY" experiments/graph_capture_check.py --device "$DEVICE" "${CHECK[@]}" \
        --out "$OUT/capture_check.json"
fi
if wants 4; then
    if [ "$TINY" = 1 ]; then
        ROWS=(--models cnn --k 1 --reps 1 --warmup 1 --implementations non-private,graph-non-private,engine,graph-engine)
    else
        ROWS=(--models cnn,unet-0.8m,unet-6m --k 1,4 --reps "${GPU_CHECK_REPS:-30}" --warmup 3
            --implementations non-private,graph-non-private,engine,graph-engine,opacus-hooks,opacus-ghost,opacus-functorch)
    fi
    run_step dpsgd-step-graph 420 "$PY" experiments/dpsgd_step.py --device "$DEVICE" "${ROWS[@]}" --json \
        > "$OUT/dpsgd_step_graph.json"
fi
say "done; results in $OUT"
cat "$OUT/summary.tsv"
