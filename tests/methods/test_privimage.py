"""PrivImage end to end (+D and +G smoke runs), the method contract, the typed config, resume and re-use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dpsynth.config import find_config, load_config, resolve_config
from dpsynth.context import open_run
from dpsynth.contract import Method, RunContext, Samples
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods import get_method
from dpsynth.methods.privimage import PrivImageConfig
from dpsynth.models.gan import ConditionalDiscriminator, GANSpec
from dpsynth.privacy import NoiseSource, PrivacyLedger
from dpsynth.runner import run_config
from dpsynth.selection.distribution import gaussian_epsilon
from dpsynth.testing import MethodContractTests

SMOKE_D = find_config("privimage/smoke")
SMOKE_G = find_config("privimage/smoke_gan")
# Even smaller than the smoke configs: seconds per run on a shared CPU.
FAST = [
    "data.max_train=120",
    "data.max_public=400",
    "privimage.selection.classifier_max_steps=8",
    "privimage.selection.classifier_batch_size=64",
    "generate.num=20",
    "generate.batch_size=20",
]
FAST_D = FAST + [
    "privimage.pretrain.steps=3",
    "privimage.steps=2",
    "privimage.batch_size=16",
    "privimage.physical_batch_size=16",
    "privimage.sample_steps=3",
]
FAST_G = FAST + [
    "privimage.gan.pretrain_steps=3",
    "privimage.gan.steps=3",
    "privimage.gan.batch_size=16",
    "privimage.gan.physical_batch_size=16",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DPSYNTH_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _privacy(run: Path) -> dict:
    return json.loads((run / "privacy.json").read_text())


def _check_contract(run: Path, target: float) -> dict:
    with np.load(run / "samples.npz") as samples:
        images, labels = samples["images"], samples["labels"]
    assert images.shape == (20, 28, 28, 1) and images.dtype == np.uint8
    assert np.bincount(labels, minlength=10).tolist() == [2] * 10
    privacy = _privacy(run)
    assert privacy["epsilon"] <= privacy["target_epsilon"] == target
    selection = json.loads((run / "selection.json").read_text())
    assert len(selection["rows"]) == 10 and all(row["selected"] for row in selection["rows"])
    assert 0 < selection["selection_ratio"] < 1 and set(selection["sds"]) == {"full", "selected"}
    assert (run / "figures" / "selection.png").stat().st_size > 1000
    assert "Selection ratio" in (run / "figures" / "selection.txt").read_text()
    return privacy


def test_diffusion_smoke_run_charges_query_and_fine_tuning(cache, tmp_path):
    run = run_config(SMOKE_D, FAST_D, out=tmp_path / "d", echo=False)
    privacy = _check_contract(run, 10.0)
    mechanisms = {m["name"]: m for m in privacy["mechanisms"]}
    assert set(mechanisms) == {"semantic-query", "dp-adam"}
    assert mechanisms["semantic-query"]["steps"] == 1 and mechanisms["dp-adam"]["steps"] == 2
    assert privacy["epsilon"] >= 9.9  # fine-tuning sigma calibrated to what the query left
    assert any("seeds this noise with 0" in note for note in privacy["notes"])
    log = (run / "log.txt").read_text()
    assert "init: names" in log  # the conditional subset carries the private labels


@pytest.fixture(scope="module")
def gan_run(cache, tmp_path_factory) -> Path:
    """One finished GAN smoke run (FAST_G), trained once for the tests that read it."""
    return run_config(SMOKE_G, FAST_G, out=tmp_path_factory.mktemp("gan") / "g", echo=False)


def test_gan_smoke_run_trains_the_discriminator_privately_and_resumes(gan_run, tmp_path):
    import shutil

    run = Path(shutil.copytree(gan_run, tmp_path / "g"))  # a copy: resuming rewrites its files
    privacy = _check_contract(run, 10.0)
    mechanisms = {m["name"]: m for m in privacy["mechanisms"]}
    assert set(mechanisms) == {"semantic-query", "dp-discriminator"}
    assert mechanisms["dp-discriminator"]["steps"] == 3
    run_config(SMOKE_G, FAST_G, out=run, resume=True, echo=False)
    assert _privacy(run)["mechanisms"] == privacy["mechanisms"]  # neither re-queried nor re-trained
    assert "training had finished; released state restored" in (run / "log.txt").read_text()
    ctx, method = open_run(run, echo=False)  # a fresh process: the generator comes from the released state
    samples = method.generate(ctx, 10)
    assert samples.images.shape == (10, 28, 28, 1) and np.bincount(samples.labels).tolist() == [1] * 10


def test_gan_smoke_run_pretrains_and_transfers_the_label_channel_architecture(cache, tmp_path):
    run = run_config(SMOKE_G, FAST_G + ["privimage.gan.architecture=label-channels"], out=tmp_path / "g", echo=False)
    _check_contract(run, 10.0)
    from dpsynth.rundir import LOG_FILE

    assert "GAN pre-training" in (run / LOG_FILE).read_text()


def test_reusing_a_selection_from_another_run_charges_it_again(cache, gan_run, tmp_path):
    first = gan_run
    second = run_config(SMOKE_G, FAST_G + [f"privimage.selection.reuse={first}"], out=tmp_path / "second", echo=False)
    query = {m["name"]: m for m in _privacy(first)["mechanisms"]}["semantic-query"]
    charged = {m["name"]: m for m in _privacy(second)["mechanisms"]}["semantic-query"]
    assert charged["noise_multiplier"] == query["noise_multiplier"] and charged["steps"] == 1
    assert (
        json.loads((second / "selection.json").read_text())["rows"]
        == json.loads((first / "selection.json").read_text())["rows"]
    )
    with pytest.raises(Exception, match="private data"):
        run_config(
            SMOKE_G,
            FAST_G + [f"privimage.selection.reuse={first}", "data.max_train=130"],
            out=tmp_path / "third",
            echo=False,
        )


def test_method_contract_and_typed_config():
    method = get_method("privimage")
    assert issubclass(method, Method) and method.name == "privimage"
    assert method.config_schema is PrivImageConfig
    assert method.defaults == PrivImageConfig().model_dump()
    for name, field in PrivImageConfig.model_fields.items():
        assert field.description, name

    def resolve(section):
        return resolve_config({"method": "privimage", "data": {"public": "glyphs"}, "privimage": section})

    assert resolve({}).section.selection.k == 3
    with pytest.raises(ConfigError, match="privimage.selection.k"):
        resolve({"selection": {"k": 0}})
    with pytest.raises(ConfigError, match="privimage.typo"):
        resolve({"typo": 1})
    with pytest.raises(ConfigError, match="generator"):
        resolve({"generator": "vae"})
    assert isinstance(Samples(np.zeros((1, 2, 2, 1), np.uint8), np.zeros(1)), Samples)


def test_gan_sizes_and_groupnorm_discriminator():
    generator, discriminator = GANSpec(10, 3, 32).build()
    assert 1.7e6 < sum(p.numel() for p in generator.parameters()) < 1.95e6  # ~1.8M at 32x32
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in discriminator.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in discriminator.modules())
    assert isinstance(discriminator, ConditionalDiscriminator)
    images = generator(torch.randn(4, 100), torch.arange(4))
    assert images.shape == (4, 3, 32, 32) and images.abs().max() <= 1
    assert discriminator(images, torch.arange(4)).shape == (4,)


def _plan(preset: Path, overrides: list[str] | None = None, num_examples: int = 300):
    config = load_config(preset, overrides)
    return config, get_method("privimage")().plan(config, num_examples)


def test_plan_holds_the_query_and_the_fine_tuning_calibrated_to_what_is_left():
    config, plan = _plan(SMOKE_D)
    assert plan.names() == ["dp-adam", "semantic-query"] and plan.calibrated == ("dp-adam",)
    query = plan.mechanism("semantic-query")
    assert query.repeats == 1
    # sigma_q makes the query alone (share * eps, delta)-DP: 5 % of eps = 10 in the smoke preset
    assert gaussian_epsilon(query.noise_multiplier, 1e-5) == pytest.approx(0.05 * 10.0, rel=1e-4)
    assert 9.9 <= plan.epsilon() <= 10.0
    fine_tuning = plan.mechanism("dp-adam")
    assert fine_tuning.sample_rate == pytest.approx(16 / 300) and fine_tuning.repeats == 3
    _, given = _plan(SMOKE_D, ["privimage.selection.query_noise_multiplier=50"])
    assert given.noise_multiplier("semantic-query") == 50.0
    _, gan = _plan(SMOKE_G, ["privimage.gan.steps=7", "privimage.gan.batch_size=30"])
    assert gan.names() == ["dp-discriminator", "semantic-query"]
    assert gan.mechanism("dp-discriminator").repeats == 7 and gan.mechanism("dp-discriminator").sample_rate == 0.1
    with pytest.raises(PrivacyError):  # a fixed sigma the target cannot afford is refused before any data
        _plan(SMOKE_G, ["privimage.gan.noise_multiplier=0.1"])
    with pytest.raises(ConfigError, match="privimage.gan.batch_size"):
        _plan(SMOKE_G, ["privimage.gan.batch_size=301"])


def test_plan_of_a_reused_selection_charges_its_recorded_sigma(tmp_path):
    from dpsynth.selection import Selection
    from dpsynth.selection.distribution import write_selection

    selection = Selection(
        noisy_counts=np.ones((10, 4)),
        chosen=[[0]] * 10,
        k1=1,
        k2=1,
        noise_multiplier=123.0,
        conditional=True,
        row_names=[str(i) for i in range(10)],
        semantic_names=list("abcd"),
        private_spec="mnist10k?max_train=300",
    )
    write_selection(tmp_path, selection, np.arange(8) % 4, {})
    _, plan = _plan(SMOKE_D, [f"privimage.selection.reuse={tmp_path}"])
    assert plan.noise_multiplier("semantic-query") == 123.0
    with pytest.raises(ConfigError, match="sigma_q=123"):
        load_config(SMOKE_D, [f"privimage.selection.reuse={tmp_path}", "privimage.selection.query_noise_multiplier=5"])
    with pytest.raises(ConfigError, match="selection.reuse"):
        load_config(SMOKE_D, [f"privimage.selection.reuse={tmp_path / 'missing'}"])


def test_config_rules_fail_at_load():
    with pytest.raises(ConfigError, match="public"):
        load_config(SMOKE_D, ["data.public=null"])
    with pytest.raises(ConfigError, match="pretrain.enabled"):
        load_config(SMOKE_D, ["privimage.pretrain.enabled=false"])
    with pytest.raises(ConfigError, match="privimage.gan.betas"):
        load_config(SMOKE_G, ["privimage.gan.betas=[0.5, 1.5]"])
    with pytest.raises(ConfigError, match="privimage.selection.collisions"):
        load_config(SMOKE_G, ["privimage.selection.collisions=random"])
    with pytest.raises(ConfigError, match="privimage.selection.query_epsilon_share"):
        load_config(SMOKE_G, ["privimage.selection.query_epsilon_share=1.5"])
    with pytest.raises(ConfigError, match="learn_sigma"):  # pdp-diffusion's shared rules hold here too
        load_config(SMOKE_D, ["privimage.loss=hybrid"])
    phases = get_method("privimage").phases(load_config(SMOKE_G))
    assert [(p.name, p.private, p.public) for p in phases] == [
        ("selection", True, "required"),
        ("pretrain", False, "required"),
        ("dp-discriminator", True, "none"),
        ("generate", False, "none"),
    ]


class _Saves:
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def load(self, phase: str) -> None:
        return None

    def save(self, state: dict, phase: str) -> None:
        self.order.append(f"save {state['extra']['after']}")


class _HookContext:
    def __init__(self, order: list[str]) -> None:
        self.seed = 0
        self.ledger = PrivacyLedger(1e4, 1e-5, accountant="rdp")
        self.checkpoints = _Saves(order)
        self.curves = type(
            "Curves", (), {"log": lambda self, step, **values: None, "truncate_after": lambda self, step: None}
        )()

    def log(self, message: str) -> None:
        pass

    def noise_source(self) -> NoiseSource:
        return NoiseSource()

    releases_spent = RunContext.releases_spent
    resume = RunContext.resume


def test_after_step_runs_after_each_noisy_update_and_before_its_checkpoint():
    order: list[str] = []
    model = torch.nn.Linear(3, 1)
    seen: list[torch.Tensor] = []

    def after_step(step: int, engine: Any) -> None:
        seen.append(model.weight.detach().clone())
        order.append(f"after {step}")

    train_private(
        _HookContext(order),
        model,
        lambda call, example: call(example["x"].unsqueeze(0)).sum(),
        lambda indices, draws: {"x": torch.ones(len(indices), 3)},
        np.arange(20, dtype=np.uint64),
        PrivateTraining(batch_size=5, lr=0.1, steps=4, noise_multiplier=1.0, checkpoint_every=2),
        after_step=after_step,
        state_extra=lambda: {"after": len(seen)},
    )
    assert order == ["after 0", "after 1", "save 2", "after 2", "after 3", "save 4"]
    assert not torch.equal(seen[0], seen[1])  # each call sees the weights after that step's noisy update


class TestPrivImageContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``privimage/smoke`` preset."""

    method = "privimage"
