"""DPPM end to end: DP-SGD mode (sound), the paper's randomized-response mode (guarantee "none"), the opt-in
rule, the typed config, the label embedding, resume and `dpsynth generate` on a finished run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpsynth.api import Synthesizer
from dpsynth.config import load_config, resolve_config
from dpsynth.diffusion.label_rows import embed_labels, label_embedding_matrix, split_embedding
from dpsynth.errors import ConfigError
from dpsynth.methods import get_method
from dpsynth.methods.dppm import DPPMConfig
from dpsynth.runner import make_ledger, run_config
from dpsynth.testing import MethodContractTests

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "dpsynth" / "presets" / "dppm"
SMOKE = PRESETS / "smoke.yaml"
PAPER_MODE = [
    "dppm.privacy.mechanism=randomized-response",
    "dppm.privacy.allow_unsound_randomized_response=true",
    "dppm.training.objective=ssm",
    "dppm.training.steps=3",
    "generate.num=20",
    "generate.batch_size=20",
]


def _privacy(run_dir: Path) -> dict:
    return json.loads((run_dir / "privacy.json").read_text())


#: the DP-SGD run's samples: 20 images are enough for the tests that read them (sampling is a third of the run)
DPSGD_SAMPLES = ["generate.num=20", "generate.batch_size=20"]


@pytest.fixture(scope="module")
def dpsgd_run(tmp_path_factory) -> Path:
    return run_config(SMOKE, DPSGD_SAMPLES, out=tmp_path_factory.mktemp("dppm") / "dpsgd", echo=False)


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory) -> Path:
    return run_config(SMOKE, PAPER_MODE, out=tmp_path_factory.mktemp("dppm") / "paper", echo=False)


def test_dpsgd_mode_is_dp_within_the_target_and_names_the_unsound_claim(dpsgd_run):
    privacy = _privacy(dpsgd_run)
    assert privacy["guarantee"] == "dp"
    assert 5.0 < privacy["epsilon"] <= privacy["target_epsilon"] == 10.0
    assert {m["name"]: m["steps"] for m in privacy["mechanisms"]} == {"dpsgd": 6}
    assert any("does not hold" in note and "DP-SGD" in note for note in privacy["notes"])


def test_dpsgd_mode_spends_exactly_its_privacy_plan(dpsgd_run):
    from dpsynth.context import load_private_splits

    loaded = len(load_private_splits(load_config(SMOKE)).train)  # the N the run planned on
    plan = get_method("dppm")().plan(load_config(SMOKE), loaded)
    assert plan.calibrated == ("dpsgd",) and plan.target_epsilon == 10.0
    (planned,) = plan.mechanisms
    (spent,) = _privacy(dpsgd_run)["mechanisms"]
    assert spent["name"] == planned.name and spent["steps"] == planned.steps == 6
    assert spent["sample_rate"] == pytest.approx(planned.sample_rate)
    assert spent["noise_multiplier"] == pytest.approx(planned.noise_multiplier, rel=1e-9)
    assert _privacy(dpsgd_run)["epsilon"] == pytest.approx(plan.epsilon(), abs=1e-9)


def test_dpsgd_mode_writes_labelled_uint8_samples(dpsgd_run):
    with np.load(dpsgd_run / "samples.npz") as samples:
        images, labels = samples["images"], samples["labels"]
    assert images.shape == (20, 28, 28, 1) and images.dtype == np.uint8
    assert labels.min() >= 0 and labels.max() < 10
    assert images.std() > 0
    assert (dpsgd_run / "samples.png").is_file() and (dpsgd_run / "report.html").is_file()


def test_paper_mode_claims_no_epsilon_anywhere(paper_run):
    privacy = _privacy(paper_run)
    assert privacy["guarantee"] == "none"
    assert privacy["epsilon"] is None and privacy["target_epsilon"] is None
    assert any("NO differential privacy guarantee" in note for note in privacy["notes"])
    responses = [m for m in privacy["mechanisms"] if m["name"] == "randomized-response"]
    assert len(responses) == 1 and responses[0]["steps"] == 3  # listed for transparency, one per step
    assert "NO PRIVACY GUARANTEE" in (paper_run / "report.html").read_text()
    assert "eps=none (no guarantee)" in (paper_run / "log.txt").read_text()
    plan = get_method("dppm")().plan(load_config(SMOKE, PAPER_MODE), 300)
    assert plan.target_epsilon is None and plan.epsilon() is None  # the plan claims no ε either
    (planned,) = plan.mechanisms
    assert (planned.name, planned.count) == (responses[0]["name"], responses[0]["steps"])


def test_generate_and_resume_work_on_a_paper_mode_run(paper_run, tmp_path):
    path = Synthesizer.load(paper_run).generate(10, tmp_path / "more.npz")
    with np.load(path) as samples:
        assert samples["images"].shape == (10, 28, 28, 1)
    before = _privacy(paper_run)["mechanisms"]
    run_config(SMOKE, PAPER_MODE, out=paper_run, resume=True, echo=False)  # training already complete
    assert _privacy(paper_run)["mechanisms"] == before  # nothing retrained, nothing counted twice


def test_a_paper_mode_run_killed_between_ledger_and_checkpoint_resumes_at_the_ledger_and_ends_on_its_plan(tmp_path):
    from dpsynth.checkpoint import CheckpointManager

    overrides = [o for o in PAPER_MODE if ".steps=" not in o] + [
        "dppm.training.steps=5",
        "dppm.training.checkpoint_every=2",
    ]
    save, saves = CheckpointManager.save, []

    def die_after_the_ledger(manager, state, phase="main"):
        if phase == "randomized-response":
            saves.append(state["step"])
            if len(saves) == 2:  # step 4: the ledger is written, then the process dies before the checkpoint file
                manager.store.persist()
                raise KeyboardInterrupt
        save(manager, state, phase=phase)

    run_dir = tmp_path / "killed"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointManager, "save", die_after_the_ledger)
        with pytest.raises(KeyboardInterrupt):
            run_config(SMOKE, overrides, out=run_dir, echo=False)
    killed = [m["steps"] for m in _privacy(run_dir)["mechanisms"] if m["name"] == "randomized-response"]
    assert killed == [4]  # the stored ledger holds the 4 charged steps
    assert CheckpointManager(run_dir / "checkpoints").load("randomized-response")["step"] == 2  # ledger ahead

    run_config(SMOKE, overrides, out=run_dir, resume=True, echo=False)
    (responses,) = [m for m in _privacy(run_dir)["mechanisms"] if m["name"] == "randomized-response"]
    assert responses["steps"] == 5  # the 2 releases past the checkpoint stay spent, none is repeated
    assert "randomized-response: resumed at release 4" in (run_dir / "log.txt").read_text()
    assert CheckpointManager(run_dir / "checkpoints").load("randomized-response")["step"] == 5


def test_evaluate_and_report_on_a_paper_mode_run_claim_no_epsilon(paper_run):
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.report.html import write_report

    before = _privacy(paper_run)
    metrics = evaluate(paper_run, ["accuracy"], models=["logreg"], seeds=1, protocol={"epochs": 1, "max_steps": 3})
    assert 0 <= metrics["accuracy"]["logreg"]["mean"] <= 100
    assert (paper_run / "diagnostics" / "metrics.json").is_file()
    assert _privacy(paper_run) == before  # a synthetic-selection evaluation charges nothing
    release = Path(write_report(paper_run, release=True)).read_text()
    assert "NO PRIVACY GUARANTEE" in release and "-differential privacy" not in release


@pytest.mark.parametrize("mode", ["dpsgd_run", "paper_run"])
def test_the_loss_attack_scores_the_released_score_model_in_both_modes(mode, request):
    from dpsynth.eval.audit import audit_run

    report = audit_run(request.getfixturevalue(mode), max_examples=20, write=False)
    loss = report["membership_inference"]["loss"]
    assert 0.0 <= loss["auc"] <= 1.0 and "loss" not in report["skipped"]


@pytest.mark.parametrize("mode", ["dpsgd_run", "paper_run"])
def test_the_method_canary_audit_retrains_with_canaries_and_leaves_the_run_alone(mode, request):
    from dpsynth.eval.run_canary import RUN_CANARY_DIR, run_canary_audit

    run_dir = request.getfixturevalue(mode)
    before = _privacy(run_dir)
    result = run_canary_audit(run_dir, num_canaries=20, inclusion_seed=0)
    audit_privacy = _privacy(run_dir / "diagnostics" / RUN_CANARY_DIR)
    assert _privacy(run_dir) == before  # the audit training has its own ledger
    assert (result["num_canaries"], result["num_guesses"]) == (20, 4)
    assert 0 <= result["num_correct"] <= 4 and result["epsilon_lower_bound"] >= 0
    if mode == "paper_run":
        assert result["guarantee"] == "none" and result["claimed_epsilon"] is None
        assert audit_privacy["guarantee"] == "none" and audit_privacy.get("epsilon") is None
    else:
        assert result["guarantee"] == "dp" and 0 < result["claimed_epsilon"] <= before["target_epsilon"]


def test_paper_mode_without_the_opt_in_is_a_one_line_config_error(tmp_path, monkeypatch):
    def no_private_reads(config):
        raise AssertionError("private data was read before the config was validated")

    monkeypatch.setattr("dpsynth.runner.load_run_data", no_private_reads)
    overrides = [o for o in PAPER_MODE if "allow_unsound" not in o]
    with pytest.raises(ConfigError, match="allow_unsound_randomized_response") as error:
        run_config(SMOKE, overrides, out=tmp_path / "refused", echo=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "refused").exists()  # refused before any private read or run directory


def test_paper_mode_via_the_cli_without_opt_in_prints_one_error_line(cli, tmp_path):
    from conftest import assert_one_line_error

    result = cli(
        "run",
        str(SMOKE),
        "--out",
        str(tmp_path / "cli"),
        "--set",
        "dppm.privacy.mechanism=randomized-response",
        "--set",
        "dppm.training.objective=ssm",
    )
    assert_one_line_error(result, "NO differential privacy guarantee")


def test_paper_mode_dry_run_prints_the_plan_and_says_no_guarantee(cli, tmp_path):
    overrides = [arg for override in PAPER_MODE[:4] for arg in ("--set", override)]
    result = cli("run", str(SMOKE), "--dry-run", *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "NO DIFFERENTIAL PRIVACY GUARANTEE" in result.stdout and "none claimed" in result.stdout
    assert "randomized-response" in result.stdout.split("privacy plan")[-1]
    assert not list(tmp_path.iterdir()), "a dry run creates no run directory"


def test_paper_mode_plan_refuses_a_batch_larger_than_the_train_set():
    config = load_config(SMOKE, [*PAPER_MODE, "dppm.training.batch_size=400"])
    with pytest.raises(ConfigError, match=r"'dppm\.training\.batch_size' = 400: .* at most the private train size 300"):
        get_method("dppm")().plan(config, 300)


RR_ON = ["dppm.privacy.mechanism=randomized-response", "dppm.privacy.allow_unsound_randomized_response=true"]


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["dppm.privacy.mechanism=randomized-response"], "'dppm.privacy.mechanism' = 'randomized-response'"),
        (RR_ON, "'dppm.training.objective' = 'dsm'"),
        ([*RR_ON, "dppm.training.objective=ssm", "dppm.training.noise_multiplier=2"], "noise_multiplier' = 2"),
        ([*RR_ON, "dppm.training.objective=ssm", "dppm.training.multiplicity=4"], "multiplicity' = 4"),
        ([*RR_ON, "dppm.training.objective=ssm", "dppm.training.batch_size=4"], "batch_size' = 4"),
        (["dppm.training.steps=null", "dppm.training.epochs=null"], "'dppm.training': set one of 'steps' and 'epochs'"),
        (["dppm.noise.sigma_min=3"], "'dppm.noise.sigma_min' = 3: expected a value below noise.sigma_max"),
        (["dppm.sampler.kind=euler"], "'dppm.sampler.kind' = 'euler'"),
    ],
)
def test_every_rule_is_a_one_line_error_at_load_before_any_data_read(overrides, fragment, monkeypatch):
    monkeypatch.setattr("dpsynth.runner.load_run_data", lambda config: pytest.fail("data was read"))
    with pytest.raises(ConfigError) as error:
        load_config(SMOKE, overrides)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "section,fragment",
    [
        ({"privacy": {"mechanism": "randomized-response", "allow_unsound_randomized_response": True}}, "objective ssm"),
        ({"privacy": {"mechanism": "laplace"}}, "privacy.mechanism"),
        ({"training": {"lr": 0}}, "training.lr"),
        ({"sampler": {"kinetic": "laplace"}}, "sampler.kinetic"),
        ({"noise": {"sigma_max": 0.01, "sigma_min": 0.1}}, "sigma_min"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_schema_rejects_bad_sections_in_one_line(section, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        resolve_config({"method": "dppm", "dppm": section})


def test_defaults_are_the_schema_and_the_ledger_follows_the_mode():
    method = get_method("dppm")
    assert method.config_schema is DPPMConfig and method.defaults == DPPMConfig().model_dump()
    config = load_config(SMOKE)
    assert make_ledger(config).guarantee == "dp"
    paper = load_config(SMOKE, PAPER_MODE)
    ledger = make_ledger(paper)
    assert ledger.guarantee == "none" and ledger.target_epsilon is None and ledger.epsilon() is None


def test_label_embedding_round_trips_images_and_labels():
    matrix = label_embedding_matrix(10, 28)
    assert len({tuple(row) for row in matrix.tolist()}) == 10
    images = torch.rand(20, 3, 28, 28) * 2 - 1
    labels = torch.arange(20) % 10
    u = embed_labels(images, labels, matrix)
    assert u.shape == (20, 3, 29, 28)
    _, recovered_labels = split_embedding(u + 0.3 * torch.randn_like(u), matrix)
    assert torch.equal(split_embedding(u, matrix)[0], images)
    assert torch.equal(recovered_labels, labels)  # nearest row survives moderate noise
    assert torch.equal(label_embedding_matrix(10, 28), matrix)  # fixed, public, run-independent


def test_presets_load():
    for path in sorted(PRESETS.glob("*.yaml")):
        config = load_config(path)
        assert isinstance(config.section, DPPMConfig)
        assert yaml.safe_load(path.read_text())["method"] == "dppm"


class TestDPPMContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dppm/smoke`` preset."""

    method = "dppm"
