#!/usr/bin/env bash
# One-shot GPU measurement run for dpsynth: everything a single device call should bring back.
#
#   bash experiments/gpu_check.sh                 # on the GPU machine, from the repository root
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1 bash experiments/gpu_check.sh   # the same steps, tiny, on a CPU (~2 min)
#
# Steps (each guarded and time-boxed; one failing does not stop the others; all output goes to
# $OUT/log.txt, results to $OUT/*.json):
#   1. nvidia-smi, python / torch / CUDA versions, dependency imports           -> log.txt
#   2. experiments/dpsgd_step.py on the device: cnn, unet-0.8m, unet-6m at K=1 and K=4; rows non-private,
#      engine, opacus-hooks, opacus-ghost (K=1 only: n/a with multiplicity), opacus-functorch,
#      torch-func                                                                  -> dpsgd_step_<tag>.json
#   3. experiments/paper_scale_steps.py large-unet: UNets of 16M, 38M ("35m") and 86M parameters at
#      32x32x3, batch 32, K=1: non-private vs engine step time and peak memory    -> large_unet_<tag>.json
#   4. (time permitting) experiments/paper_scale_steps.py presets: paper-scale presets at full model size,
#      logical batch, K and physical batch on random inputs; partial steps projected to full ones,
#      full steps when affordable, the privacy plan's DP steps from `dpsynth run P --dry-run --json`
#      (run on the CPU in the background)                                          -> paper_scale_<tag>.json
#   5. (run right after step 1: seconds) the clip bound on the device: tests/dpsgd/test_tap_safety.py's
#      near-cancelling-record cases on CUDA (every strategy and layer form: one record whose gradient rows
#      nearly cancel moves the noiseless clipped sum by at most C (1 + 1e-5), with TF32 off inside the private
#      step) and the TF32-flags test; pytest when it imports, else the same checks by a plain loop -> log.txt
#   summary.json: each step's exit status and seconds. <tag> is h100 (h200 on an H200, gpu on another
#   GPU, cpu[-tiny] on a CPU).
#
# Environment: OUT (default experiments/out/gpu_check), GPU_CHECK_DEVICE (cuda), GPU_CHECK_TINY (0),
# GPU_CHECK_BUDGET_S (360: wall-clock budget of all steps; step 4 gets what is left),
# GPU_CHECK_STEPS (1,2,3,4,5: rerun a subset), GPU_CHECK_PY (python3; .venv/bin/python on a CPU),
# GPU_CHECK_PRESETS (step 4's presets, in priority order), GPU_CHECK_RUNS (step 2's rows instead of the full
# list, each model:K:implementation[:strategy[:precision]], e.g. "unet-0.8m:1:engine:auto:bf16"),
# GPU_CHECK_STEP2_S (190: step 2's time box), GPU_CHECK_UNETS (step 3's models, default 16m,35m,80m).
# Dependencies: when pydantic/opacus/dp_accounting/prv_accountant do not import, the wheels in .whl/
# are installed into /tmp/site (no network needed) and PYTHONPATH=/tmp/site:$PWD.

set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TINY=${GPU_CHECK_TINY:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-360}
STEPS=${GPU_CHECK_STEPS:-1,2,3,4,5}
OUT=${OUT:-experiments/out/gpu_check}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
. "$(dirname "$0")/gpu_env.sh"  # TAG and PY
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
exec > >(tee -a "$OUT/log.txt") 2>&1
SUMMARY="$WORK/summary.tsv"
: > "$SUMMARY"

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - $(elapsed))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
wants() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
say() { echo "[gpu_check +$(elapsed)s] $*"; }

# run_step NAME SECONDS COMMAND...: time-boxed (the whole process group), status into the summary.
run_step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    if [ "$limit" -lt 10 ]; then
        say "SKIP $name: only ${limit}s of the budget left"
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$SUMMARY"
        return 0
    fi
    say "START $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    say "END $name rc=$rc in $(($(date +%s) - t0))s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" >> "$SUMMARY"
    return 0
}

say "dpsynth gpu_check: device=$DEVICE tiny=$TINY budget=${BUDGET}s steps=$STEPS out=$OUT python=$PY"
say "git: $(git rev-parse --short HEAD 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l) paths modified/untracked)"

# -- dependencies ------------------------------------------------------------------------------------
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pydantic, opacus, dp_accounting, prv_accountant" 2>/dev/null; then
    say "installing .whl/*.whl into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH || { say "FATAL: wheel install failed"; exit 1; }
fi
say "PYTHONPATH=$PYTHONPATH"

# -- 1. machine and versions -------------------------------------------------------------------------
if wants 1; then
    run_step nvidia-smi 20 nvidia-smi
    run_step versions 60 "$PY" - <<'EOF'
import importlib, os, platform, sys, time
import torch
print("python", sys.version.replace("\n", " "), platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
      "cpu threads", torch.get_num_threads(), "cpus", os.cpu_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm {p.major}.{p.minor}", p.multi_processor_count, "SMs")
    t0 = time.perf_counter(); x = torch.randn(8192, 8192, device="cuda"); (x @ x).sum().item()
    torch.cuda.synchronize(); t1 = time.perf_counter(); (x @ x).sum().item(); torch.cuda.synchronize()
    print(f"cuda smoke: first matmul {t1 - t0:.3f} s, second {time.perf_counter() - t1:.4f} s (8192^2 fp32)")
for name in ("numpy", "scipy", "pydantic", "pydantic_core", "opacus", "dp_accounting", "prv_accountant", "yaml",
             "tqdm", "PIL", "matplotlib", "safetensors", "sklearn", "attrs", "tree", "typing_extensions"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')} {getattr(module, '__file__', '')}")
    except Exception as exc:
        print(f"  {name} FAILED: {type(exc).__name__}: {exc}")
try:
    import dpsynth.methods  # registers every method: catches a module that does not import
    print("dpsynth", dpsynth.__file__, "methods", sorted(dpsynth.methods.METHODS))
except Exception as exc:
    print(f"dpsynth.methods FAILED: {type(exc).__name__}: {exc}")
EOF
fi

# -- 5. the clip bound on the device: one near-cancelling record, every strategy and layer form ---------------
if wants 5; then
    if [ "$DEVICE" = cpu ]; then SELECT="cpu or tf32"; else SELECT="cuda or tf32"; fi
    if "$PY" -c "import pytest" 2>/dev/null; then
        # rc 5 (nothing collected) means torch saw no CUDA device: the CUDA cases exist only where it does
        run_step near-cancelling-record 150 "$PY" -m pytest -q -p no:cacheprovider tests/dpsgd/test_tap_safety.py \
            -k "$SELECT"
    else
        run_step near-cancelling-record 150 "$PY" - "$DEVICE" <<'EOF'
import sys, types
# pytest is not installed here: a stand-in for the decorators the test module applies at import
sys.modules["pytest"] = types.SimpleNamespace(mark=types.SimpleNamespace(parametrize=lambda *a, **k: (lambda f: f)))
sys.path[:0] = ["tests", "tests/dpsgd"]
import torch
import test_tap_safety as t
device = sys.argv[1]
assert device == "cpu" or torch.cuda.is_available(), "no CUDA device"
failed = 0
for form in t.LAYER_FORMS:
    for strategy in t.STRATEGIES:
        try:
            t.check_near_cancelling_record(form, strategy, device)
            print(f"PASS {form} {strategy} {device}")
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {form} {strategy} {device}: {exc}")
print(f"{failed} failed")
sys.exit(1 if failed else 0)
EOF
    fi
fi

# -- background: privacy plans of the step-4 presets (CPU only, no data read) --------------------------
if [ "$TINY" = 1 ]; then
    PRESETS=${GPU_CHECK_PRESETS:-dpdm/cifar10_eps10,pdp-diffusion/mnist_eps10}
else
    PRESETS=${GPU_CHECK_PRESETS:-dpdm/cifar10_eps10,pdp-diffusion/cifar10_eps10,pdp-diffusion/mnist_eps10,privimage/cifar10_eps10}
fi
DRY_PID=
if wants 4; then
    mkdir -p "$WORK/dry"
    OMP_NUM_THREADS=2 CUDA_VISIBLE_DEVICES= timeout -k 5 240 nice -n 10 "$PY" experiments/paper_scale_steps.py dry-runs \
        --presets "$PRESETS" --out "$WORK/dry" --timeout 110 > "$WORK/dry.log" 2>&1 &
    DRY_PID=$!
    say "dry-runs of $PRESETS started in the background (pid $DRY_PID)"
fi

# -- 2. engine benchmark: experiments/dpsgd_step.py, one run per row (a time limit costs only that row) -----------
if wants 2; then
    STEP2_END=$(($(elapsed) + $(min "${GPU_CHECK_STEP2_S:-190}" "$(left)")))
    if [ "$TINY" = 1 ]; then
        RUNS="cnn:1:non-private cnn:1:engine:instantiate cnn:4:engine"
        REPS="--reps 1 --warmup 0 --threads 1"
        ROW_TIMEOUT=120
    else
        RUNS=
        for model in cnn unet-0.8m unet-6m; do
            for k in 1 4; do
                for impl in non-private engine opacus-hooks opacus-ghost opacus-functorch torch-func; do
                    # opacus-ghost at K > 1 is n/a (it cannot average K copies before clipping): not run
                    [ "$k" != 1 ] && [ "$impl" = opacus-ghost ] && continue
                    RUNS="$RUNS $model:$k:$impl"
                done
            done
        done
        # last (the first rows cut by the step's limit): the engine's other strategies on the largest model,
        # a check of the `auto` cost model (tuned on CPUs) on a GPU. Not ghost at K=4: its Grams over K x H x W
        # positions per example made even the CNN at K=4 run past 120 s on a CPU.
        RUNS="$RUNS unet-6m:1:engine:ghost unet-6m:1:engine:instantiate unet-6m:4:engine:instantiate"
        REPS="--reps 20 --warmup 3 --threads 4"
        ROW_TIMEOUT=40
    fi
    RUNS=${GPU_CHECK_RUNS:-$RUNS}
    for run in $RUNS; do
        IFS=: read -r model k impl strategy precision <<< "$run"
        strategy=${strategy:-auto}
        precision=${precision:-fp32}
        limit=$(min $((ROW_TIMEOUT + 15)) $((STEP2_END - $(elapsed))))
        # shellcheck disable=SC2086
        run_step "dpsgd_step $model K=$k $impl $strategy $precision" "$limit" sh -c "\"$PY\" experiments/dpsgd_step.py \
            --device $DEVICE --models $model --k $k --implementations $impl --strategy $strategy $REPS \
            --precision $precision --timeout $ROW_TIMEOUT --json \
            > \"$WORK/dpsgd_${model}_k${k}_${impl}_${strategy}_$precision.json\""
    done
    run_step "dpsgd_step merge" 30 "$PY" - "$WORK" "$OUT/dpsgd_step_$TAG.json" "$DEVICE" <<'EOF'
import glob, json, os, sys, time
sys.path.insert(0, "experiments")
from dpsgd_step import IMPLEMENTATIONS, add_ratios, print_table
work, target, device = sys.argv[1:4]
rows, parts = [], {}
for path in sorted(glob.glob(os.path.join(work, "dpsgd_*.json"))):
    name = os.path.basename(path)
    try:
        part = json.loads(open(path).read().strip().splitlines()[-1])
        rows.extend(part)
        parts[name] = len(part)
    except Exception as exc:
        parts[name] = f"no result: {type(exc).__name__}: {exc}"
order = {name: i for i, name in enumerate(("cnn", "unet-0.8m", "unet-6m"))}
rows.sort(key=lambda r: (order.get(r["model"], 9), r["k"], IMPLEMENTATIONS.index(r["implementation"]), r["strategy"] != "auto"))
for row in rows:  # ratios across the separate runs of one (model, K)
    for key in ("vs_non_private", "memory_vs_non_private", "heap_vs_non_private", "vs_opacus_best", "opacus_best"):
        row.pop(key, None)
add_ratios(rows)
for row in rows:
    base = next((r for r in rows if r["model"] == row["model"] and r["k"] == row["k"]
                 and r["implementation"] == "non-private" and "cuda_peak_mib" in r), None)
    if base and "cuda_peak_mib" in row:
        row["cuda_memory_vs_non_private"] = row["cuda_peak_mib"] / base["cuda_peak_mib"]
meta = {"device": device, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "parts": parts,
        "note": "one dpsgd_step.py run per row, ratios recomputed across the rows of one (model, K); times are "
                "CUDA-synchronised wall seconds on a GPU, process CPU seconds on a CPU; cuda_peak_mib = "
                "torch.cuda.max_memory_allocated over the timed steps, peak_mib = process ru_maxrss; opacus-ghost "
                "is not run at K > 1 (n/a: it cannot average K copies before clipping)"}
try:
    import torch
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    meta["torch"] = torch.__version__
except Exception:
    pass
json.dump({"meta": meta, "rows": rows}, open(target, "w"), indent=1)
print(f"{len(rows)} rows -> {target}")
print_table(rows)
for r in rows:
    if "cuda_peak_mib" in r:
        print(f"  {r['model']:10} K={r['k']} {r['implementation']:17} cuda peak {r['cuda_peak_mib']:8.0f} MiB"
              f"  x{r.get('cuda_memory_vs_non_private') or float('nan'):.2f} non-private", file=sys.stderr)
    elif "stderr_tail" in r:
        print(f"  {r['model']:10} K={r['k']} {r['implementation']:17} stderr tail:\n{r['stderr_tail']}", file=sys.stderr)
EOF
fi

# -- 3. large-UNet stand-ins: non-private vs engine at 32x32x3, batch 32, K=1 ---------------------------
if wants 3; then
    limit=$(min 90 "$(left)")
    TINYFLAG=; MODELS=${GPU_CHECK_UNETS:-16m,35m,80m}
    [ "$TINY" = 1 ] && TINYFLAG=--tiny && MODELS=35m
    # shellcheck disable=SC2086
    run_step large-unet "$((limit + 20))" "$PY" experiments/paper_scale_steps.py large-unet --device "$DEVICE" \
        --models $MODELS --batch 32 --reps 5 --budget-s "$limit" --case-budget-s 45 $TINYFLAG \
        --json "$OUT/large_unet_$TAG.json"
fi

# -- 4. paper-scale presets (time permitting) ----------------------------------------------------------
if wants 4; then
    limit=$(($(left) - 15))
    TINYFLAG=; [ "$TINY" = 1 ] && TINYFLAG=--tiny
    if [ "$limit" -lt 60 ]; then
        say "SKIP paper-scale presets: ${limit}s left"
        printf 'paper-scale\tskipped\t0\t%s\n' "$limit" >> "$SUMMARY"
    else
        # shellcheck disable=SC2086
        run_step paper-scale "$((limit + 10))" "$PY" experiments/paper_scale_steps.py presets --device "$DEVICE" \
            --presets "$PRESETS" --budget-s "$limit" --case-budget-s 80 --micro 3 --full-steps 2 \
            --full-budget-s 30 --dry-run-dir "$WORK/dry" --wait-dry-run-s "$([ "$TINY" = 1 ] && echo 5 || echo 20)" $TINYFLAG \
            --json "$OUT/paper_scale_$TAG.json"
    fi
    if [ -n "$DRY_PID" ]; then
        kill "$DRY_PID" 2>/dev/null
        wait "$DRY_PID" 2>/dev/null
        say "dry-run log:"
        sed 's/^/    /' "$WORK/dry.log"
    fi
fi

# -- summary (also the tail of stdout: the key numbers without opening the files) ----------------------
command -v nvidia-smi > /dev/null && timeout 10 nvidia-smi --query-gpu=name,memory.used,memory.total,temperature.gpu,clocks.sm --format=csv
timeout 60 "$PY" - "$SUMMARY" "$OUT" "$TAG" "$(elapsed)" "$BUDGET" "$DEVICE" "$TINY" <<'EOF'
import json, os, sys
summary, out, tag, total, budget, device, tiny = sys.argv[1:8]
steps = []
for line in open(summary):
    name, rc, seconds, limit = line.rstrip("\n").split("\t")
    steps.append({"step": name, "rc": rc if rc == "skipped" else int(rc), "seconds": int(seconds), "limit_s": int(limit)})
json.dump({"device": device, "tiny": tiny == "1", "total_s": int(total), "budget_s": int(budget), "steps": steps},
          open(os.path.join(out, "summary.json"), "w"), indent=1)
failed = [s for s in steps if s["rc"] not in (0, "skipped")]
print(f"==== RESULTS ({device}, {total}s of {budget}s; {len(steps)} steps, {len(failed)} not rc=0: "
      + ", ".join(f"{s['step']} rc={s['rc']}" for s in failed) + ")")

def load(name):
    try:
        return json.load(open(os.path.join(out, f"{name}_{tag}.json")))
    except Exception as exc:
        print(f"{name}: no file ({type(exc).__name__})")
        return None

def mem(r):
    return f"{r['cuda_peak_mib']:.0f} MiB" if "cuda_peak_mib" in r else f"{r.get('rss_peak_mib', r.get('peak_mib', 0)):.0f} MiB rss"

data = load("dpsgd_step")
if data:
    print("dpsgd_step (ms per step, x non-private, peak):")
    for r in data["rows"]:
        name = f"{r['model']} K={r['k']} {r['implementation']}" + (f" ({r['strategy']})" if r["strategy"] not in ("-", "auto") else "")
        name += f" {r['precision']}" if r.get("precision", "fp32") != "fp32" else ""
        if "error" in r:
            print(f"  {name:34} ERROR {r['error'][:150]}")
        else:
            x = r.get("vs_non_private")
            print(f"  {name:34} {r['median_s'] * 1e3:9.2f} ms  x{x if x is not None else float('nan'):5.2f}  {mem(r)}")
for name in ("large_unet", "paper_scale"):
    data = load(name)
    if not data:
        continue
    print(f"{name}:")
    for r in data["cases"]:
        head = f"  {r.get('name')} [physical {r.get('physical')}, {r.get('parameters', 0) / 1e6:.1f}M]"
        if "error" in r and "per_micro" not in r:
            print(f"{head} ERROR {r['error'][:200]}")
            continue
        np_row = r.get("non_private") or {}
        bits = []
        if "median_s" in np_row:
            bits.append(f"non-private {np_row['median_s']:.4f} s ({np_row['images_per_step']} img) {mem(np_row)}")
        elif np_row:
            bits.append(f"non-private ERROR {np_row.get('error', '')[:80]}")
        if "per_micro" in r:
            m = r["per_micro"]
            bits.append(f"engine micro {m['compute_s']:.4f}+{m['build_s']:.4f} s x{r['n_micro_full']}"
                        f" +{m['overhead_s']:.3f}+probe {m['probe_s']:.3f} -> step {r['projected_full_step_s']:.2f} s")
        if "engine_full" in r:
            bits.append(f"full {r['engine_full']['median_s']:.3f} s {mem(r['engine_full'])}")
        elif "engine_partial" in r:
            bits.append(f"partial peak {mem(r['engine_partial'])}")
        if r.get("projected_dp_training_hours") is not None:
            bits.append(f"{r['dp_steps']} steps -> {r['projected_dp_training_hours']:.3g} h")
        if "error" in r:
            bits.append(f"ERROR {r['error'][:120]}")
        print(head + " " + "; ".join(bits))
EOF
say "done in $(elapsed)s; files in $OUT:"
ls -la "$OUT"
rm -rf "$WORK"
