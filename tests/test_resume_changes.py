"""--resume: only the evaluation settings may differ from the stored run; anything else is refused."""

from __future__ import annotations

import pytest
import yaml

from dpsynth.errors import ConfigError
from dpsynth.runner import run_config

SMOKE = "dpsgd-classifier/smoke"


def test_resume_accepts_new_evaluation_settings_and_refuses_any_other_change(tmp_path):
    run_dir = run_config(SMOKE, out=tmp_path / "run", echo=False)
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    seeds = int(stored["evaluate"]["seeds"] or 1) + 1
    run_config(SMOKE, [f"evaluate.seeds={seeds}"], out=run_dir, resume=True, echo=False)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["evaluate"]["seeds"] == seeds
    with pytest.raises(ConfigError, match=r"differs from the stored run at seed$"):
        run_config(SMOKE, [f"evaluate.seeds={seeds}", "seed=7"], out=run_dir, resume=True, echo=False)
