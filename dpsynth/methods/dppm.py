"""DPPM: a noise-conditional score model of (image, label-row) pairs, sampled with Hamiltonian dynamics.

Paper: "Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation"
(Liu, Ge, Wang, Zhuang, Liu), §4, Algorithms 1-2, Fig. 4-5.

* Label embedding (Fig. 5): a fixed, data-independent matrix E [K, W] maps the one-hot label to a row
  of width W that is appended under the image (every channel), u = [x; E y]. After sampling, the image
  is the first H rows and the label the class whose embedding row is nearest to the sampled row.
* Score network: the NCSN RefineNet (:mod:`dpsynth.models.refinenet`) over a geometric noise ladder.
* Objectives (:mod:`dpsynth.diffusion.score_matching`): multi-noise denoising score matching (default)
  or sliced score matching (Eq. 5/7) with Gaussian projection vectors.
* Sampling (:mod:`dpsynth.diffusion.hmc`): Algorithm 2's Hamiltonian dynamics, annealed over the
  noise levels, or NCSN's annealed Langevin dynamics as the baseline.

Latent space (``space: latent``; pixel space, the paper's, is the default): the score network trains on the
label-embedded latents of the public backbone (the run's ``backbone`` section, trained on ``data.public`` and
cached; docs/backbone.md), u = [z; E y] of shape [4, 7 + 1, 7] on mnist10k, and its samples are decoded by the
public decoder. The frozen encoder maps each private image on its own (no batch statistics), so a record's u
depends on that record alone and DP-SGD's sensitivity is unchanged; decoding is post-processing. The pixel-range
assumptions are handled: sampled latents are not clamped to [-1, 1] (the decoder clamps its pixels), and the
noise ladder is the pixel one, since the backbone scales latents to about unit variance.

Privacy. The paper claims ε-DP from randomized response on the projection vectors (Eq. 6,
Theorem 1). That claim does not hold: the vectors are drawn independently of the data, each
example's influence on the weights is never bounded, and nothing is composed over training. So the
default (``privacy.mechanism: dp-sgd``) trains through the shared DP-SGD driver — per-example
clipping, Gaussian noise, the run's accountant — and every benchmark uses it. The paper's mechanism
(``privacy.mechanism: randomized-response``) runs only with ``allow_unsound_randomized_response: true``;
such a run's ledger has ``guarantee: "none"`` and claims no ε anywhere.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Literal

import numpy as np
import pydantic
import torch
from pydantic import Field
from tqdm import tqdm

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.data.transforms import tensor_to_uint8, uint8_to_tensor
from dpsynth.diffusion.hmc import MCMCSettings, annealed_sample
from dpsynth.diffusion.score_matching import (
    ScoreMatchingLoss,
    draw_perturbation,
    example_denoising_losses,
    geometric_sigmas,
)
from dpsynth.dpsgd.ema import EMA
from dpsynth.dpsgd.estimate import planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import make_optimizer, train_private
from dpsynth.errors import ConfigError
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
from dpsynth.privacy.mechanisms import PureEpsilon
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd
from dpsynth.privacy.randomized_response import randomized_response
from dpsynth.privacy.record_draws import Draws, GeneratorDraws
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section, with_defaults
from dpsynth.seeding import stream_seed

FINAL_PHASE = "final"
DPSGD_MECHANISM = "dpsgd"
RR_PHASE = "randomized-response"
EMBEDDING_SEED = 20230925  # fixed and public: the label embedding must not depend on the data or the run


# ------------------------------------------------------------------------------------------ config


class ScoreModelConfig(Section):
    """The NCSN RefineNet score network (Fig. 4a)."""

    preset: Literal["cpu", "paper"] = Field(
        "cpu", description="RefineNet width preset: cpu (w=32, ~2M), paper (w=128, ~30M, Fig. 4a)"
    )
    width: int | None = Field(None, ge=1, description="override of the preset's width w (null: the preset's)")


class NoiseConfig(Section):
    """The geometric ladder of noise levels σ_1 > ... > σ_L (NCSN §4.1)."""

    sigma_max: float = Field(
        2.0, gt=0, description="largest noise level σ_1 (pixels in [-1, 1]; latents have about unit variance)"
    )
    sigma_min: float = Field(0.02, gt=0, description="smallest noise level σ_L; below sigma_max")
    num_levels: int = Field(10, ge=2, description="L, the number of geometric noise levels (NCSN §4.1: 10)")

    @pydantic.field_validator("sigma_min")
    @classmethod
    def _below_sigma_max(cls, sigma_min: float, info: pydantic.ValidationInfo) -> float:
        sigma_max = info.data.get("sigma_max")
        if sigma_max is not None and sigma_min >= sigma_max:
            raise ValueError(f"expected a value below noise.sigma_max = {sigma_max:g}")
        return sigma_min


class PrivacyModeConfig(Section):
    """How training touches the private data: DP-SGD (sound) or the paper's randomized response (no guarantee)."""

    mechanism: Literal["dp-sgd", "randomized-response"] = Field(
        "dp-sgd", description="dp-sgd (sound, the default) or randomized-response (the paper's Eq. 6: NO guarantee)"
    )
    allow_unsound_randomized_response: bool = Field(
        False, description="explicit opt-in required for mechanism randomized-response; the run then claims no ε"
    )
    top_k: int = Field(10, ge=2, description="k of Eq. 6: size of the cosine neighbourhood v^- (paper default 10)")


class TrainingConfig(
    with_defaults(
        DPSGDSection,
        "DPPMDPSGD",
        "DP-SGD keys with DPPM's defaults.",
        physical_batch_size=32,
        epochs=20.0,
    )
):  # type: ignore[misc]
    """Optimisation; clip_norm, noise_multiplier and multiplicity are DP-SGD settings only (the randomized-response
    loop uses B, the length, the optimizer, EMA and checkpoints)."""

    objective: Literal["dsm", "ssm"] = Field(
        "dsm", description="dsm: denoising score matching; ssm: sliced (Eq. 7; required by randomized-response)"
    )
    multiplicity: int = Field(1, ge=1, description="K noise draws per example, averaged before clipping (dp-sgd only)")


class SamplerConfig(Section):
    """Sampling: Algorithm 2's annealed HMC, or NCSN's annealed Langevin dynamics."""

    kind: Literal["hmc", "langevin"] = Field("hmc", description="hmc (Algorithm 2) or annealed Langevin (NCSN)")
    iterations: int = Field(10, ge=1, description="M outer HMC iterations per noise level")
    leapfrog_steps: int = Field(5, ge=1, description="N leapfrog steps per iteration; Langevin takes M*N steps")
    step_size: float = Field(0.01, gt=0, description="λ0 at σ_L (HMC), or ε of α_i = ε σ_i²/σ_L² (Langevin)")
    step_decay_power: float = Field(2.0, ge=0, description="λ = λ0 (M/m)^power (Algorithm 2 line 4: 2)")
    kinetic: Literal["gaussian", "rayleigh", "uniform"] = Field(
        "gaussian", description="momentum distribution (Fig. 3b)"
    )
    metropolis: bool = Field(True, description="Metropolis acceptance after each N leapfrog steps")
    denoise: bool = Field(True, description="final Tweedie step x + σ_L² s(x)")
    label_row: Literal["free", "clamped"] = Field(
        "free", description="free: the label is read off the sampled row (paper); clamped: fixed to balanced labels"
    )


class DPPMConfig(LatentSpaceSection):
    """The ``dppm`` section (with ``space``); the rules across its subsections are checked when it loads."""

    model: ScoreModelConfig = Field(default_factory=ScoreModelConfig, description="score network")
    noise: NoiseConfig = Field(default_factory=NoiseConfig, description="noise ladder")
    privacy: PrivacyModeConfig = Field(default_factory=PrivacyModeConfig, description="training mechanism")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="optimisation")
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
        if training.objective != "ssm":
            raise ValueError(
                f"config key 'dppm.training.objective' = {training.objective!r}: randomized-response perturbs the "
                "sliced-score-matching projections, so it needs objective ssm"
            )
        if training.batch_size < privacy.top_k:
            raise ValueError(
                f"config key 'dppm.training.batch_size' = {training.batch_size}: randomized-response needs at "
                f"least privacy.top_k = {privacy.top_k} projections per batch"
            )
        if training.noise_multiplier is not None:
            raise ValueError(
                f"config key 'dppm.training.noise_multiplier' = {training.noise_multiplier!r}: randomized-response "
                "adds no Gaussian noise; expected null (it is a dp-sgd setting)"
            )
        if training.multiplicity != 1:
            raise ValueError(
                f"config key 'dppm.training.multiplicity' = {training.multiplicity}: randomized-response draws one "
                "projection per example; expected 1 (it is a dp-sgd setting)"
            )
        return self


# -------------------------------------------------------------------------------- label embedding


def label_embedding_matrix(num_classes: int, width: int) -> torch.Tensor:
    """The fixed embedding matrix E [K, W] of Fig. 5: ±1 sign patterns from a fixed public seed."""
    generator = torch.Generator().manual_seed(EMBEDDING_SEED)
    matrix = torch.randint(0, 2, (num_classes, width), generator=generator).float().mul(2).sub(1)
    if len(set(map(tuple, matrix.tolist()))) < num_classes:
        raise ConfigError(f"dppm: an image width of {width} cannot give {num_classes} distinct label rows")
    return matrix


def embed_labels(images: torch.Tensor, labels: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """u = [x; E y]: the label's embedding row appended under each image, on every channel (Fig. 5)."""
    rows = matrix.to(images.device)[labels]  # [N, W]
    rows = rows[:, None, None, :].expand(-1, images.shape[1], 1, -1)
    return torch.cat([images, rows], dim=2)


def split_embedding(u: torch.Tensor, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`embed_labels`: the image rows and the class whose embedding is nearest to the row."""
    images, row = u[:, :, :-1], u[:, :, -1].mean(dim=1)  # [N, W]
    distances = torch.cdist(row, matrix.to(u.device))
    return images, distances.argmin(dim=1)


def label_row_mask(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """1 on the image rows, 0 on the label row (for sampling with a clamped label)."""
    mask = torch.ones((1, *shape), device=device)
    mask[:, :, -1] = 0
    return mask


# ---------------------------------------------------------------------------------------- method

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
        self._model: RefineNet | None = None
        self._matrix: torch.Tensor | None = None
        self._backbone: Backbone | None = None  # the public latent backbone of a latent-space run

    # -- declared before any data is read ---------------------------------------------------------
    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        check_latent_config(config)

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        if config.section.privacy.mechanism == "randomized-response":
            train = Phase(
                RR_PHASE,
                private=True,
                description="the paper's Algorithm 1 with Eq. 6 randomized response: NO privacy guarantee",
            )
        else:
            train = Phase(DPSGD_MECHANISM, private=True, description="DP-SGD on the score-matching loss")
        sampling = Phase("generate", private=False, description="annealed HMC or Langevin sampling")
        return [*backbone_phases(config), train, sampling]

    @classmethod
    def ledger_guarantee(cls, section: DPPMConfig) -> str:
        """``"none"`` in the paper's randomized-response mode (explicit opt-in), else ``"dp"``."""
        return "none" if section.privacy.mechanism == "randomized-response" else "dp"

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """The mechanisms :meth:`fit` records, from the resolved config and the (public) train size N only.

        DP-SGD mode: one subsampled Gaussian, σ calibrated to the target unless given. Paper mode: the
        randomized response, one pure-ε entry per step, listed for transparency under guarantee "none"
        (the plan has no target and claims no ε).
        """
        section = config.section
        training, privacy = section.training, config.privacy
        steps = training.private_training().total_steps(num_examples)
        if section.privacy.mechanism == "randomized-response":
            if training.batch_size > num_examples:
                raise ConfigError(
                    f"config key 'dppm.training.batch_size' = {training.batch_size}: randomized-response draws "
                    f"batches without replacement; expected at most the private train size {num_examples}"
                )
            response = PureEpsilon(RR_PHASE, privacy.epsilon, count=steps)
            return PrivacyPlan((response,), None, privacy.delta, privacy.accountant)
        return plan_with_dpsgd(
            privacy,
            (),
            name=DPSGD_MECHANISM,
            sample_rate=training.batch_size / num_examples,
            steps=steps,
            noise_multiplier=training.noise_multiplier,
        )

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """DP-SGD mode: the RefineNet on the label-embedded images ([C, H + 1, W]; latents in latent space), K noise
        draws per example;
        one sample batch is num_levels x iterations x leapfrog_steps score evaluations (HMC or Langevin).
        Randomized response trains no network with DP-SGD: none."""
        section = config.section
        if section.privacy.mechanism != "dp-sgd":
            return []
        image_shape, _ = planned_image_geometry(config.data)
        channels, height, width = latent_geometry(config, image_shape)
        sigmas = geometric_sigmas(section.noise.sigma_max, section.noise.sigma_min, section.noise.num_levels)
        refinenet = RefineNetConfig.from_preset(section.model.preset, channels, len(sigmas), section.model.width)

        def inputs(rows: int) -> tuple[torch.Tensor, ...]:
            return torch.zeros(rows, channels, height + 1, width), torch.zeros(rows, dtype=torch.long)

        calls = section.noise.num_levels * section.sampler.iterations * section.sampler.leapfrog_steps
        return [
            PrivateNetwork(
                key=f"{self.name}.training",
                build=lambda: RefineNet(refinenet, sigmas),
                inputs=inputs,
                training=section.training.private_training(),
                rows_per_example=section.training.multiplicity,
                exact=section.training.objective == "ssm",
                sample_calls=calls,
            )
        ]

    # -- training ------------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        config = ctx.section
        images, labels = ctx.data.train.to_tensors()
        self._backbone = load_backbone(ctx)
        if self._backbone is not None:  # each record encoded on its own: its latent depends on it alone
            images = encode_records(self._backbone, images)
        matrix = label_embedding_matrix(ctx.num_classes, images.shape[-1])
        embedded = embed_labels(images, labels, matrix)
        sigmas = geometric_sigmas(config.noise.sigma_max, config.noise.sigma_min, config.noise.num_levels)
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        model = (
            RefineNet(
                RefineNetConfig.from_preset(config.model.preset, embedded.shape[1], len(sigmas), config.model.width),
                sigmas,
            )
            .to(ctx.device)
            .train()
        )
        loss_fn = ScoreMatchingLoss(config.training.objective, sigmas)
        if config.privacy.mechanism == "dp-sgd":
            released = self._fit_dpsgd(ctx, config, model, loss_fn, embedded)
        else:
            released = self._fit_randomized_response(ctx, config, model, loss_fn, embedded)
        if self._backbone is not None:
            save_backbone(ctx, self._backbone)
        ctx.checkpoints.save(
            {
                "refinenet": dataclasses.asdict(model.config),
                "sigmas": sigmas,
                "state": released.state_dict(),
                "embedding": matrix,
            },
            phase=FINAL_PHASE,
        )
        self._model, self._matrix = released.eval(), matrix

    def _fit_dpsgd(
        self, ctx: RunContext, config: DPPMConfig, model: RefineNet, loss_fn: ScoreMatchingLoss, embedded: torch.Tensor
    ) -> torch.nn.Module:
        """DP-SGD through the shared driver: Poisson batches, per-example clipping, calibrated noise."""
        training = config.training
        shape, copies, levels = tuple(embedded.shape[1:]), training.multiplicity, config.noise.num_levels

        def make_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
            drawn = draw_perturbation(draws, copies, shape, levels, projections=loss_fn.differentiates_input)
            return {"u": embedded[indices], **drawn}

        # σ is the plan's (calibrated before any data was read), so the run spends exactly its plan.
        settings = training.private_training(ctx.plan.noise_multiplier(DPSGD_MECHANISM))
        engine = train_private(
            ctx,
            model,
            loss_fn,
            make_batch,
            ctx.data.train.record_keys,
            settings,
            mechanism=DPSGD_MECHANISM,
            desc="DPPM DP-SGD",
        )
        return engine.ema_model if engine.ema_model is not None else model

    def _fit_randomized_response(
        self, ctx: RunContext, config: DPPMConfig, model: RefineNet, loss_fn: ScoreMatchingLoss, embedded: torch.Tensor
    ) -> torch.nn.Module:
        """Algorithm 1 as published: uniform batches, Eq. 6 on the projections, plain gradient steps.

        This loop applies no clipping and no noise, so it is not a private training loop: nothing in it
        can be accounted, which is why it does not go through ``train_private``. The ledger (guarantee
        "none") lists the randomized response for transparency only.
        """
        training, epsilon, k = config.training, ctx.config.privacy.epsilon, config.privacy.top_k
        ctx.ledger.note(
            f"dppm paper mode: trained with the paper's randomized response (Eq. 6, nominal epsilon {epsilon:g}, "
            f"k = {k}) on data-independent projection vectors, without clipping or noise. This gives NO "
            "differential privacy guarantee, so no epsilon is claimed for this run."
        )
        count = len(embedded)
        settings = training.private_training()
        total = ctx.plan.mechanism(RR_PHASE).repeats
        optimizer = make_optimizer(list(model.parameters()), settings)
        ema = EMA(model, training.ema_decay) if training.ema_decay else None
        start = self._resume_rr(ctx, model, optimizer, ema)
        # Not a DP mechanism, so batches and perturbations come from a seeded stream (fresh after resume);
        # the response draws, like DP noise, never come from the run seed.
        batches = ctx.rng("augmentation", index=start)
        responses = torch.Generator().manual_seed(secrets.randbits(63))
        shape, levels = tuple(embedded.shape[1:]), config.noise.num_levels
        ctx.log(f"DPPM randomized response (NO guarantee): {total} steps, B={training.batch_size}, k={k}")
        steps = tqdm(range(start, total), initial=start, total=total, desc="DPPM randomized response", leave=False)
        for step in steps:
            indices = torch.randperm(count, generator=batches)[: training.batch_size]
            single = draw_perturbation(GeneratorDraws(len(indices), batches), 1, shape, levels, projections=True)
            drawn = {key: value.squeeze(1) for key, value in single.items()}
            drawn["v_r"], _ = randomized_response(drawn["v"], epsilon, k, responses)
            drawn = {key: value.to(ctx.device) for key, value in drawn.items()}
            ctx.ledger.charge(PureEpsilon(RR_PHASE, epsilon))  # recorded before the step uses the data
            loss = loss_fn.batch_losses(model, embedded[indices].to(ctx.device), drawn).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if ema is not None:
                ema.update(model)
            if (step + 1) % training.checkpoint_every == 0 or step + 1 == total:
                ctx.checkpoints.save(
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "ema": ema.state_dict() if ema else None,
                    },
                    phase=RR_PHASE,
                )
        return ema.model if ema is not None else model

    @staticmethod
    def _resume_rr(ctx: RunContext, model: RefineNet, optimizer: torch.optim.Optimizer, ema: EMA | None) -> int:
        state = ctx.checkpoints.load(phase=RR_PHASE)
        if not state:
            return 0
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        ctx.log(f"resumed {RR_PHASE} at step {state['step']}")
        return int(state["step"])

    # -- sampling ------------------------------------------------------------------------------
    def _load(self, ctx: RunContext) -> tuple[RefineNet, torch.Tensor]:
        if self._model is None or self._matrix is None:  # a fresh process (dpsynth generate)
            state = ctx.checkpoints.load(phase=FINAL_PHASE)
            if not state:
                raise ConfigError(f"{ctx.run_dir} has no trained DPPM model (checkpoints/{FINAL_PHASE}.pt)")
            model = RefineNet(RefineNetConfig(**state["refinenet"]), state["sigmas"])
            model.load_state_dict(state["state"])
            self._model, self._matrix = model.to(ctx.device).eval(), state["embedding"]
        if uses_latent_space(ctx.section) and self._backbone is None:
            self._backbone = restore_backbone(ctx)
        return self._model, self._matrix

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Audit hook: each (image, label) pair's denoising score-matching loss under the released model.

        The pair is embedded as in training (Fig. 5) and scored at every noise level with public noise, in
        both privacy modes alike (a model trained with sliced score matching is scored the same way), so
        the loss attack compares the DP-SGD and randomized-response runs on one footing."""
        model, matrix = self._load(ctx)
        x = uint8_to_tensor(images)
        if self._backbone is not None:  # scored where it was trained: on the pair's latent
            x = encode_records(self._backbone, x)
        embedded = embed_labels(x, torch.as_tensor(labels, dtype=torch.int64), matrix)
        return example_denoising_losses(model, embedded.to(ctx.device), model.sigmas).numpy()

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` samples by annealed HMC (or Langevin) from uniform noise; labels read off the label row."""
        config = ctx.section
        model, matrix = self._load(ctx)
        sampler = config.sampler
        settings = MCMCSettings(
            sampler=sampler.kind,
            iterations=sampler.iterations,
            leapfrog_steps=sampler.leapfrog_steps,
            step_size=sampler.step_size,
            step_decay_power=sampler.step_decay_power,
            kinetic=sampler.kinetic,
            metropolis=sampler.metropolis,
            denoise=sampler.denoise,
        )
        channels, height, width = ctx.image_shape if self._backbone is None else self._backbone.latent_shape
        shape = (channels, height + 1, width)
        generator = ctx.rng("sampling")
        batch_size = ctx.config.generate.batch_size
        images, labels, rates = [], [], []
        targets = torch.from_numpy(balanced_labels(num, ctx.num_classes))
        batches = range(0, num, batch_size)
        for start in tqdm(batches, desc=f"DPPM sampling ({sampler.kind})", unit="batch", leave=False):
            wanted = targets[start : start + batch_size]
            u, rate = self._sample_batch(
                model, matrix, wanted, shape, settings, sampler.label_row, generator, ctx.device
            )
            batch_images, batch_labels = split_embedding(u, matrix)
            if self._backbone is not None:  # latents are not in [-1, 1]: decode unclamped (the decoder clamps pixels)
                batch_images = self._backbone.decode(batch_images.to(ctx.device))
            images.append(tensor_to_uint8(batch_images.clamp(-1, 1)))
            labels.append(batch_labels.cpu())
            rates.append(rate)
        if settings.sampler == "hmc":
            ctx.log(f"DPPM sampling: mean Metropolis acceptance {sum(rates) / len(rates):.3f}")
        return Samples(images=np.concatenate(images), labels=torch.cat(labels).numpy())

    @staticmethod
    @torch.no_grad()
    def _sample_batch(
        model: RefineNet,
        matrix: torch.Tensor,
        wanted: torch.Tensor,
        shape: tuple[int, ...],
        settings: MCMCSettings,
        label_row: str,
        generator: torch.Generator,
        device: torch.device,
    ) -> tuple[torch.Tensor, float]:
        count = len(wanted)
        x = (torch.rand((count, *shape), generator=generator) * 2 - 1).to(device)  # NCSN: uniform start
        sigmas = model.sigmas

        def score(z: torch.Tensor, level: int) -> torch.Tensor:
            return model(z, torch.full((len(z),), level, dtype=torch.long, device=z.device))

        mask, on_level = None, None
        if label_row == "clamped":
            mask = label_row_mask(shape, device)
            rows = embed_labels(torch.zeros((count, shape[0], 0, shape[2]), device=device), wanted.to(device), matrix)

            def on_level(z: torch.Tensor, level: int) -> torch.Tensor:
                noise = torch.randn(rows.shape, generator=generator).to(device)
                z = z.clone()
                z[:, :, -1:] = rows + float(sigmas[level]) * noise
                return z

        result = annealed_sample(score, x, sigmas, settings, generator, mask=mask, on_level=on_level)
        u = result.x
        if label_row == "clamped":  # the clean row: the label is the one asked for
            u = torch.cat([u[:, :, :-1], rows], dim=2)
        return u, result.acceptance_rate
