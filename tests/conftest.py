import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "2")


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m dpsynth ARGS`` in a subprocess, as a user would."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # OMP_NUM_THREADS: set above, or by make test
    return subprocess.run(
        [sys.executable, "-m", "dpsynth", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli_in_process(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``dpsynth ARGS`` through :func:`dpsynth.cli.main` in this process, with stdout and stderr captured: what
    :func:`run_cli` returns, without a new interpreter importing torch for every call (seconds each). With a
    ``cwd`` it runs in a subprocess, as the working directory is process-wide. An exception that ``main``
    does not turn into an error line fails with exit status 1 and its traceback on stderr, as the process would.
    """
    import contextlib
    import io
    import traceback
    import warnings

    import torch

    from dpsynth.cli import main

    if cwd is not None:
        return run_cli(*args, cwd=cwd, timeout=timeout)
    stdout, stderr = io.StringIO(), io.StringIO()
    threads, showwarning = torch.get_num_threads(), warnings.showwarning
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            torch.set_num_threads(threads)
            warnings.showwarning = showwarning
    return subprocess.CompletedProcess(["dpsynth", *args], code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture
def cli():
    """The command line in this process (:func:`run_cli_in_process`); tests of the process itself (the entry
    point, an installed wheel, a working directory) call :func:`run_cli`."""
    return run_cli_in_process


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


# A tiny UNet config and a random re-initialisation (the real init zeroes the output layers, so a
# fresh model predicts zeros), shared by the diffusion-layer tests.
TINY_UNET = {
    "base_channels": 8,
    "channel_mult": (1, 2),
    "num_res_blocks": 1,
    "attention_levels": (1,),
    "num_head_channels": 8,
    "max_groups": 4,
}


def randomize(model, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def interrupt_after_steps(config_path, out, stop_after: int, overrides=None) -> None:
    """Run ``config_path`` until ``stop_after`` DP-SGD steps were taken, then raise KeyboardInterrupt
    mid-run, as a user's Ctrl-C would (the caller expects it)."""
    from dpsynth import dpsgd
    from dpsynth.runner import run_config

    original = dpsgd.DPSGDEngine.step
    calls = {"n": 0}

    def step(self, batch, *args, **kwargs):
        if calls["n"] == stop_after:
            raise KeyboardInterrupt
        calls["n"] += 1
        return original(self, batch, *args, **kwargs)

    dpsgd.DPSGDEngine.step = step
    try:
        run_config(config_path, overrides, out=out, echo=False)
    finally:
        dpsgd.DPSGDEngine.step = original


def pytest_collection_modifyitems(config, items):
    """Tests in an xdist group (tests/test_pip_install.py: minutes, most of them pip's) run first, so that under
    `make test` one worker starts them at once and the other workers take the rest of the suite beside them."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: the rest keep their order
