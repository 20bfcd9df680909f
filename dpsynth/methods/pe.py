"""``pe``: Private Evolution, a population of public-model samples evolved by noisy nearest-neighbour votes.

Paper: Lin, Gopi, Kulkarni, Nori, Yekhanin, "Differentially Private Synthetic Data via Foundation Model APIs 1:
Images", ICLR 2024, arXiv:2305.15560 (Algorithm 1, Private Evolution; Algorithm 2, the DP nearest-neighbour
histogram). No model is trained on private data: only the vote histograms touch it.

* **API** (the paper's RANDOM_API and VARIATION_API): a class-conditional diffusion model pre-trained on
  ``data.public`` only, in the latent space of the public backbone (both cached and shared with every latent
  method: :func:`dpsynth.methods.families.diffusion.pretrain_public_model`). The random API draws ``population / K``
  latents per declared private class (K from the dataset's metadata, never from the labels present), conditioned
  on the null class, a random public class, or the public class of the same name (``random_api``). The variation
  API is SDEdit (:func:`dpsynth.diffusion.samplers.vary`): noise to a step of the respaced DDIM schedule given
  by the round's variation degree, then denoise.
* **Features** (a public function, no privacy cost): ``phi(x)`` = the backbone encoder's latent of a pixel image,
  flattened. A private image is embedded on its own; a candidate's embedding is the mean of ``phi`` over
  ``lookahead`` variations of it (decoded to pixels first), or ``phi`` of the candidate itself (lookahead 0).
* **Votes** (Algorithm 2): every private record adds 1 to each of its ``num_nearest`` nearest candidates (L2)
  among the candidates of its own class: a k-hot row of L2 norm ``sqrt(k)``. The K class histograms are one
  bounded-sum release (:mod:`dpsynth.privacy.bounded_sum`, bound ``sqrt(k)``, disjoint classes: parallel
  composition), so each round is ONE ``Gaussian("pe-votes", sigma)`` under add/remove-one adjacency; T rounds are
  one ledger entry with T repeats, sigma calibrated so that they meet the target exactly. The noisy histogram
  minus the threshold H, clipped at 0, is the resampling distribution (post-processing); an all-zero class
  falls back to uniform resampling.
* **Release**: the final population (the last round's variations of the resampled candidates), decoded by the
  public decoder to uint8 images at the private resolution, with their classes. ``generate(num)`` takes
  ``num // K`` (or one more) images per class from that fixed set, in a public random order, repeating a class's
  images only when more are asked for than it holds.

Randomness: the random API, the resampling and the variations draw from the run's public ``sampling`` stream
(they are not draws about private records); the DP noise comes from the run's noise source, never the seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.data.tensors import tensor_to_uint8
from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.samplers import sample, vary
from dpsynth.errors import ConfigError, DataError, PrivacyError
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
from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section
from dpsynth.seeding import stream_seed

MECHANISM = "pe-votes"
#: checkpoint phases: the population after each round, the released images
POPULATION_PHASE, FINAL_PHASE = "population", "final"
#: ``sampling`` stream indices: the random API, then per round the lookahead, the resampling, the variation
RANDOM_API, GENERATE = 0, 1
LOOKAHEAD, RESAMPLE, VARIATION = 0, 1, 2


def round_stream(round_index: int, use: int) -> int:
    """The ``sampling`` stream index of one use (lookahead copy, resampling, variation) in one round."""
    return 1000 * (round_index + 1) + use


RandomApi = Literal["unconditional", "public-labels", "names"]


class ApiPretrainSection(PretrainSection):
    """The shared public pre-training keys (the same cache entry as any latent preset with the same values), with
    what they mean for Private Evolution's API."""

    enabled: bool = Field(True, description="must stay true: pe's API is the model pre-trained on data.public")
    label_dropout: float = Field(
        0.1, ge=0, lt=1, description="null-class fraction: the null row learns p(x), the unconditional random API"
    )


class PESection(Section):
    """The ``pe`` section: the evolution (population, rounds, votes) and the public diffusion model used as API."""

    population: int = Field(
        2000, ge=1, description="N_syn, candidates per round, split evenly over the K declared classes (N_syn % K = 0)"
    )
    rounds: int = Field(5, ge=1, description="T, vote rounds (each one Gaussian release of the K class histograms)")
    variation_degrees: list[int] = Field(
        [8, 10, 12, 14, 16],
        min_length=1,
        description="one per round: DDIM steps (of sample_steps) skipped before a variation starts; 0 = start at the "
        "noisiest step (most variation), sample_steps - 1 = one denoising step (least); DPImageBench's convention",
    )
    lookahead: int = Field(
        2,
        ge=0,
        description="variations averaged into a candidate's embedding (the paper's lookahead); 0: the candidate itself",
    )
    threshold: float = Field(
        0.0, ge=0, description="H: subtracted from every noisy vote count before clipping at 0 (paper Algorithm 2)"
    )
    num_nearest: int = Field(
        1, ge=1, description="k: a private record votes for its k nearest candidates (L2 sensitivity sqrt(k))"
    )
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma of every round's vote histogram (noise std sigma*sqrt(k)); null: calibrated"
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
        if len(self.variation_degrees) != self.rounds:
            raise ValueError(
                f"variation_degrees needs one degree per round: {self.rounds} rounds, "
                f"{len(self.variation_degrees)} degrees"
            )
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


def declared_num_classes(data: Any) -> int | None:
    """K from the config's data section or the registered dataset's metadata; None when only the files know it."""
    if data.num_classes is not None:
        return int(data.num_classes)
    if data.class_names is not None:
        return len(data.class_names)
    from dpsynth.data.registry import resolve

    try:
        entry = resolve(data.private)[3]
    except DataError:
        return None
    return None if entry is None else int(entry.info.classes)


def check_population(section: PESection, num_classes: int) -> None:
    """ConfigError unless ``population`` splits evenly over K classes with at least ``num_nearest`` candidates each."""
    if section.population % num_classes:
        raise ConfigError(f"pe.population ({section.population}) must be divisible by the {num_classes} classes")
    if section.population // num_classes < section.num_nearest:
        raise ConfigError(
            f"pe.num_nearest ({section.num_nearest}) exceeds the {section.population // num_classes} candidates "
            "per class"
        )


def vote_rows(private: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor, num_nearest: int) -> torch.Tensor:
    """k-hot rows ``[n, M]``: record i marks its ``num_nearest`` nearest (L2) among its class's candidates.

    ``candidates`` is ``[K, M, D]`` (M per class), ``private`` ``[n, D]``, ``labels`` ``[n]``. A row depends on its
    own record only (and on the public candidates), so one record moves one class's histogram by its row.
    """
    rows = torch.zeros(len(private), candidates.shape[1], dtype=torch.float64)
    for label in labels.unique().tolist():
        members = (labels == label).nonzero().flatten()
        distances = torch.cdist(private[members].double(), candidates[label].double())
        nearest = distances.topk(num_nearest, dim=1, largest=False).indices
        rows[members.unsqueeze(1), nearest] = 1.0
    return rows


def resampling_weights(histogram: torch.Tensor, threshold: float) -> tuple[torch.Tensor, list[int]]:
    """``max(hist - H, 0)`` per class, an all-zero class made uniform; returns the weights and those classes.

    Post-processing of the released noisy histogram ``[K, M]``.
    """
    weights = (histogram - threshold).clamp(min=0.0)
    empty = (weights.sum(dim=1) <= 0).nonzero().flatten().tolist()
    for label in empty:
        weights[label] = 1.0
    return weights, empty


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
        self._released: tuple[np.ndarray, np.ndarray] | None = None

    # -- declared before any data is read ---------------------------------------------------------
    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        return [
            Phase("api", private=False, public="required", description="the public backbone and diffusion model"),
            Phase(
                "evolution",
                private=True,
                public="required",
                description="T rounds: noisy nearest-neighbour vote histograms, resampling, variations",
            ),
            Phase("generate", private=False),
        ]

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        check_declared_side(config.backbone, config.data)
        num_classes = declared_num_classes(config.data)
        if num_classes is not None:
            check_population(config.section, num_classes)

    @classmethod
    def pretrain_public_api(
        cls, config: RunConfig, public: Any, backbone: Backbone, *, device: Any, log: Callable[[str], None]
    ) -> PretrainResult:
        """The public API model, for ``dpsynth pretrain`` (:mod:`dpsynth.pretraining`) to build ahead of a run."""
        return pretrain_api(config, public, backbone, device=device, log=log)

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

    # -- the run -------------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        final = ctx.checkpoints.load(phase=FINAL_PHASE)
        if final is not None:
            self._released = (final["images"], final["labels"])
            return
        section: PESection = ctx.section
        num_classes = ctx.num_classes
        check_population(section, num_classes)
        if ctx.public is None:
            raise ConfigError("pe needs data.public: its API is a diffusion model pre-trained on it")
        per_class = section.population // num_classes
        saved = ctx.checkpoints.load(phase=POPULATION_PHASE)
        done = 0 if saved is None else int(saved["round"])
        charged = sum(m.repeats for m in ctx.ledger.mechanisms() if m.name == MECHANISM)
        if charged != done:
            raise PrivacyError(
                f"the ledger holds {charged} '{MECHANISM}' rounds but the checkpoint {done}: a round was charged and "
                "its population lost, so this run cannot end on its plan; start a new run"
            )
        api = PublicApi.load(ctx)
        if saved is None:
            latents, api_labels = api.random(ctx, num_classes, per_class)
            ctx.checkpoints.save({"round": 0, "latents": latents, "api_labels": api_labels}, phase=POPULATION_PHASE)
        else:
            latents, api_labels = saved["latents"], saved["api_labels"]
            ctx.log(f"pe: resumed after {done} of {section.rounds} rounds (already charged)")
        votes = PrivateVotes(ctx, api.backbone, section)
        query = section.query(ctx.plan.noise_multiplier(MECHANISM), num_classes)
        noise = ctx.noise_source()
        for round_index in range(done, section.rounds):
            degree = section.variation_degrees[round_index]
            embeddings = api.candidate_embeddings(ctx, latents, api_labels, degree, round_index)
            released = release_bounded_sum(
                votes.chunks(embeddings.reshape(num_classes, per_class, -1)),
                per_class,
                query,
                ctx.ledger,
                noise,
                registered=True,
            )
            weights, empty = resampling_weights(released.sums, section.threshold)
            generator = ctx.rng("sampling", round_stream(round_index, RESAMPLE))
            chosen = torch.multinomial(weights, per_class, replacement=True, generator=generator)
            chosen = (chosen + torch.arange(num_classes).unsqueeze(1) * per_class).flatten()
            latents = api.vary(ctx, latents[chosen], api_labels[chosen], degree, round_index, VARIATION)
            api_labels = api_labels[chosen]
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
            ctx.checkpoints.save(
                {"round": round_index + 1, "latents": latents, "api_labels": api_labels}, phase=POPULATION_PHASE
            )
        images = tensor_to_uint8(api.decode(latents))
        labels = np.repeat(np.arange(num_classes, dtype=np.int64), per_class)
        ctx.checkpoints.save({"images": images, "labels": labels}, phase=FINAL_PHASE)
        self._released = (images, labels)

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` released images, balanced over classes: class c's share in a public random order of its final
        candidates, repeated only when more are asked for than the class holds (post-processing)."""
        if self._released is None:
            final = ctx.checkpoints.load(phase=FINAL_PHASE)
            if final is None:
                raise ConfigError(f"{ctx.run_dir} holds no released pe population; run training first")
            self._released = (final["images"], final["labels"])
        images, labels = self._released
        return Samples(*balanced_draw(images, labels, num, stream_seed(ctx.seed, "sampling", GENERATE)))


def balanced_draw(images: np.ndarray, labels: np.ndarray, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``num`` of the (image, label) pairs, labels cycling over the classes, each class's images in a seeded order."""
    classes = np.unique(labels)
    rng = np.random.default_rng(seed)
    orders = {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in classes}
    wanted = classes[balanced_labels(num, len(classes))] if len(classes) else np.zeros(0, np.int64)
    taken = {int(c): 0 for c in classes}
    picks = []
    for label in wanted.tolist():
        order = orders[label]
        picks.append(order[taken[label] % len(order)])
        taken[label] += 1
    index = np.asarray(picks, dtype=np.int64)
    return images[index], labels[index].astype(np.int64)


def pretrain_api(
    config: RunConfig, public: Any, backbone: Backbone, *, device: Any, log: Callable[[str], None]
) -> PretrainResult:
    """The API's diffusion model: the section's UNet on the backbone's latents with the public label space, pre-trained
    on ``public`` only (the shared cache: :func:`dpsynth.methods.families.diffusion.pretrain_public_model`)."""
    section: PESection = config.section
    channels, side, width = backbone.latent_shape
    if side != width:
        raise ConfigError(f"pe needs square latents, got {side}x{width}")
    spec = unet_spec(section, channels, side, public.num_classes)
    return pretrain_public_model(config, public, str(config.data.public), spec, backbone, device=device, log=log)


class PublicApi:
    """The public model behind the random and variation APIs, and the public feature map, in latent space."""

    def __init__(self, model: torch.nn.Module, spec: DiffusionModelSpec, backbone: Backbone, section: PESection):
        self.model, self.spec, self.backbone, self.section = model, spec, backbone, section
        self.schedule = spec.schedule()
        self.public_classes = spec.num_classes

    @classmethod
    def load(cls, ctx: RunContext) -> PublicApi:
        backbone = load_public_backbone(ctx)
        result = pretrain_api(ctx.config, ctx.public, backbone, device=ctx.device, log=ctx.log)
        ctx.log(f"pe: API model {result.key} ({'cache hit' if result.cached else 'trained'})")
        return cls(result.model.eval(), result.spec, backbone, ctx.section)

    def random_labels(
        self, ctx: RunContext, num_classes: int, per_class: int, generator: torch.Generator
    ) -> torch.Tensor:
        """The public condition of every candidate, ``[K * M]`` (index ``public_classes`` is the null class)."""
        null = self.public_classes
        mode = self.section.random_api
        if mode == "public-labels":
            return torch.randint(0, self.public_classes, (num_classes * per_class,), generator=generator)
        rows = torch.full((num_classes,), null, dtype=torch.long)
        if mode == "names":
            public_names = list(ctx.public.class_names or ())
            private_names = list(ctx.data.train.class_names or ())
            if not private_names:
                raise ConfigError("pe.random_api: names needs class names on the private dataset; use unconditional")
            for label, name in enumerate(private_names[:num_classes]):
                if name in public_names:
                    rows[label] = public_names.index(name)
        return rows.repeat_interleave(per_class)

    def random(self, ctx: RunContext, num_classes: int, per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RANDOM_API: ``per_class`` latents for each of the K declared classes (class-major order)."""
        generator = ctx.rng("sampling", RANDOM_API)
        labels = self.random_labels(ctx, num_classes, per_class, generator)
        latents = sample(
            self.model,
            self.schedule,
            labels,
            self.spec_shape,
            sampler="ddim",
            steps=self.section.sample_steps,
            generator=generator,
            eta=self.section.eta,
            batch_size=self.section.api_batch_size,
            clip_denoised=False,
            progress=False,
            device=ctx.device,
        )
        return latents, labels

    @property
    def spec_shape(self) -> tuple[int, int, int]:
        return (self.spec.channels, self.spec.image_size, self.spec.image_size)

    def vary(
        self, ctx: RunContext, latents: torch.Tensor, labels: torch.Tensor, degree: int, round_index: int, index: int
    ) -> torch.Tensor:
        """VARIATION_API: one SDEdit variation of every latent at ``degree``; noise from the round's public stream."""
        generator = ctx.rng("sampling", round_stream(round_index, index))
        return vary(
            self.model,
            self.schedule,
            latents,
            labels,
            steps=self.section.sample_steps,
            skip=degree,
            generator=generator,
            eta=self.section.eta,
            batch_size=self.section.api_batch_size,
            clip_denoised=False,
            device=ctx.device,
        )

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of ``latents``, decoded a batch at a time on the backbone's device, on the CPU."""
        device = next(self.backbone.autoencoder.parameters()).device
        size = self.section.feature_batch_size
        chunks = [self.backbone.decode(chunk.to(device)).cpu() for chunk in latents.split(size)]
        return torch.cat(chunks) if chunks else torch.empty(0, *self.backbone.image_shape)

    def embed_pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The public feature map: the encoder's scaled latents, flattened, ``[N, D]`` float32 on the CPU."""
        return embed(self.backbone, images, self.section.feature_batch_size)

    def candidate_embeddings(
        self, ctx: RunContext, latents: torch.Tensor, labels: torch.Tensor, degree: int, round_index: int
    ) -> torch.Tensor:
        """Each candidate's embedding: the mean over ``lookahead`` variations at ``degree`` (0: its own)."""
        lookahead = self.section.lookahead
        if lookahead == 0:
            return self.embed_pixels(self.decode(latents))
        total = torch.zeros(len(latents), self.embed_dim, dtype=torch.float32)
        for copy in range(lookahead):
            varied = self.vary(ctx, latents, labels, degree, round_index, 10 * (copy + 1) + LOOKAHEAD)
            total += self.embed_pixels(self.decode(varied))
        return total / lookahead

    @property
    def embed_dim(self) -> int:
        channels, height, width = self.backbone.latent_shape
        return channels * height * width


def embed(backbone: Backbone, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The public feature map: ``flatten(backbone.encode(x))`` of every image (:func:`encode_records`: each image on
    its own, no batch statistics), ``[N, D]`` float32 on the CPU."""
    return encode_records(backbone, images.cpu(), batch_size).flatten(1).float()


class PrivateVotes:
    """The vote chunks of the private set: its embeddings (computed once, at the first release, after its charge;
    never logged or saved) turned into k-hot rows against each round's candidates."""

    def __init__(self, ctx: RunContext, backbone: Backbone, section: PESection) -> None:
        self.train, self.backbone, self.section = ctx.data.train, backbone, section
        self._embeddings: torch.Tensor | None = None

    def embeddings(self) -> torch.Tensor:
        if self._embeddings is None:  # each record encoded on its own, a chunk of records read at a time
            latents = encode_train_set(self.backbone, self.train, self.section.feature_batch_size)
            self._embeddings = latents.cpu().flatten(1).float()
        return self._embeddings

    def chunks(self, candidates: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(k-hot rows [n, M], labels [n])`` per chunk of private records; lazy: read after the charge."""
        embeddings = self.embeddings()
        size = self.section.feature_batch_size
        for start in range(0, len(embeddings), size):
            labels = torch.as_tensor(self.train.labels[start : start + size], dtype=torch.int64)
            if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= candidates.shape[0]):
                raise DataError(f"a label lies outside [0, {candidates.shape[0]})")
            yield vote_rows(embeddings[start : start + size], labels, candidates, self.section.num_nearest), labels
