"""PDP-Diffusion: public pre-training, then DP-Adam fine-tuning with augmentation multiplicity.

Paper: Ghalebikesabi et al., *Differentially Private Diffusion Models Generate Useful Synthetic Images*,
arXiv:2302.13861, §4, Algorithm 1, Tables 1 and 3.

1. Pre-training (§4 "Pre-training", Table 3 first column): a class-conditional diffusion model is
   trained without privacy on ``data.public`` (:mod:`dpsynth.diffusion.pretrain`, cached on disk).
   With no public data (or ``pretrain.enabled: false``) training starts from scratch, as in the
   paper's MNIST experiment (§5.3).
2. Fine-tuning (Algorithm 1): DP-Adam through :func:`dpsynth.dpsgd.training.train_private` with
   * augmentation multiplicity: each example appears as K copies, each with its own timestep,
     noise, random flip and random crop; the per-example loss averages the K copies, so the
     gradient is averaged *before* clipping (docs/contract.md, privacy rule 3), K up to 128;
   * timesteps from the mixture of uniforms t ~ Σ w_i U{l_i, u_i} (§4 "Modified timestep
     sampling"; defaults (0.015, 0.785, 0.2) over {0, 30, 600, 1000}, Table 3);
   * constant learning rate, clip norm 1e-3, EMA 0.9999, logical batches up to 16,384 by virtual
     batching (``physical_batch_size`` examples per vmap call);
   * σ calibrated so that the fixed number of steps lands exactly on the target ε (§4 last paragraph).

Label spaces. The public label space differs from the private one (glyphs: 62 classes; mnist10k:
10). Pre-training is class-conditional on the *public* labels with label dropout, so the null class
learns the unconditional public distribution. For fine-tuning the class embedding is rebuilt with
the private classes, each row initialised to the pre-trained *null* row (``class_init: null``):
at step 0 the model is exactly the pre-trained unconditional model for every class, and DP
fine-tuning only has to separate the classes. Why not map labels: a glyph→digit mapping exists for
MNIST but not for FashionMNIST, CIFAR-10 or Camelyon17, and any mapping chosen by looking at the
private data would leak. ``class_init: names`` matches classes by their *names* instead, which are
dataset metadata (mnist10k's "3" and glyphs' "3"), never by looking at private images, so it
costs no privacy. The pre-trained model (and its cache entry) is independent of the
private data and reusable across private datasets of the same image shape.

Latent space (``space: latent``; pixel space, the paper's, is the default): pre-training, DP fine-tuning and
sampling run on the latents of the public backbone (the run's ``backbone`` section: a KL autoencoder trained on
``data.public``, cached; docs/backbone.md), as in latent diffusion (arXiv:2112.10752) and DP-LDM
(arXiv:2305.15759). The encoder is public and frozen and encodes each private image on its own, so the
per-example sensitivity of DP-Adam is unchanged; samples are decoded by the public decoder.
"""

from __future__ import annotations

from dpsynth.contract import register_method
from dpsynth.methods.families.diffusion import LatentSpaceSection, PretrainedDiffusionMethod, PretrainedDiffusionSection
from dpsynth.schema import with_defaults

PDPDiffusionPixelConfig = with_defaults(
    PretrainedDiffusionSection,
    "PDPDiffusionPixelConfig",
    "The ``pdp-diffusion`` section (§5.2, Table 3: MNIST column unless noted).",
    model="4m",  # Table 3 MNIST; CIFAR-10: 80m
    learn_sigma=False,  # the paper trains eps only, with L_simple
    loss="simple",
    noise_schedule="linear",  # Table 3
    timestep_weights=[0.015, 0.785, 0.2],  # Table 3, fine-tuning
    timestep_boundaries=[0, 30, 600, 1000],
    multiplicity=128,  # Table 3: 128 augmented copies per example
    batch_size=4096,  # Table 3: MNIST 4,096; CIFAR-10 16,384
    physical_batch_size=16,  # each example holds K copies
    steps=4000,  # Table 3: MNIST 4,000
    epochs=None,
    lr=0.0005,  # Table 3: MNIST 5e-4
    clip_norm=0.001,  # §5.2: gradients of diffusion models are small
    ema_decay=0.9999,  # Table 3
)


class PDPDiffusionConfig(PDPDiffusionPixelConfig, LatentSpaceSection):  # type: ignore[misc, valid-type]
    """The ``pdp-diffusion`` section (§5.2, Table 3: MNIST column unless noted), with ``space``."""


@register_method
class PDPDiffusion(PretrainedDiffusionMethod):
    name = "pdp-diffusion"
    summary = (
        "public pre-training + DP-Adam fine-tuning with augmentation multiplicity, mixture-of-uniform timesteps, EMA"
    )
    paper = (
        "Ghalebikesabi et al., Differentially Private Diffusion Models Generate Useful Synthetic Images, "
        "arXiv:2302.13861"
    )
    config_schema = PDPDiffusionConfig
