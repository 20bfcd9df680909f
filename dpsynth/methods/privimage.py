"""PrivImage: DP semantic query, public-data selection, pre-training and DP fine-tuning (+D and +G).

Paper: privimage.txt (Li, Wang, Zhang et al., "PrivImage: Differentially Private Synthetic Image
Generation using Diffusion Models with Semantic-Aware Pretraining", arXiv:2311.12850), Algorithms 1-2,
Theorem 3.1, appendix B.

1. Selection (Algorithm 2, lines 2-18; :mod:`dpsynth.selection`): a classifier trained on the public
   labels (Eq. 4) gives every private image its top-k1 public classes; the per-class histogram is
   released with Gaussian noise std sqrt(k1)·σ_q (one ledger mechanism, ``semantic-query``, charged
   first so the fine-tuning σ is calibrated to what is left); every private class keeps its top-k2
   public classes and those public images, relabelled with the private class, form the pre-training
   set. k1 = k2 = k (appendix B). The selection is released: ``selection.json`` and
   ``figures/selection.png`` in the run directory.
2. PrivImage+D (``generator: diffusion``): PDP-Diffusion's flow on the selected subset —
   pre-training, then DP-Adam fine-tuning with augmentation multiplicity, mixture-of-uniform
   timesteps and EMA (:class:`dpsynth.diffusion.method.PretrainedDiffusionMethod`).
3. PrivImage+G (``generator: gan``): a conditional DCGAN (:mod:`dpsynth.models.gan`) pre-trained on
   the subset; DP fine-tuning trains only the discriminator with DP-SGD through
   :func:`dpsynth.dpsgd.training.train_private`; the generator learns only from the released
   discriminator (post-processing).

Soundness fixes against the reference code (stated in ``privacy.json``): the query noise is drawn
from the secure noise source, never from a fixed seed; re-using an earlier selection charges its
mechanism again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import pydantic
import torch
from pydantic import ConfigDict, Field

from dpsynth.contract import RunContext, Samples, register_method
from dpsynth.diffusion.method import SAMPLING_DEFAULTS, PretrainedDiffusionMethod
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.errors import ConfigError

SELECTION_PHASE = "selection"
GAN_MECHANISM = "dp-discriminator"
GAN_FINAL_PHASE = "final-gan"


class _Section(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid")


class SelectionConfig(_Section):
    k: int = Field(
        3,
        gt=0,
        description="public classes queried per private image and kept per private class "
        "(appendix B: k1 = k2 = k; paper: 5 for CIFAR-10, 10 for CelebA)",
    )
    k1: int | None = Field(None, gt=0, description="override of k for the query (L2 sensitivity sqrt(k1))")
    k2: int | None = Field(None, gt=0, description="override of k for the selection (top-k2 noisy counts)")
    conditional: bool = Field(
        True,
        description="one histogram row per private class, selected images relabelled "
        "with it; false: one histogram, public labels kept (CelebA)",
    )
    collisions: Literal["share", "exclusive"] = Field(
        "share",
        description="a public class in the top-k2 of "
        "several private classes: kept by each (share, as printed) or "
        "by the one where it ranks highest (exclusive)",
    )
    query_epsilon_share: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="the query alone is (share*eps, delta)-DP "
        "(analytic Gaussian); ignored when "
        "query_noise_multiplier is set",
    )
    query_noise_multiplier: float | None = Field(
        None, gt=0, description="sigma_q (cell noise std sqrt(k1)*sigma_q); the paper uses 484"
    )
    classifier: str = Field("cnn", description="semantic query classifier (dpsynth.models.classifiers)")
    classifier_preset: Literal["cpu", "gpu"] = Field("gpu", description="its width preset")
    classifier_epochs: int = Field(6, gt=0, description="epochs of Eq. 4 on the public data")
    classifier_batch_size: int = Field(128, gt=0, description="its batch size")
    classifier_lr: float = Field(1e-3, gt=0, description="its Adam learning rate")
    classifier_max_steps: int | None = Field(None, gt=0, description="cap on its steps (smoke runs)")
    cache: bool = Field(True, description="cache the semantic query classifier ($DPSYNTH_CACHE)")
    reuse: str | None = Field(
        None,
        description="an earlier run dir or selection.json on the SAME private data; "
        "its query mechanism is charged again to this run",
    )


class PretrainConfig(_Section):
    enabled: bool = Field(True, description="pre-train on the selected subset (false: from scratch)")
    steps: int = Field(2000, gt=0, description="pre-training iterations")
    batch_size: int = Field(64, gt=0, description="pre-training batch size")
    lr: float = Field(2e-4, gt=0, description="Adam learning rate after warm-up")
    warmup_steps: int = Field(200, ge=0, description="linear warm-up steps")
    ema_decay: float = Field(0.9999, ge=0, lt=1, description="EMA of the pre-trained weights")
    label_dropout: float = Field(0.1, ge=0, lt=1, description="null-class fraction during pre-training")
    timestep_weights: list[float] = Field([0.03, 0.77, 0.2], description="mixture weights w_i")
    timestep_boundaries: list[int] = Field([0, 30, 800, 1000], description="mixture boundaries l_i, u_i")
    flip: bool = Field(False, description="random flips during pre-training")
    crop_padding: int = Field(0, ge=0, description="random crops during pre-training")
    checkpoint_every: int = Field(500, gt=0, description="steps between resumable snapshots")
    cache: bool = Field(True, description="cache the pre-trained model")


class GANConfig(_Section):
    z_dim: int = Field(100, gt=0, description="latent size")
    generator_width: int = Field(80, gt=0, description="generator base width (80: ~1.8M parameters at 32x32)")
    discriminator_width: int = Field(64, gt=0, description="discriminator base width")
    pretrain_steps: int = Field(2000, ge=0, description="non-private GAN steps on the selected subset (0: none)")
    pretrain_batch_size: int = Field(64, gt=0, description="pre-training batch size")
    pretrain_lr: float = Field(2e-4, gt=0, description="pre-training Adam learning rate")
    batch_size: int = Field(256, gt=0, description="expected DP logical batch of the discriminator")
    physical_batch_size: int = Field(64, gt=0, description="examples per per-example-gradient call")
    steps: int = Field(200, gt=0, description="DP-SGD steps of the discriminator")
    lr: float = Field(2e-4, gt=0, description="discriminator and generator Adam learning rate")
    betas: list[float] = Field([0.5, 0.999], description="Adam betas (DCGAN)")
    clip_norm: float = Field(1.0, gt=0, description="per-example clip norm C of the discriminator")
    noise_multiplier: float | None = Field(None, gt=0, description="sigma; null = calibrated to the target")
    generator_steps: int = Field(1, ge=0, description="generator updates per discriminator step")
    generator_batch_size: int = Field(64, gt=0, description="latents per generator update")
    checkpoint_every: int = Field(50, gt=0, description="DP steps between checkpoints")
    cache: bool = Field(True, description="cache the pre-trained GAN")


class PrivImageConfig(_Section):
    generator: Literal["diffusion", "gan"] = Field("diffusion", description="PrivImage+D or PrivImage+G")
    selection: SelectionConfig = Field(default_factory=SelectionConfig, description="semantic query + selection")
    # -- PrivImage+D: the diffusion model (pdp-diffusion's keys; a light UNet as the paper recommends) --
    model: str = Field("1.8m", description="UNet preset (dpsynth.models.unet.UNET_PRESETS)")
    unet: dict[str, Any] = Field(default_factory=dict, description="overrides of the preset's UNetConfig")
    learn_sigma: bool = Field(False, description="learned variance (needs loss: hybrid)")
    loss: Literal["simple", "hybrid"] = Field("simple", description="diffusion loss")
    vlb_weight: float = Field(0.001, ge=0, description="lambda of the hybrid loss")
    noise_schedule: Literal["linear", "cosine"] = Field("linear", description="noise schedule")
    timesteps: int = Field(1000, gt=0, description="T")
    timestep_weights: list[float] = Field([0.015, 0.785, 0.2], description="fine-tuning mixture weights")
    timestep_boundaries: list[int] = Field([0, 30, 600, 1000], description="fine-tuning mixture boundaries")
    multiplicity: int = Field(128, gt=0, description="K augmented copies per example, averaged before clipping")
    flip: bool = Field(False, description="random horizontal flip per copy")
    crop_padding: int = Field(0, ge=0, description="random crop padding per copy")
    label_dropout: float = Field(0.0, ge=0, lt=1, description="null-class fraction in fine-tuning (guidance)")
    batch_size: int = Field(4096, gt=0, description="expected DP logical batch")
    physical_batch_size: int = Field(16, gt=0, description="examples per vmap call")
    steps: int | None = Field(4000, gt=0, description="DP steps (overrides epochs)")
    epochs: float | None = Field(None, gt=0, description="alternative to steps")
    lr: float = Field(5e-4, gt=0, description="constant DP-Adam learning rate")
    betas: list[float] = Field([0.9, 0.999], description="Adam betas")
    clip_norm: float = Field(0.001, gt=0, description="per-example clip norm C")
    noise_multiplier: float | None = Field(None, gt=0, description="sigma; null = calibrated to the target")
    ema_decay: float | None = Field(0.9999, ge=0, lt=1, description="EMA of the released weights")
    checkpoint_every: int = Field(50, gt=0, description="DP steps between checkpoints")
    class_init: Literal["null", "mean", "names"] = Field(
        "null",
        description="private class rows from the "
        "pre-trained model (unconditional selection only; a "
        "conditional selection already uses the private labels)",
    )
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="pre-training on the subset")
    sampler: Literal["ddim", "ddpm"] = Field(SAMPLING_DEFAULTS["sampler"], description="sampler")
    sample_steps: int | None = Field(SAMPLING_DEFAULTS["sample_steps"], gt=0, description="denoising steps")
    eta: float = Field(SAMPLING_DEFAULTS["eta"], ge=0, description="DDIM stochasticity")
    guidance: float = Field(SAMPLING_DEFAULTS["guidance"], ge=0, description="classifier-free guidance scale")
    variance: Literal["learned", "fixed_small", "fixed_large"] | None = Field(None, description="DDPM variance")
    gan: GANConfig = Field(default_factory=GANConfig, description="PrivImage+G settings")


def validate_section(section: dict[str, Any]) -> PrivImageConfig:
    """The typed section, or a one-line ConfigError naming the first bad key."""
    try:
        return PrivImageConfig.model_validate(section)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"privimage.{where}: {first['msg']}") from None


@register_method
class PrivImage(PretrainedDiffusionMethod):
    name = "privimage"
    summary = (
        "DP semantic query selects public pre-training data; then pdp-diffusion (+D) or a DP-discriminator GAN (+G)"
    )
    paper = "privimage.txt"
    config_schema: ClassVar = PrivImageConfig
    defaults = PrivImageConfig().model_dump()
    privacy_notes = (
        (
            "privimage: the semantic distribution (one histogram row per private class) is one Gaussian mechanism "
            "'semantic-query' with L2 sensitivity sqrt(k1) (Theorem 3.1) and noise from the secure noise source; "
            "one public re-implementation seeds this noise with 0, which gives no privacy."
        ),
        (
            "privimage: a selection re-used from an earlier run is charged again; PrivImage's reference code loads "
            "a cached selection and charges nothing for it."
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._subset: Any = None
        self._subset_key = ""
        self._conditional = True
        self._generator: torch.nn.Module | None = None

    # -- selection ---------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        config = validate_section(ctx.section)
        self.select(ctx, config)
        if config.generator == "gan":
            self.fit_gan(ctx, config)
        else:
            super().fit(ctx)

    def select(self, ctx: RunContext, config: PrivImageConfig) -> None:
        """Run (or resume, or re-use and re-charge) the selection and write its released files."""
        from dpsynth.privacy import NoiseSource
        from dpsynth.selection import (
            QUERY_MECHANISM,
            Selection,
            read_selection,
            reuse_selection,
            run_selection,
            write_selection,
        )
        from dpsynth.selection.pipeline import finish_selection
        from dpsynth.selection.semantic import train_semantic_query

        if ctx.public is None:
            raise ConfigError("privimage selects from public data: set data.public (e.g. glyphs)")
        settings = self._selection_settings(config)
        public_spec, private_spec = str(ctx.config["data"]["public"]), self._private_spec(ctx)
        saved = ctx.checkpoints.load(phase=SELECTION_PHASE)  # restores the ledger of a resumed run first
        if saved is not None and any(m.name == QUERY_MECHANISM for m in ctx.ledger.mechanisms()):
            query = train_semantic_query(
                ctx.public, public_spec, settings.query, device=ctx.device, use_cache=settings.cache, log=ctx.log
            )
            result = finish_selection(Selection.from_json(saved["selection"]), ctx.public, query)
            ctx.log("selection: resumed from the checkpoint (already charged)")
        elif config.selection.reuse:
            query = train_semantic_query(
                ctx.public, public_spec, settings.query, device=ctx.device, use_cache=settings.cache, log=ctx.log
            )
            result = reuse_selection(
                read_selection(config.selection.reuse),
                ctx.public,
                private_spec=private_spec,
                ledger=ctx.ledger,
                query=query,
            )
            ctx.log(f"selection: re-used {config.selection.reuse}, its mechanism charged again")
        else:
            noise = NoiseSource(secure=bool(ctx.config["privacy"]["secure_rng"]))
            result = run_selection(
                ctx.data.train,
                ctx.public,
                public_spec=public_spec,
                private_spec=private_spec,
                settings=settings,
                ledger=ctx.ledger,
                noise=noise,
                device=ctx.device,
                log=ctx.log,
            )
        selection = result.selection
        ctx.checkpoints.save({"selection": selection.to_json()}, phase=SELECTION_PHASE)
        write_selection(ctx.run_dir, selection, ctx.public.labels, result.sds)
        for row, classes in enumerate(selection.chosen):
            ctx.log(
                f"selection: class {selection.row_names[row]} <- "
                + ", ".join(f"{selection.semantic_names[s]} ({selection.noisy_counts[row, s]:.0f})" for s in classes)
            )
        ctx.log(
            f"selection: {result.ratio:.1%} of the {len(ctx.public)} public images selected "
            f"({len(result.subset)} pre-training images, shared classes counted once per class); "
            f"SDS full {result.sds.get('full', float('nan')):.3f}, "
            f"selected {result.sds.get('selected', float('nan')):.3f}"
        )
        self._subset, self._conditional = result.subset, selection.conditional
        self._subset_key = (
            f"{public_spec}|privimage-selection|{'/'.join(','.join(map(str, c)) for c in selection.chosen)}"
        )

    @staticmethod
    def _selection_settings(config: PrivImageConfig) -> Any:
        from dpsynth.selection import SelectionSettings, SemanticQuerySettings

        s = config.selection
        query = SemanticQuerySettings(
            classifier=s.classifier,
            preset=s.classifier_preset,
            epochs=s.classifier_epochs,
            batch_size=s.classifier_batch_size,
            lr=s.classifier_lr,
            max_steps=s.classifier_max_steps,
        )
        return SelectionSettings(
            k1=s.k1 or s.k,
            k2=s.k2 or s.k,
            conditional=s.conditional,
            collisions=s.collisions,
            query_epsilon_share=s.query_epsilon_share,
            query_noise_multiplier=s.query_noise_multiplier,
            query=query,
            cache=s.cache,
        )

    @staticmethod
    def _private_spec(ctx: RunContext) -> str:
        data = ctx.config["data"]
        extra = f"?max_train={data['max_train']}" if data.get("max_train") else ""
        return f"{data['private']}{extra}"

    # -- PrivImage+D hooks -------------------------------------------------------------------
    def pretraining_data(self, ctx: RunContext) -> tuple[Any, str] | None:
        return self._subset, self._subset_key

    def label_transfer(self, ctx: RunContext, public: Any) -> tuple[str, list[str] | None, list[str] | None]:
        if self._conditional:  # the subset already carries the private labels: copy every row
            return "names", public.class_names, public.class_names
        return super().label_transfer(ctx, public)

    # -- PrivImage+G -------------------------------------------------------------------------
    def fit_gan(self, ctx: RunContext, config: PrivImageConfig) -> None:
        """Pre-train the GAN on the subset, then DP-SGD the discriminator; the generator follows it."""
        from dpsynth.models.gan import (
            GANPretrainSettings,
            GANSpec,
            discriminator_loss,
            generator_step,
            pretrain_gan,
            transfer_gan,
        )

        gan = config.gan
        channels, height, width = ctx.image_shape
        if height != width:
            raise ConfigError(f"privimage needs square images, got {height}x{width}")
        spec = GANSpec(ctx.num_classes, channels, height, gan.z_dim, gan.generator_width, gan.discriminator_width)
        torch.manual_seed(ctx.seed)
        generator_net, discriminator = spec.build()
        if gan.pretrain_steps > 0:
            subset = self._subset
            public_spec = GANSpec(
                subset.num_classes, channels, height, gan.z_dim, gan.generator_width, gan.discriminator_width
            )
            pre_g, pre_d = pretrain_gan(
                subset,
                public_spec,
                GANPretrainSettings(gan.pretrain_steps, gan.pretrain_batch_size, gan.pretrain_lr, tuple(gan.betas)),
                seed=ctx.seed,
                public_spec=self._subset_key,
                device="cpu",
                use_cache=gan.cache,
                log=ctx.log,
            )
            transfer_gan(pre_g, generator_net)
            transfer_gan(pre_d, discriminator)
        generator_net, discriminator = generator_net.to(ctx.device), discriminator.to(ctx.device)
        g_optimizer = torch.optim.Adam(generator_net.parameters(), lr=gan.lr, betas=tuple(gan.betas))
        state = ctx.checkpoints.load(phase=GAN_MECHANISM)
        if state and state.get("extra"):
            generator_net.load_state_dict(state["extra"]["generator"])
            g_optimizer.load_state_dict(state["extra"]["optimizer"])
        images, labels = ctx.data.train.to_tensors()

        def make_batch(indices: torch.Tensor, rng: torch.Generator) -> dict[str, torch.Tensor]:
            # Fakes come from latents and random labels only: no private value enters them.
            count = len(indices)
            z = torch.randn(count, spec.z_dim, generator=rng)
            fake_labels = torch.randint(0, spec.num_classes, (count,), generator=rng)
            with torch.no_grad():
                fakes = (
                    generator_net(z.to(ctx.device), fake_labels.to(ctx.device)).cpu()
                    if count
                    else torch.zeros(0, channels, height, width)
                )
            return {"x": images[indices], "y": labels[indices], "fake": fakes, "fake_y": fake_labels}

        def loss_fn(model_call: Any, example: dict[str, torch.Tensor]) -> torch.Tensor:
            real = model_call(example["x"].unsqueeze(0), example["y"].unsqueeze(0))
            fake = model_call(example["fake"].unsqueeze(0), example["fake_y"].unsqueeze(0))
            return discriminator_loss(real, fake)

        g_rng = torch.Generator().manual_seed(ctx.seed + 4099)

        def generator_follows(step: int, engine: Any) -> float:
            # train_private's per-step hook runs before each DP step: the generator takes its updates
            # against the discriminator released so far (post-processing), then C is returned unchanged.
            for _ in range(gan.generator_steps if step > 0 else 0):
                generator_step(generator_net, discriminator, g_optimizer, gan.generator_batch_size, g_rng)
            return float(gan.clip_norm)

        settings = PrivateTraining(
            batch_size=gan.batch_size,
            lr=gan.lr,
            steps=gan.steps,
            optimizer="adam",
            betas=tuple(gan.betas),
            max_grad_norm=gan.clip_norm,
            noise_multiplier=gan.noise_multiplier,
            physical_batch_size=gan.physical_batch_size,
            checkpoint_every=gan.checkpoint_every,
        )
        train_private(
            ctx,
            discriminator,
            loss_fn,
            make_batch,
            len(ctx.data.train),
            settings,
            mechanism=GAN_MECHANISM,
            clip_norm_fn=generator_follows,
            state_extra=lambda: {"generator": generator_net.state_dict(), "optimizer": g_optimizer.state_dict()},
            desc="privimage+G discriminator",
        )
        for _ in range(gan.generator_steps):  # the generator also follows the final discriminator
            generator_step(generator_net, discriminator, g_optimizer, gan.generator_batch_size, g_rng)
        ctx.checkpoints.save(
            {"spec": dataclasses.asdict(spec), "generator": generator_net.state_dict()}, phase=GAN_FINAL_PHASE
        )
        self._generator = generator_net.eval()

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if validate_section(ctx.section).generator == "diffusion":
            return super().generate(ctx, num)
        if self._generator is None:
            self._generator = self._load_generator(ctx)
        return sample_generator(self._generator, num, ctx.num_classes, seed=ctx.seed + 17, device=ctx.device)

    @staticmethod
    def _load_generator(ctx: RunContext) -> torch.nn.Module:
        from dpsynth.models.gan import GANSpec

        state = ctx.checkpoints.load(phase=GAN_FINAL_PHASE)
        if not state:
            raise ConfigError("this privimage run has no trained generator (checkpoints/final-gan.pt)")
        generator_net, _ = GANSpec(**state["spec"]).build()
        generator_net.load_state_dict(state["generator"])
        return generator_net.to(ctx.device).eval()


@torch.no_grad()
def sample_generator(
    generator_net: torch.nn.Module,
    num: int,
    num_classes: int,
    *,
    seed: int,
    device: torch.device | str,
    batch: int = 500,
) -> Samples:
    """``num`` class-balanced samples from a conditional generator (public: reads no private data)."""
    rng = torch.Generator().manual_seed(seed)
    labels = torch.arange(num) % num_classes
    parts = []
    for start in range(0, num, batch):
        chunk = labels[start : start + batch]
        z = torch.randn(len(chunk), generator_net.z_dim, generator=rng)
        parts.append(generator_net(z.to(device), chunk.to(device)).cpu())
    images = (
        torch.cat(parts)
        if parts
        else torch.zeros(0, generator_net.channels, generator_net.image_size, generator_net.image_size)
    )
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return Samples(images=pixels, labels=labels.numpy())
