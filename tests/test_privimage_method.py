"""PrivImage end to end (+D and +G smoke runs), the method contract, the typed config, resume and re-use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsynth.contract import Method, Samples
from dpsynth.errors import ConfigError
from dpsynth.methods import get_method
from dpsynth.methods.privimage import PrivImageConfig, validate_section
from dpsynth.models.gan import ConditionalDiscriminator, GANSpec
from dpsynth.runner import open_run, run_config

REPO = Path(__file__).resolve().parents[1]
SMOKE_D = REPO / "configs" / "privimage" / "smoke.yaml"
SMOKE_G = REPO / "configs" / "privimage" / "smoke_gan.yaml"
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


def test_gan_smoke_run_trains_the_discriminator_privately_and_resumes(cache, tmp_path):
    run = run_config(SMOKE_G, FAST_G, out=tmp_path / "g", echo=False)
    privacy = _check_contract(run, 10.0)
    mechanisms = {m["name"]: m for m in privacy["mechanisms"]}
    assert set(mechanisms) == {"semantic-query", "dp-discriminator"}
    assert mechanisms["dp-discriminator"]["steps"] == 3
    run_config(SMOKE_G, FAST_G, out=run, resume=True, echo=False)
    assert _privacy(run)["mechanisms"] == privacy["mechanisms"]  # neither re-queried nor re-trained
    assert "resumed from the checkpoint" in (run / "log.txt").read_text()
    ctx, method = open_run(run, echo=False)  # a fresh process: the generator comes from its checkpoint
    samples = method.generate(ctx, 10)
    assert samples.images.shape == (10, 28, 28, 1) and np.bincount(samples.labels).tolist() == [1] * 10


def test_reusing_a_selection_from_another_run_charges_it_again(cache, tmp_path):
    first = run_config(SMOKE_G, FAST_G, out=tmp_path / "first", echo=False)
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
    assert validate_section(method.defaults).selection.k == 3
    with pytest.raises(ConfigError, match="privimage.selection.k"):
        validate_section({**method.defaults, "selection": {**method.defaults["selection"], "k": 0}})
    with pytest.raises(ConfigError, match="privimage.typo"):
        validate_section({**method.defaults, "typo": 1})
    with pytest.raises(ConfigError, match="generator"):
        validate_section({**method.defaults, "generator": "vae"})
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
