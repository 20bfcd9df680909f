"""The public generation API of Private Evolution (dpsynth.diffusion.public_api): the random API's conditions,
and the candidate embeddings averaged over lookahead variations drawn from per-use public streams."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.public_api import ApiSection, PublicApi, random_conditions, round_stream
from dpsynth.errors import ConfigError


@pytest.mark.parametrize("mode", ["unconditional", "public-labels", "names"])
def test_the_random_api_conditions_every_declared_class(mode):
    """K x M conditions, class-major: the null class, uniform public classes, or the public class of the same name
    (class names are metadata) and the null class for a private class no public class is named after."""
    labels = random_conditions(
        mode, 5, 3, 4, torch.Generator().manual_seed(0), ["x", "b", "y", "a", "z"], ["a", "b", "c"]
    )
    assert labels.shape == (12,)
    if mode == "unconditional":
        assert labels.tolist() == [5] * 12
    elif mode == "names":
        assert labels.tolist() == [3] * 4 + [1] * 4 + [5] * 4
    else:
        assert 0 <= int(labels.min()) and int(labels.max()) < 5 and len(set(labels.tolist())) > 1
    if mode == "names":
        with pytest.raises(ConfigError, match="class names"):
            random_conditions(mode, 5, 3, 4, torch.Generator(), ["a"], [])


class _Identity(torch.nn.Module):
    """A stand-in autoencoder: latents are the images (so decode and encode are exact)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))


def test_candidate_embeddings_average_the_lookahead_variations_of_their_round():
    """Lookahead L: the mean of the features of L variations, each drawn from its own stream of the round (so the
    embedding is reproducible and differs from the candidate's own); L = 0: the candidate's own features."""
    backbone = SimpleNamespace(
        autoencoder=_Identity(), image_shape=(1, 2, 2), latent_shape=(1, 2, 2), decode=lambda x: x
    )
    spec = DiffusionModelSpec(model="ldm-0.8m", image_size=2, channels=1, num_classes=0, noise_schedule="linear")
    used = []

    def rng(index):
        used.append(index)
        return torch.Generator().manual_seed(index)

    def zero_noise(x, t, y=None):
        return torch.zeros_like(x)

    latents = torch.linspace(-1, 1, 12).reshape(3, 1, 2, 2)

    def features(images):
        return images.flatten(1)

    for lookahead in (0, 2):
        section = ApiSection(lookahead=lookahead, sample_steps=4)
        api = PublicApi(zero_noise, spec, backbone, section, features, rng)
        embeddings = api.candidate_embeddings(latents, None, 1, round_index=2)
        assert embeddings.shape == (3, 4)
        if lookahead == 0:
            assert torch.equal(embeddings, latents.flatten(1)) and used == []
    assert used == [round_stream(2, 10), round_stream(2, 20)]
    assert not torch.equal(embeddings, latents.flatten(1))
    again = PublicApi(zero_noise, spec, backbone, ApiSection(lookahead=2, sample_steps=4), features, rng)
    assert torch.equal(again.candidate_embeddings(latents, None, 1, round_index=2), embeddings)
