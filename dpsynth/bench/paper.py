"""Paper-scale presets and the dry run's GPU estimate of a suite's cells (``dpsynth bench paper-gpu --dry-run``).

A packaged preset is *paper-scale* unless it is a smoke test, an auto-scaled config, a CPU-sized
``mnist10k_*`` run or the demo: those are the presets a GPU is needed for, every one of them in the
``paper-gpu`` suite (tests/bench/test_paper_gpu.py) and in the slow paper-scale test
(tests/test_paper_scale.py, ``make test-slow``).
"""

from __future__ import annotations

from typing import Any

from dpsynth.config import list_presets, load_config
from dpsynth.errors import DPSynthError

#: name prefixes of the presets sized for a CPU or for tests, not for a paper's table
NOT_PAPER_SCALE = ("smoke", "auto", "mnist10k_", "demo")


def is_paper_scale(preset: str) -> bool:
    """Whether ``<method>/<name>`` is a paper-scale preset (see the module doc)."""
    name = preset.rsplit("/", 1)[-1]
    return not name.startswith(NOT_PAPER_SCALE)


def paper_scale_presets() -> list[str]:
    """Every packaged paper-scale preset of the built-in methods, sorted."""
    return [name for name in list_presets() if "/" in name and is_paper_scale(name)]


def cell_estimate(preset: str, overrides: list[str], num_examples: int | None, gpu: str) -> dict[str, Any]:
    """The private-training estimate of one suite cell (:mod:`dpsynth.dpsgd.estimate`), summed over its networks:
    parameters, peak memory per device and hours on ``gpu``; ``unavailable`` says why there is none."""
    from dpsynth.data.sizes import planned_train_size
    from dpsynth.dpsgd.estimate import estimate_run
    from dpsynth.methods import get_method

    try:
        config = load_config(preset, overrides)
        size = num_examples if num_examples is not None else planned_train_size(config.data)
        estimate = estimate_run(get_method(config.method)(), config, size)
    except (DPSynthError, NotImplementedError, RuntimeError) as exc:  # as in the run's dry run (dpsynth.cli)
        return {"unavailable": str(exc).splitlines()[0]}
    if not estimate.networks:
        return {"unavailable": "no network trained with DP-SGD declared"}
    return {
        "parameters": sum(network.parameters for network in estimate.networks),
        "peak_gib": round(estimate.peak_bytes() / 2**30, 2),
        "gpu_hours": float(f"{estimate.gpu_hours(gpu):.3g}"),
        "fits": all(network.fits[gpu] for network in estimate.networks),
        "num_examples": estimate.num_examples,
    }
