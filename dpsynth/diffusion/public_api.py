"""A public diffusion model used as Private Evolution's generation API: random samples, variations, embeddings.

Paper: Lin, Gopi, Kulkarni, Nori, Yekhanin, "Differentially Private Synthetic Data via Foundation Model APIs 1:
Images", ICLR 2024, arXiv:2305.15560, §3 and Algorithm 1: RANDOM_API draws the initial population, VARIATION_API
returns a variation of each candidate, and the candidates are compared to the private records in a public feature
space (with the paper's "lookahead": a candidate's embedding is the mean over variations of it).

* **RANDOM_API** (:meth:`PublicApi.random`): ``per_class`` latents for each of the K declared private classes by
  DDIM, conditioned on the null class, a uniform public class, or the public class of the same name
  (:func:`random_conditions`; class names are metadata).
* **VARIATION_API** (:meth:`PublicApi.vary`): SDEdit (:func:`dpsynth.diffusion.samplers.vary`): noise to a step of
  the respaced DDIM schedule given by the variation degree, then denoise.
* **Candidate embeddings** (:meth:`PublicApi.candidate_embeddings`): the public feature map of the decoded
  candidates, averaged over ``lookahead`` variations of each (0: the candidate itself).

Nothing here reads private data: the model, the backbone and the feature map are public, and every draw comes
from the run's public ``sampling`` stream (``rng``), one generator per use (:func:`round_stream`), so a resumed
run repeats the draws of the rounds it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from pydantic import Field

from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.samplers import sample, vary
from dpsynth.errors import ConfigError
from dpsynth.models.backbone import Backbone
from dpsynth.schema import Section

__all__ = ["ApiSection", "PublicApi", "RandomApi", "random_conditions", "round_stream"]

RandomApi = Literal["unconditional", "public-labels", "names"]
#: ``sampling`` stream indices: the random API; per round, a lookahead copy, the resampling, the variation
RANDOM_API = 0
LOOKAHEAD, RESAMPLE, VARIATION = 0, 1, 2


def round_stream(round_index: int, use: int) -> int:
    """The ``sampling`` stream index of one use (lookahead copy, resampling, variation) in one round."""
    return 1000 * (round_index + 1) + use


class ApiSection(Section):
    """The keys of the API's calls: the random API's condition, DDIM settings, batch sizes and the lookahead."""

    lookahead: int = Field(
        2,
        ge=0,
        description="variations averaged into a candidate's embedding (the paper's lookahead); 0: the candidate itself",
    )
    random_api: RandomApi = Field(
        "unconditional",
        description="the random API's condition: unconditional (the public model's null class) | public-labels (a "
        "uniform public class) | names (the public class named as the private class, else the null class; metadata)",
    )
    sample_steps: int = Field(20, ge=1, description="DDIM steps of the random API; variations use the same spacing")
    eta: float = Field(0.0, ge=0, description="DDIM stochasticity (0 = deterministic given the start)")
    api_batch_size: int = Field(500, ge=1, description="latents per diffusion-model call (memory)")
    feature_batch_size: int = Field(500, ge=1, description="images per encoder call and private records per vote chunk")


def random_conditions(
    mode: RandomApi,
    public_classes: int,
    num_classes: int,
    per_class: int,
    generator: torch.Generator,
    public_names: Sequence[str] = (),
    private_names: Sequence[str] = (),
) -> torch.Tensor:
    """The public condition of every candidate, ``[K * M]`` class-major (index ``public_classes`` is the null
    class): the null class, a uniform public class, or the public class named as the private class (else null)."""
    if mode == "public-labels":
        return torch.randint(0, public_classes, (num_classes * per_class,), generator=generator)
    rows = torch.full((num_classes,), public_classes, dtype=torch.long)
    if mode == "names":
        public_names, private_names = list(public_names), list(private_names)
        if not private_names:
            raise ConfigError("random_api: names needs class names on the private dataset; use unconditional")
        for label, name in enumerate(private_names[:num_classes]):
            if name in public_names:
                rows[label] = public_names.index(name)
    return rows.repeat_interleave(per_class)


class PublicApi:
    """The public model behind the random and variation APIs, and the public feature map, in latent space.

    ``features`` maps pixel images to ``[N, D]`` float32 embeddings on the CPU (the same map the private records
    go through); ``rng(index)`` is the run's public ``sampling`` generator of a stream index.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: DiffusionModelSpec,
        backbone: Backbone,
        section: ApiSection,
        features: Callable[[torch.Tensor], torch.Tensor],
        rng: Callable[[int], torch.Generator],
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.spec, self.backbone, self.section = model, spec, backbone, section
        self.features, self.rng, self.device = features, rng, device
        self.schedule = spec.schedule()

    def random(
        self, num_classes: int, per_class: int, public_names: Sequence[str] = (), private_names: Sequence[str] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RANDOM_API: ``per_class`` latents for each of the K declared classes (class-major), with their conditions."""
        generator = self.rng(RANDOM_API)
        mode, public_classes = self.section.random_api, self.spec.num_classes
        labels = random_conditions(mode, public_classes, num_classes, per_class, generator, public_names, private_names)
        latents = sample(
            self.model,
            self.schedule,
            labels,
            (self.spec.channels, self.spec.image_size, self.spec.image_size),
            sampler="ddim",
            steps=self.section.sample_steps,
            generator=generator,
            eta=self.section.eta,
            batch_size=self.section.api_batch_size,
            clip_denoised=False,
            progress=False,
            device=self.device,
        )
        return latents, labels

    def vary(
        self, latents: torch.Tensor, labels: torch.Tensor, degree: int, round_index: int, use: int = VARIATION
    ) -> torch.Tensor:
        """VARIATION_API: one SDEdit variation of every latent at ``degree``; noise from the round's stream ``use``."""
        return vary(
            self.model,
            self.schedule,
            latents,
            labels,
            steps=self.section.sample_steps,
            skip=degree,
            generator=self.rng(round_stream(round_index, use)),
            eta=self.section.eta,
            batch_size=self.section.api_batch_size,
            clip_denoised=False,
            device=self.device,
        )

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of ``latents``, decoded a batch at a time on the backbone's device, on the CPU."""
        device = next(self.backbone.autoencoder.parameters()).device
        size = self.section.feature_batch_size
        chunks = [self.backbone.decode(chunk.to(device)).cpu() for chunk in latents.split(size)]
        return torch.cat(chunks) if chunks else torch.empty(0, *self.backbone.image_shape)

    def candidate_embeddings(
        self, latents: torch.Tensor, labels: torch.Tensor, degree: int, round_index: int
    ) -> torch.Tensor:
        """Each candidate's embedding: the mean over ``lookahead`` variations at ``degree`` (0: its own)."""
        lookahead = self.section.lookahead
        if lookahead == 0:
            return self.features(self.decode(latents))
        total = 0.0
        for copy in range(lookahead):
            varied = self.vary(latents, labels, degree, round_index, 10 * (copy + 1) + LOOKAHEAD)
            total = total + self.features(self.decode(varied))
        return total / lookahead
