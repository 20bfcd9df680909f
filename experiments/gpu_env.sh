# Sourced by the GPU scripts (gpu_check.sh, gpu_engine_v4.sh) after they set DEVICE and TINY: sets TAG, the
# machine's name in result file names (h100, h200, gpu, or cpu; "-tiny" for tiny runs), and PY, the interpreter
# (GPU_CHECK_PY, else the project's .venv on a CPU, else python3).
if [ "$DEVICE" = cpu ]; then
    TAG=cpu
else
    case "$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
        *H200*) TAG=h200 ;;
        *H100*) TAG=h100 ;;
        *) TAG=gpu ;;
    esac
fi
if [ "$TINY" = 1 ]; then TAG="$TAG-tiny"; fi
if [ -n "${GPU_CHECK_PY:-}" ]; then
    PY=$GPU_CHECK_PY
elif [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
