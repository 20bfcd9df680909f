"""DPPM: a noise-conditional score model of (image, label-row) pairs, sampled with Hamiltonian dynamics.

Paper: "Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation"
(Liu, Ge, Wang, Zhuang, Liu), §4, Algorithms 1-2, Fig. 4-5. The method composes the shared layers: the label
embedding u = [x; E y] (Fig. 5) and class-conditional sampling (:mod:`dpsynth.diffusion.label_rows`); the NCSN
RefineNet over a geometric noise ladder, trained with denoising or sliced score matching (Eq. 5/7;
:mod:`dpsynth.diffusion.score_matching`) by DP-SGD or the paper's Algorithm 1 (:mod:`dpsynth.diffusion.score_training`);
Algorithm 2's annealed Hamiltonian dynamics or NCSN's annealed Langevin dynamics (:mod:`dpsynth.diffusion.hmc`).

Latent space (``space: latent``; the paper's pixel space is the default): the score network trains on the
label-embedded latents of the public backbone (docs/backbone.md), u = [z; E y], and its samples are decoded by
the public decoder. Each private image is encoded on its own, so a record's u depends on that record alone and
DP-SGD's sensitivity is unchanged; decoding is post-processing. The noise ladder is the pixel one (the backbone
scales latents to about unit variance).

Privacy. The paper's claim of ε-DP from randomized response on the projection vectors (Eq. 6, Theorem 1) does not
hold (:data:`PAPER_CLAIM_NOTE`), so the default (``privacy.mechanism: dp-sgd``) trains with DP-SGD, and every
benchmark uses it. The paper's mechanism runs only with ``allow_unsound_randomized_response: true``; such a run's
ledger has ``guarantee: "none"`` and claims no ε anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.diffusion.hmc import MCMCSection
from dpsynth.diffusion.label_rows import embed_labels, label_embedding_matrix, sample_embedded
from dpsynth.diffusion.score_matching import NoiseLadderSection, ScoreMatchingLoss, example_denoising_losses
from dpsynth.diffusion.score_training import (
    PaperResponse,
    RefineNetSection,
    ScoreTrainingSection,
    score_network,
    train_score_network,
)
from dpsynth.dpsgd.estimate import planned_image_geometry
from dpsynth.methods.families.diffusion import (
    LatentSpaceSection,
    backbone_phases,
    check_latent_config,
    encode_records,
    latent_geometry,
    load_backbone,
    restore_backbone,
    save_backbone,
    uses_latent_space,
)
from dpsynth.models.backbone import Backbone
from dpsynth.models.refinenet import RefineNet, RefineNetConfig
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd
from dpsynth.privacy.randomized_response import randomized_response_plan
from dpsynth.schema import Section, with_defaults
from dpsynth.seeding import stream_seed

DPSGD_MECHANISM = "dpsgd"
RR_PHASE = "randomized-response"  # the paper's mechanism, and the phase of its checkpoints
NOTE = "dppm paper mode"  # heads the ledger note of a randomized-response run


class PrivacyModeConfig(Section):
    """How training touches the private data: DP-SGD (sound) or the paper's randomized response (no guarantee)."""

    mechanism: Literal["dp-sgd", "randomized-response"] = Field(
        "dp-sgd", description="dp-sgd (sound, the default) or randomized-response (the paper's Eq. 6: NO guarantee)"
    )
    allow_unsound_randomized_response: bool = Field(
        False, description="explicit opt-in required for mechanism randomized-response; the run then claims no ε"
    )
    top_k: int = Field(10, ge=2, description="k of Eq. 6: size of the cosine neighbourhood v^- (paper default 10)")


TrainingConfig = with_defaults(
    ScoreTrainingSection, "DPPMTraining", "Training keys with DPPM's defaults.", physical_batch_size=32, epochs=20.0
)


class SamplerConfig(MCMCSection):
    """Sampling: Algorithm 2's annealed HMC, or NCSN's annealed Langevin dynamics, with a free or clamped label."""

    label_row: Literal["free", "clamped"] = Field(
        "free", description="free: the label is read off the sampled row (paper); clamped: fixed to balanced labels"
    )


class DPPMConfig(LatentSpaceSection):
    """The ``dppm`` section (with ``space``); the rules across its subsections are checked when it loads."""

    model: RefineNetSection = Field(default_factory=RefineNetSection, description="score network")
    noise: NoiseLadderSection = Field(default_factory=NoiseLadderSection, description="noise ladder")
    privacy: PrivacyModeConfig = Field(default_factory=PrivacyModeConfig, description="training mechanism")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="optimisation")  # type: ignore[valid-type]
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="MCMC sampler")

    @pydantic.model_validator(mode="after")
    def _randomized_response_rules(self) -> DPPMConfig:
        """The rules across subsections (the load error names the section; the message names the key)."""
        training, privacy = self.training, self.privacy
        if privacy.mechanism != "randomized-response":
            return self
        if not privacy.allow_unsound_randomized_response:
            raise ValueError(
                "config key 'dppm.privacy.mechanism' = 'randomized-response' gives NO differential privacy "
                "guarantee; allowed only with dppm.privacy.allow_unsound_randomized_response: true (else use dp-sgd)"
            )
        conflict = training.randomized_response_conflict(privacy.top_k)
        if conflict is not None:
            key, why = conflict
            raise ValueError(f"config key 'dppm.training.{key}' = {getattr(training, key)!r}: {why}")
        return self


PAPER_CLAIM_NOTE = (
    "dppm: the paper's claim that randomized response on the sliced-score-matching projection vectors "
    "(Eq. 6, Theorem 1) makes training epsilon-DP does not hold: the projection vectors are drawn "
    "independently of the data, no example's influence on the weights is bounded, and nothing is composed "
    "over training iterations. dpsynth trains DPPM with DP-SGD (per-example clipping, Gaussian noise, the "
    "run's accountant); the paper's mechanism runs only as an explicit opt-in with guarantee 'none'."
)


@register_method
class DPPM(Method):
    name = "dppm"
    summary = (
        "noise-conditional RefineNet score model of image + label row, DP-SGD trained (DSM or sliced SM), "
        "sampled with annealed Hamiltonian dynamics"
    )
    paper = "Liu et al., Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation"
    privacy_notes = (PAPER_CLAIM_NOTE,)
    config_schema = DPPMConfig

    def __init__(self) -> None:
        self._model: RefineNet | None = None  # the released score network, the embedding E and, in latent space,
        self._matrix: torch.Tensor | None = None  # the public backbone that decodes the samples
        self._backbone: Backbone | None = None

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        check_latent_config(config)

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        if config.section.privacy.mechanism == "randomized-response":
            why = "the paper's Algorithm 1 with Eq. 6 randomized response: NO privacy guarantee"
            train = Phase(RR_PHASE, private=True, description=why)
        else:
            train = Phase(DPSGD_MECHANISM, private=True, description="DP-SGD on the score-matching loss")
        sampling = Phase("generate", private=False, description="annealed HMC or Langevin sampling")
        return [*backbone_phases(config), train, sampling]

    @classmethod
    def ledger_guarantee(cls, section: DPPMConfig) -> str:
        """``"none"`` in the paper's randomized-response mode (explicit opt-in), else ``"dp"``."""
        return "none" if section.privacy.mechanism == "randomized-response" else "dp"

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """DP-SGD mode: one subsampled Gaussian, σ calibrated to the target unless given. Paper mode: the randomized
        response, one pure-ε entry per step, listed for transparency under guarantee "none" (no target, no ε)."""
        training, privacy = config.section.training, config.privacy
        steps = training.private_training().total_steps(num_examples)
        if config.section.privacy.mechanism == "randomized-response":
            key = "dppm.training.batch_size"
            return randomized_response_plan(privacy, RR_PHASE, steps, training.batch_size, num_examples, key)
        rate, sigma = training.batch_size / num_examples, training.noise_multiplier
        return plan_with_dpsgd(privacy, (), name=DPSGD_MECHANISM, sample_rate=rate, steps=steps, noise_multiplier=sigma)

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """DP-SGD mode: the RefineNet on u [C, H + 1, W]; a sample batch is num_levels x M x N score evaluations.
        Randomized response trains no network with DP-SGD: none."""
        section = config.section
        if section.privacy.mechanism != "dp-sgd":
            return []
        channels, height, width = latent_geometry(config, planned_image_geometry(config.data)[0])
        calls = section.noise.num_levels * section.sampler.iterations * section.sampler.leapfrog_steps
        shape = (channels, height + 1, width)
        sigmas = section.noise.sigmas()
        return [score_network(f"{self.name}.training", section.model, sigmas, shape, section.training, calls)]

    def fit(self, ctx: RunContext) -> None:
        config = ctx.section
        images, labels = ctx.data.train.to_tensors()
        self._backbone = load_backbone(ctx)
        if self._backbone is not None:  # each record encoded on its own: its latent depends on it alone
            images = encode_records(self._backbone, images)
        self._matrix = label_embedding_matrix(ctx.num_classes, images.shape[-1])
        embedded = embed_labels(images, labels, self._matrix)
        sigmas = config.noise.sigmas()
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        model = config.model.build(embedded.shape[1], sigmas).to(ctx.device).train()
        loss_fn = ScoreMatchingLoss(config.training.objective, sigmas)
        mechanism, response = DPSGD_MECHANISM, None
        if config.privacy.mechanism == "randomized-response":  # the paper's Algorithm 1: guarantee "none"
            mechanism, response = RR_PHASE, PaperResponse(ctx.config.privacy.epsilon, config.privacy.top_k, NOTE)
        released = train_score_network(
            ctx, model, loss_fn, embedded, config.training, mechanism, response, "DPPM DP-SGD"
        )
        if self._backbone is not None:  # public weights: what a later process decodes with
            save_backbone(ctx, self._backbone)
        self._model = released.eval()

    def state_dict(self) -> dict[str, Any]:
        """The released score network (its RefineNet config, ladder and weights) and the public embedding E."""
        assert self._model is not None and self._matrix is not None, "fit first"
        weights = {key: value.detach().cpu() for key, value in self._model.state_dict().items()}
        config = dataclasses.asdict(self._model.config)
        return {"refinenet": config, "sigmas": self._model.sigmas.cpu(), "state": weights, "embedding": self._matrix}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        """Rebuild the released network on ``ctx.device`` and, in latent space, the public backbone it decodes with."""
        model = RefineNet(RefineNetConfig(**state["refinenet"]), state["sigmas"])
        model.load_state_dict(state["state"])
        self._model, self._matrix = model.to(ctx.device).eval(), state["embedding"]
        self._backbone = restore_backbone(ctx) if uses_latent_space(ctx.section) else None

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Audit hook: each (image, label) pair's denoising score-matching loss under the released model.

        The pair is embedded as in training (Fig. 5) and scored at every noise level with public noise, in
        both privacy modes alike (a model trained with sliced score matching is scored the same way), so
        the loss attack compares the DP-SGD and randomized-response runs on one footing."""
        x = uint8_to_tensor(images)
        if self._backbone is not None:  # scored where it was trained: on the pair's latent
            x = encode_records(self._backbone, x)
        embedded = embed_labels(x, torch.as_tensor(labels, dtype=torch.int64), self._matrix)
        return example_denoising_losses(self._model, embedded.to(ctx.device), self._model.sigmas).numpy()

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` samples by annealed HMC (or Langevin) from uniform noise; labels read off the label row."""
        sampler = ctx.section.sampler
        channels, height, width = ctx.image_shape if self._backbone is None else self._backbone.latent_shape
        shape, decode = (channels, height + 1, width), None if self._backbone is None else self._backbone.decode
        settings, batch, desc = sampler.settings(), ctx.config.generate.batch_size, f"DPPM sampling ({sampler.kind})"
        images, labels, rate = sample_embedded(
            self._model, self._matrix, num, shape, settings, sampler.label_row, ctx.rng("sampling"), batch, desc, decode
        )
        if sampler.kind == "hmc":
            ctx.log(f"DPPM sampling: mean Metropolis acceptance {rate:.3f}")
        return Samples(images=images, labels=labels)
