"""One run pipeline: ``dpsynth run`` (the runner), ``Synthesizer.fit`` (the API) and the canary audit's
retraining all train through :func:`dpsynth.context.train_run`, and the first two give the same ledger."""

from __future__ import annotations

import json

import dpsynth.context
import dpsynth.runner
from dpsynth.api import Synthesizer
from dpsynth.config import find_config
from dpsynth.eval.run_canary import run_canary_audit
from dpsynth.runner import run_config

SMOKE = find_config("dpsgd-classifier/smoke")


def test_runner_api_and_canary_audit_share_one_training_function(tmp_path, monkeypatch):
    calls = []
    real = dpsynth.context.train_run

    def spy(method, ctx, store):
        real(method, ctx, store)
        calls.append((type(method), ctx.config.to_dict(), ctx.ledger.state_dict()))

    monkeypatch.setattr(dpsynth.context, "train_run", spy)
    monkeypatch.setattr(dpsynth.runner, "train_run", spy)

    by_runner = run_config(SMOKE, out=tmp_path / "runner", echo=False)
    by_api = Synthesizer.from_config(SMOKE).fit(out=tmp_path / "api").run_dir
    run_canary_audit(by_runner, num_canaries=20, inclusion_seed=0)

    assert len(calls) == 3, "each path trained through train_run exactly once"
    (runner_method, runner_config, runner_ledger), (api_method, api_config, api_ledger), canary = calls
    assert runner_method is api_method is canary[0]
    assert runner_config == api_config == canary[1], "the same resolved config reached the method"
    assert runner_ledger == api_ledger, "the runner and the API spend the same ledger"
    for run_dir in (by_runner, by_api):
        assert json.loads((run_dir / "ledger.json").read_text())["mechanisms"] == runner_ledger["mechanisms"]
    # the audit retrains on the train split plus its canaries (another N, so another sample rate), through
    # the same mechanism of the same method
    assert [m["name"] for m in canary[2]["mechanisms"]] == [m["name"] for m in runner_ledger["mechanisms"]]
