"""The public latent backbone: the KL autoencoder's shapes, its training on public glyphs, and its cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.loading import load_dataset
from dpsynth.errors import ConfigError
from dpsynth.models.autoencoder import AutoencoderConfig, KLAutoencoder
from dpsynth.models.backbone import BackboneSection, mean_image_mse, pretrain_backbone, reconstruction_mse

TINY = {"base_channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("image_shape, latent_shape", [((1, 28, 28), (4, 7, 7)), ((3, 32, 32), (4, 8, 8))])
def test_the_default_autoencoder_encodes_to_a_4x_smaller_latent_and_decodes_back(image_shape, latent_shape):
    config = AutoencoderConfig()
    assert config.latent_shape(image_shape) == latent_shape
    model = KLAutoencoder(image_shape[0], config).eval()
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000  # "a few hundred k"
    images = torch.rand(3, *image_shape) * 2 - 1
    mean, logvar = model.encode(images)
    assert mean.shape == logvar.shape == (3, *latent_shape)
    assert model.decode(mean).shape == images.shape
    reconstruction, _, _ = model(images, noise=torch.randn(3, *latent_shape))
    assert reconstruction.shape == images.shape


def test_a_side_the_downsampling_does_not_divide_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^backbone\.autoencoder\.channel_mult: 4 levels shrink the side 8x"):
        AutoencoderConfig(channel_mult=[1, 2, 2, 2]).latent_shape((1, 28, 28))


def test_one_images_latent_does_not_depend_on_the_others_in_its_batch():
    # What makes encoding private records per-record (DP-SGD's sensitivity unchanged): no batch statistics.
    model = KLAutoencoder(1, AutoencoderConfig(**TINY)).eval()
    images = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        together = model.encode(images)[0]
        alone = torch.cat([model.encode(image[None])[0] for image in images])
    torch.testing.assert_close(together, alone)


def _glyphs(split: str, size: int = 256) -> ImageDataset:
    return load_dataset("glyphs-digits", split, size=size, image_size=16)


def test_a_short_training_on_public_glyphs_reconstructs_held_out_glyphs_far_better_than_the_mean_image():
    train, held_out = _glyphs("train"), _glyphs("test")
    section = BackboneSection(autoencoder=TINY, steps=80, batch_size=16, lr=0.003, cache=False)
    backbone = pretrain_backbone(train, section, log=lambda line: None)
    train_images, _ = train.to_tensors()
    test_images, _ = held_out.to_tensors()
    baseline = mean_image_mse(train_images, test_images)
    untrained = reconstruction_mse(KLAutoencoder(1, section.autoencoder), test_images)
    trained = reconstruction_mse(backbone.autoencoder, test_images)
    assert trained < 0.6 * baseline < untrained  # seeded: about 0.45 x the baseline after 80 steps
    latents = backbone.encode(test_images)
    assert latents.shape == (len(test_images), 4, 8, 8)
    assert 0.5 < float(latents.std()) < 2.0  # rescaled to about unit variance (LDM's scale factor)
    assert backbone.decode(latents).shape == test_images.shape


def _tiny_public(seed: int = 0) -> ImageDataset:
    images = np.random.default_rng(seed).integers(0, 256, (24, 8, 8, 1), dtype=np.uint8)
    return ImageDataset(images, np.arange(24) % 2, 2, name="tiny-public")


def _built(public: ImageDataset, **keys) -> object:
    section = BackboneSection(**{"autoencoder": TINY, "steps": 4, "batch_size": 8, "checkpoint_every": 2, **keys})
    return pretrain_backbone(public, section, log=lambda line: None)


def test_a_second_call_reuses_the_cached_backbone_and_a_changed_public_set_or_config_rebuilds_it():
    public = _tiny_public()
    first = _built(public)
    assert not first.cached and first.path.is_file()
    second = _built(public)
    assert second.cached and second.key == first.key
    for a, b in zip(first.autoencoder.state_dict().values(), second.autoencoder.state_dict().values()):
        assert torch.equal(a, b)
    assert second.latent_scale == first.latent_scale
    assert _built(public, checkpoint_every=3).cached  # how often to snapshot changes no weight: same entry
    edited = public.images.copy()
    edited[0, 0, 0, 0] ^= 1
    changed_public = ImageDataset(edited, public.labels, 2, name="tiny-public")
    for rebuilt in (
        _built(changed_public),
        _built(public, steps=5),
        _built(public, kl_weight=0.01),
        _built(public, seed=1),
        _built(public, autoencoder=dict(TINY, latent_channels=3)),
    ):
        assert not rebuilt.cached and rebuilt.key != first.key
    assert not list(first.path.parent.glob("*.partial.pt"))  # snapshots removed once finished


def test_an_interrupted_pre_training_resumes_to_the_same_weights(monkeypatch):
    import dpsynth.models.backbone as backbone_module

    public = _tiny_public()
    uninterrupted = _built(public, cache=False)
    original = backbone_module.train_autoencoder

    def train_then_die(model, images, section, generator, **kwargs):
        snapshots = kwargs["snapshots"]
        save = snapshots.save

        def save_then_die(state):
            save(state)
            raise KeyboardInterrupt

        kwargs["snapshots"] = type(snapshots)(save=save_then_die, load=snapshots.load)
        return original(model, images, section, generator, **kwargs)

    monkeypatch.setattr(backbone_module, "train_autoencoder", train_then_die)
    with pytest.raises(KeyboardInterrupt):
        _built(public)
    monkeypatch.setattr(backbone_module, "train_autoencoder", original)
    resumed = _built(public)
    assert not resumed.cached
    for a, b in zip(uninterrupted.autoencoder.state_dict().values(), resumed.autoencoder.state_dict().values()):
        torch.testing.assert_close(a, b)
