"""PDP-Diffusion: public pre-training, then DP-Adam fine-tuning with augmentation multiplicity.

Paper: dp-diffusion-finetuning.txt (Ghalebikesabi et al.), §4, Algorithm 1, Tables 1 and 3.

1. Pre-training (§4 "Pre-training", Table 3 first column): a class-conditional diffusion model is
   trained without privacy on ``data.public`` (:mod:`dpsynth.diffusion.pretrain`, cached on disk).
   With no public data (or ``pretrain.enabled: false``) training starts from scratch, as in the
   paper's MNIST experiment (§5.3).
2. Fine-tuning (Algorithm 1): DP-Adam through :func:`dpsynth.dpsgd.training.train_private` with
   * augmentation multiplicity: each example appears as K copies, each with its own timestep,
     noise, random flip and random crop; the per-example loss averages the K copies, so the
     gradient is averaged *before* clipping (DESIGN.md privacy rule 3), K up to 128;
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
"""

from __future__ import annotations

from dpsynth.diffusion.method import SAMPLING_DEFAULTS, PretrainedDiffusionMethod
from dpsynth.methods.base import register_method


@register_method
class PDPDiffusion(PretrainedDiffusionMethod):
    name = "pdp-diffusion"
    summary = "public pre-training + DP-Adam fine-tuning with augmentation multiplicity, mixture-of-uniform timesteps, EMA"
    paper = "dp-diffusion-finetuning.txt"
    defaults = {
        # -- model (§5.2, Table 3: MNIST column unless noted) --
        "model": "4m",  # UNet preset: 0.8m, 1.8m, 4m (Table 3 MNIST), 6m, 16m, 80m (Table 3 CIFAR-10)
        "unet": {},  # overrides of the preset's UNetConfig fields, e.g. {base_channels: 16, channel_mult: [1, 2]}
        "learn_sigma": False,  # the paper trains ε only with L_simple
        "loss": "simple",  # simple (eq. 1) | hybrid (needs learn_sigma)
        "vlb_weight": 0.001,  # λ of the hybrid loss (unused with simple)
        "noise_schedule": "linear",  # Table 3: linear
        "timesteps": 1000,  # T
        "timestep_weights": [0.015, 0.785, 0.2],  # w_i of t ~ Σ w_i U{l_i, u_i} (Table 3, fine-tuning)
        "timestep_boundaries": [0, 30, 600, 1000],  # l_1, u_1 = l_2, ..., u_K on the T = 1000 scale
        "multiplicity": 128,  # K augmented copies per example, averaged before clipping (Table 3: 128)
        "flip": False,  # random horizontal flip per copy (Table 3: CIFAR-10/Camelyon17 yes, MNIST no)
        "crop_padding": 0,  # random crop after padding by this many pixels (reflect); 0 = no crop
        "label_dropout": 0.0,  # fraction of copies trained on the null class (enables guidance)
        # -- DP-Adam fine-tuning (Algorithm 1, Table 3) --
        "batch_size": 4096,  # expected logical batch B (Table 3: MNIST 4,096; CIFAR-10 16,384)
        "physical_batch_size": 16,  # examples per vmap call (each holds K copies); memory only
        "steps": 4000,  # DP iterations E (Table 3: MNIST 4,000; fine-tuning 200)
        "epochs": None,  # alternative to steps (steps overrides when both are set)
        "lr": 0.0005,  # constant learning rate (Table 3: MNIST 5e-4; fine-tuning 1e-3)
        "betas": [0.9, 0.999],  # Adam (β1, β2)
        "clip_norm": 0.001,  # C (§5.2: gradients of diffusion models are small)
        "noise_multiplier": None,  # σ; null = calibrated to the target ε (§4)
        "ema_decay": 0.9999,  # EMA of the released weights (Table 3)
        "checkpoint_every": 50,  # DP steps between checkpoints (resume granularity)
        "class_init": "null",  # private class rows start from: null (pre-trained null row) | mean (of public
        # rows) | names (the public row of the same class name, e.g. digit "3"; metadata only, no privacy cost)
        # -- public pre-training (Table 3, ImageNet32 column; cached, see dpsynth.diffusion.pretrain) --
        "pretrain": {
            "enabled": True,  # false (or no data.public): train from scratch (§5.3)
            "steps": 2000,  # iterations (Table 3: 200k on ImageNet32)
            "batch_size": 64,  # Table 3: 1,024
            "lr": 0.0002,  # Adam learning rate after warm-up
            "warmup_steps": 200,  # linear warm-up from 0 (Table 3: 5k steps)
            "ema_decay": 0.9999,  # EMA of the pre-trained weights; fine-tuning starts from the EMA
            "label_dropout": 0.1,  # null-class fraction: the null row learns p(x), used by class_init
            "timestep_weights": [0.03, 0.77, 0.2],  # Table 3, ImageNet32 column
            "timestep_boundaries": [0, 30, 800, 1000],
            "flip": False,  # random flips during pre-training
            "crop_padding": 0,  # random crops during pre-training
            "checkpoint_every": 500,  # steps between resumable snapshots in the cache
            "cache": True,  # reuse / store the model in $DPSYNTH_CACHE or ~/.cache/dpsynth
        },
        # -- sampling --
        **SAMPLING_DEFAULTS,
    }
