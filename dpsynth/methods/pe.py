"""``pe``: Private Evolution, a population of public-model samples evolved by noisy nearest-neighbour votes.

Paper: Lin, Gopi, Kulkarni, Nori, Yekhanin, "Differentially Private Synthetic Data via Foundation Model APIs 1:
Images", ICLR 2024, arXiv:2305.15560 (Algorithm 1, Private Evolution; Algorithm 2, the DP nearest-neighbour
histogram). No model is trained on private data: only the vote histograms touch it. This module composes the
**API** (:mod:`dpsynth.diffusion.public_api`: RANDOM_API and VARIATION_API on a latent diffusion model pre-trained
on ``data.public`` only, cached and shared with the latent methods; the features ``phi(x)``: the public backbone's
latent of an image, flattened), the **votes and selection** (:mod:`dpsynth.selection.evolution`: each round ONE
``Gaussian("pe-votes", sigma)`` bounded-sum release of the K class histograms, bound ``sqrt(k)``; T rounds one
ledger entry with T repeats, sigma calibrated for all of them) and the **release**: the final population decoded
to uint8 images with their classes, from which ``generate`` draws a balanced share per class.

Randomness: the random API, the resampling and the variations draw from the run's public ``sampling`` stream;
the DP noise comes from the run's noise source, never the seed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.data.sizes import planned_num_classes
from dpsynth.data.tensors import tensor_to_uint8
from dpsynth.diffusion.public_api import RESAMPLE, ApiSection, PublicApi, round_stream
from dpsynth.errors import ConfigError
from dpsynth.methods.families.diffusion import (
    PretrainResult,
    PretrainSection,
    encode_records,
    encode_train_set,
    known_unet_keys,
    known_unet_preset,
    load_public_backbone,
    pretrain_public_model,
    unet_spec,
)
from dpsynth.models.backbone import Backbone, check_declared_side
from dpsynth.models.unet import UNET_PRESETS
from dpsynth.privacy.bounded_sum import BoundedSum
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.report.balance import balanced_draw
from dpsynth.seeding import stream_seed
from dpsynth.selection.evolution import EvolutionSection, PrivateVotes, vote_and_select

MECHANISM = "pe-votes"
#: checkpoint phase of the population after each round ("step": the rounds done)
POPULATION_PHASE = "population"
#: the ``sampling`` stream index of ``generate``'s order (the API's are :mod:`dpsynth.diffusion.public_api`'s)
GENERATE = 1


class ApiPretrainSection(PretrainSection):
    """The shared public pre-training keys (the same cache entry as any latent preset with the same values), with
    what they mean for Private Evolution's API."""

    enabled: bool = Field(True, description="must stay true: pe's API is the model pre-trained on data.public")
    label_dropout: float = Field(
        0.1, ge=0, lt=1, description="null-class fraction: the null row learns p(x), the unconditional random API"
    )


class PESection(ApiSection, EvolutionSection):
    """The ``pe`` section: the evolution (population, rounds, votes), the API's calls and the public diffusion
    model used as API."""

    model: str = Field("ldm-0.8m", description=f"UNet preset of the public model: {', '.join(UNET_PRESETS)}")
    unet: dict[str, Any] = Field({}, description="overrides of the preset's UNetConfig fields")
    learn_sigma: bool = Field(False, description="learned variance (improved DDPM); DDIM uses the eps channels only")
    loss: Literal["hybrid", "simple"] = Field("simple", description="pre-training loss (hybrid needs learn_sigma)")
    vlb_weight: float = Field(0.001, ge=0, description="lambda of the hybrid loss")
    noise_schedule: Literal["cosine", "linear"] = Field("linear", description="beta schedule")
    timesteps: int = Field(1000, ge=2, description="T of the diffusion model")
    pretrain: ApiPretrainSection = Field(
        default_factory=ApiPretrainSection, description="public pre-training of the API model (cached, shared)"
    )

    _known_preset = pydantic.field_validator("model")(lambda cls, model: known_unet_preset(model))
    _known_unet_keys = pydantic.field_validator("unet")(lambda cls, unet: known_unet_keys(unet))

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> PESection:
        if self.loss == "hybrid" and not self.learn_sigma:
            raise ValueError("loss 'hybrid' needs learn_sigma: true (improved DDPM)")
        if self.sample_steps > self.timesteps:
            raise ValueError(f"sample_steps ({self.sample_steps}) cannot exceed timesteps ({self.timesteps})")
        bad = [d for d in self.variation_degrees if not 0 <= d < self.sample_steps]
        if bad:
            raise ValueError(
                f"variation_degrees must lie in [0, sample_steps - 1 = {self.sample_steps - 1}], got {bad[0]}"
            )
        if not self.pretrain.enabled:
            raise ValueError("pretrain.enabled: pe's API is the public pre-trained model; it cannot be disabled")
        return self

    def query(self, sigma: float, num_classes: int) -> BoundedSum:
        """One round's release: k-hot vote rows (L2 norm sqrt(k)) summed per class, raw noisy sums (no divisor)."""
        return BoundedSum(MECHANISM, math.sqrt(self.num_nearest), sigma, num_classes)


@register_method
class PE(Method):
    name = "pe"
    summary = (
        "Private Evolution: candidates from a public diffusion model, resampled by noisy nearest-neighbour votes "
        "of the private images and varied by the model, round after round; no training on private data"
    )
    paper = (
        "Lin, Gopi, Kulkarni, Nori, Yekhanin, Differentially Private Synthetic Data via Foundation Model APIs 1: "
        "Images, ICLR 2024 (arXiv:2305.15560)"
    )
    config_schema = PESection
    privacy_notes = (
        (
            "pe: add/remove adjacency. Each round releases the K per-class nearest-neighbour vote histograms as one "
            "Gaussian mechanism 'pe-votes' (a record adds 1 to k candidates of its own class: L2 sensitivity sqrt(k), "
            "classes disjoint); T rounds compose as one entry with T repeats, sigma calibrated for all of them. "
            "Thresholding, resampling and the variations are post-processing."
        ),
        (
            "pe: the API is the project's public diffusion model pre-trained on data.public only, and the features "
            "are the public backbone's latents; the paper's and DPImageBench's ImageNet models and Inception "
            "features are not used. No private FID or other private statistic is computed or logged."
        ),
    )

    def __init__(self) -> None:
        self._released: tuple[np.ndarray, np.ndarray] | None = None  # the final images and their classes

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        evolution = "T rounds: noisy nearest-neighbour vote histograms, resampling, variations"
        return [
            Phase("api", private=False, public="required", description="the public backbone and diffusion model"),
            Phase("evolution", private=True, public="required", description=evolution),
            Phase("generate", private=False),
        ]

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        check_declared_side(config.backbone, config.data)
        num_classes = planned_num_classes(config.data)
        if num_classes is not None:
            config.section.check_population(num_classes, "pe")

    @classmethod
    def pretrain_public_api(
        cls, config: RunConfig, public: Any, backbone: Backbone, *, device: Any, log: Callable[[str], None]
    ) -> PretrainResult:
        """The API's diffusion model: the section's UNet on the backbone's latents with the public label space,
        pre-trained on ``public`` only (the shared cache); for ``dpsynth pretrain`` to build ahead of a run too."""
        channels, side, width = backbone.latent_shape
        if side != width:
            raise ConfigError(f"pe needs square latents, got {side}x{width}")
        spec = unet_spec(config.section, channels, side, public.num_classes)
        return pretrain_public_model(config, public, str(config.data.public), spec, backbone, device=device, log=log)

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        return []  # no network sees private data

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """T Gaussian releases of the vote histograms (one ledger entry), sigma calibrated unless given."""
        section: PESection = config.section
        return plan_calibrated(
            config.privacy,
            (),
            lambda sigma: section.query(sigma, 1).mechanism(section.rounds),
            noise_multiplier=section.noise_multiplier,
        )

    def load_api(self, ctx: RunContext) -> PublicApi:
        """The public backbone and API model (cached), with ``phi``: the encoder's latents, flattened."""
        backbone, size = load_public_backbone(ctx), ctx.section.feature_batch_size
        result = self.pretrain_public_api(ctx.config, ctx.public, backbone, device=ctx.device, log=ctx.log)
        ctx.log(f"pe: API model {result.key} ({'cache hit' if result.cached else 'trained'})")

        def features(images: torch.Tensor) -> torch.Tensor:
            return encode_records(backbone, images.cpu(), size).flatten(1).float()

        rng = functools.partial(ctx.rng, "sampling")
        return PublicApi(result.model.eval(), result.spec, backbone, ctx.section, features, rng, ctx.device)

    def fit(self, ctx: RunContext) -> None:
        """Algorithm 1: the random API's population, then T rounds of votes, resampling and variations."""
        section: PESection = ctx.section
        num_classes = ctx.num_classes
        section.check_population(num_classes, "pe")
        per_class = section.population // num_classes
        start, saved = ctx.resume(MECHANISM, POPULATION_PHASE)  # a round charged but not saved is not run again
        api = self.load_api(ctx)
        if saved is None:
            names = (ctx.public.class_names or (), ctx.data.train.class_names or ())
            latents, conditions = api.random(num_classes, per_class, *names)
            ctx.checkpoints.save({"step": 0, "latents": latents, "api_labels": conditions}, phase=POPULATION_PHASE)
        else:
            latents, conditions = saved["latents"], saved["api_labels"]
        train, size = ctx.data.train, section.feature_batch_size

        def private() -> torch.Tensor:  # phi of every private record: at the first release, after its charge
            return encode_train_set(api.backbone, train, size).cpu().flatten(1).float()

        votes = PrivateVotes(train, private, section.num_nearest, size)
        query = section.query(ctx.plan.noise_multiplier(MECHANISM), num_classes)
        noise = ctx.noise_source()
        for round_index in range(start, section.rounds):
            degree = section.variation_degrees[round_index]
            embeddings = api.candidate_embeddings(latents, conditions, degree, round_index)
            generator = ctx.rng("sampling", round_stream(round_index, RESAMPLE))
            chosen, empty, released = vote_and_select(
                votes, embeddings, query, ctx.ledger, noise, section.threshold, generator
            )
            latents, conditions = api.vary(latents[chosen], conditions[chosen], degree, round_index), conditions[chosen]
            ctx.log(
                f"pe: round {round_index + 1}/{section.rounds}: released {num_classes} vote histograms of "
                f"{per_class} candidates (noise std {released.noise_std:.4g}, sigma {query.noise_multiplier:.4g}), "
                f"variation degree {degree}; eps={ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}"
            )
            if empty:
                ctx.log(
                    f"pe: round {round_index + 1}: {len(empty)} class(es) had no candidate above the threshold "
                    f"{section.threshold:g}; resampled uniformly"
                )
            state = {"step": round_index + 1, "latents": latents, "api_labels": conditions}
            ctx.checkpoints.save(state, phase=POPULATION_PHASE)
        labels = np.repeat(np.arange(num_classes, dtype=np.int64), per_class)
        self._released = (tensor_to_uint8(api.decode(latents)), labels)

    def state_dict(self) -> dict[str, Any]:
        images, labels = self._released
        return {"images": images, "labels": labels}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        self._released = (state["images"], state["labels"])

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` released images, balanced over classes: class c's share in a public random order of its final
        candidates, repeated only when more are asked for than the class holds (post-processing)."""
        images, labels = self._released
        return Samples(*balanced_draw(images, labels, num, stream_seed(ctx.seed, "sampling", GENERATE)))
