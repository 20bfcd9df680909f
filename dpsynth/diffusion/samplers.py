"""Samplers: DDPM ancestral sampling and DDIM, with optional classifier-free guidance.

* DDPM (Ho et al. 2020, Algorithm 2): x_{t-1} ~ N(μ_θ(x_t, t), Σ) with Σ fixed small (β̃_t), fixed
  large (β_t) or learned (improved DDPM's interpolation, Chu et al. (IEEE Access 2023) §III-A eq. 5).
  With ``steps < T`` the schedule is respaced (improved DDPM §4).
* DDIM (Song et al. 2021, eq. 12): x_{t-1} = √ᾱ_{t-1} x̂_0 + √(1-ᾱ_{t-1}-σ_t²) ε̂ + σ_t z with
  σ_t = η √((1-ᾱ_{t-1})/(1-ᾱ_t)) √(1-ᾱ_t/ᾱ_{t-1}); η = 0 is deterministic, η = 1 is DDPM-like.
* SDEdit variation (Meng et al., arXiv:2108.01073): :func:`vary` noises given images to an intermediate step
  of the respaced schedule and denoises them from there with DDIM; the later the start, the closer the
  result stays to the input (Private Evolution's variation API, arXiv:2305.15560).
* Classifier-free guidance (Ho & Salimans 2021): ε̃ = (1 + w) ε_θ(x, y) - w ε_θ(x, ∅), with ∅ the
  model's null class (index ``num_classes``). ``w = 0`` is exactly the conditional model.

The model is any callable ``model(x [N,C,H,W], t [N], y [N] | None) -> [N, C or 2C, H, W]``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from dpsynth.diffusion.schedules import DiffusionSchedule, split_output
from dpsynth.errors import ConfigError

__all__ = ["sample", "vary", "guided_model_output", "ddpm_step", "ddim_step", "SAMPLERS", "VARIANCES"]

SAMPLERS = ("ddpm", "ddim")
VARIANCES = ("learned", "fixed_small", "fixed_large")
Model = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def guided_model_output(
    model: Model,
    x: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor | None,
    guidance: float,
    null_label: int | None,
    learn_sigma: bool,
) -> torch.Tensor:
    """Model output with classifier-free guidance applied to the ε channels.

    The variance channels (if learned) come from the conditional pass, as in GLIDE. ``guidance = 0``
    returns the conditional output unchanged (one model call).
    """
    conditional = model(x, t, labels)
    if guidance == 0.0 or labels is None:
        return conditional
    if null_label is None:
        raise ConfigError("classifier-free guidance needs a class-conditional model with a null class")
    unconditional = model(x, t, torch.full_like(labels, null_label))
    eps_cond, v = split_output(conditional, learn_sigma)
    eps_uncond, _ = split_output(unconditional, learn_sigma)
    eps = (1.0 + guidance) * eps_cond - guidance * eps_uncond
    return eps if v is None else torch.cat([eps, v], dim=-3)


def ddpm_step(
    schedule: DiffusionSchedule,
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    variance: str,
    learn_sigma: bool,
    clip_denoised: bool = True,
) -> torch.Tensor:
    """One ancestral step x_t → x_{t-1} (no noise is added at t = 0)."""
    p = schedule.p_mean_log_variance(model_output, x_t, t, variance, learn_sigma, clip_denoised)
    not_last = (t != 0).to(x_t.dtype).reshape(t.shape + (1,) * (x_t.dim() - t.dim()))
    return p["mean"] + not_last * torch.exp(0.5 * p["log_variance"]) * noise


def ddim_step(
    schedule: DiffusionSchedule,
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    eta: float,
    learn_sigma: bool,
    clip_denoised: bool = True,
) -> torch.Tensor:
    """One DDIM step on a (respaced) schedule: index ``t`` → ``t - 1`` (Song et al. eq. 12)."""
    eps, _ = split_output(model_output, learn_sigma)
    x0 = schedule.predict_x0(x_t, t, eps)
    if clip_denoised:
        x0 = x0.clamp(-1.0, 1.0)
        eps = schedule.predict_eps(x_t, t, x0)
    shape = t.shape + (1,) * (x_t.dim() - t.dim())
    alpha_bar = schedule.alphas_cumprod.to(t.device)[t].reshape(shape)
    alpha_bar_prev = schedule.alphas_cumprod_prev.to(t.device)[t].reshape(shape)
    sigma = eta * torch.sqrt((1 - alpha_bar_prev) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_prev))
    direction = torch.sqrt((1 - alpha_bar_prev - sigma**2).clamp(min=0.0)) * eps
    not_last = (t != 0).to(x_t.dtype).reshape(shape)
    return torch.sqrt(alpha_bar_prev) * x0 + direction + not_last * sigma * noise


def _model_device(model: Model) -> torch.device:
    if isinstance(model, nn.Module):
        for parameter in model.parameters():
            return parameter.device
    return torch.device("cpu")


def _check_options(
    sampler: str, variance: str, steps: int | None, schedule: DiffusionSchedule, learn_sigma: bool
) -> None:
    if sampler not in SAMPLERS:
        raise ConfigError(f"unknown sampler {sampler!r}; choose one of {list(SAMPLERS)}")
    if variance not in VARIANCES:
        raise ConfigError(f"unknown variance {variance!r}; choose one of {list(VARIANCES)}")
    if variance == "learned" and sampler == "ddpm" and not learn_sigma:
        raise ConfigError("variance 'learned' needs a model with learn_sigma=True")
    if steps is not None and not 1 <= steps <= schedule.num_timesteps:
        raise ConfigError(f"steps must be in [1, {schedule.num_timesteps}], got {steps}")


@torch.no_grad()
def sample(
    model: Model,
    schedule: DiffusionSchedule,
    labels: torch.Tensor | Sequence[int] | None,
    shape: Sequence[int],
    sampler: str = "ddim",
    steps: int | None = 100,
    guidance: float = 0.0,
    generator: torch.Generator | None = None,
    *,
    eta: float = 0.0,
    variance: str | None = None,
    learn_sigma: bool | None = None,
    null_label: int | None = None,
    batch_size: int = 256,
    clip_denoised: bool = True,
    progress: bool = True,
    device: torch.device | str | None = None,
    num_samples: int | None = None,
) -> torch.Tensor:
    """Draw images in [-1, 1] (with ``clip_denoised=False``: unclamped, e.g. latents), on the CPU as ``[N, C, H, W]``.

    Args:
        model: ε-prediction network ``model(x, t, y)`` (a :class:`~dpsynth.models.unet.UNet` or any callable).
        schedule: the training schedule (T steps); respaced to ``steps`` here.
        labels: class per sample ``[N]``; ``None`` draws ``num_samples`` unconditional samples (null class).
        shape: image shape ``(C, H, W)`` (a leading N, if given, must match).
        sampler: ``"ddim"`` or ``"ddpm"``; ``steps``: number of denoising steps (None = T).
        guidance: classifier-free guidance scale w (0 = conditional model).
        generator: source of the initial and per-step noise (a CPU generator; noise is moved to the model).
        eta: DDIM stochasticity; variance: DDPM Σ, default "learned" if the model learns it else "fixed_small".
        learn_sigma / null_label: read from the model (``UNet.learn_sigma``, ``UNet.null_class``) when omitted.
        batch_size: images per model call; progress: tqdm bar on stderr.
    """
    learn_sigma = bool(getattr(model, "learn_sigma", False)) if learn_sigma is None else learn_sigma
    if null_label is None and getattr(model, "num_classes", 0):
        null_label = model.null_class
    variance = variance or ("learned" if learn_sigma else "fixed_small")
    _check_options(sampler, variance, steps, schedule, learn_sigma)
    image_shape = tuple(int(s) for s in shape)[-3:]
    if labels is not None:
        labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
        num_samples = labels.numel()
    if num_samples is None:
        raise ConfigError("give labels or num_samples")
    if len(shape) == 4 and int(shape[0]) != num_samples:
        raise ConfigError(f"shape {tuple(shape)} does not match {num_samples} labels")
    device = torch.device(device) if device is not None else _model_device(model)
    spaced = schedule.respace(steps) if steps is not None and steps != schedule.num_timesteps else schedule

    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()  # dropout off while sampling; the caller's mode is restored below
    chunks = []
    total_steps = spaced.num_timesteps * ((num_samples + batch_size - 1) // batch_size)
    with tqdm(total=total_steps, file=sys.stderr, disable=not progress, desc=f"sampling ({sampler})") as bar:
        for start in range(0, num_samples, batch_size):
            n = min(batch_size, num_samples - start)
            batch_labels = None if labels is None else labels[start : start + n].to(device)
            chunks.append(
                _sample_batch(
                    model,
                    spaced,
                    batch_labels,
                    (n, *image_shape),
                    sampler,
                    guidance,
                    generator,
                    eta,
                    variance,
                    learn_sigma,
                    null_label,
                    clip_denoised,
                    device,
                    bar,
                ).cpu()
            )
    if was_training:
        model.train()
    if not chunks:
        return torch.empty(0, *image_shape)
    # Pixels live in [-1, 1]; a latent space (clip_denoised=False) has no such bound, so its samples stay as drawn.
    return torch.cat(chunks).clamp(-1.0, 1.0) if clip_denoised else torch.cat(chunks)


def _sample_batch(
    model: Model,
    schedule: DiffusionSchedule,
    labels: torch.Tensor | None,
    shape: tuple[int, ...],
    sampler: str,
    guidance: float,
    generator: torch.Generator | None,
    eta: float,
    variance: str,
    learn_sigma: bool,
    null_label: int | None,
    clip_denoised: bool,
    device: torch.device,
    bar: tqdm,
) -> torch.Tensor:
    x = torch.randn(shape, generator=generator).to(device)
    for index in reversed(range(schedule.num_timesteps)):
        t = torch.full((shape[0],), index, dtype=torch.long, device=device)
        output = guided_model_output(
            model, x, schedule.to_model_timesteps(t), labels, guidance, null_label, learn_sigma
        )
        noise = torch.randn(shape, generator=generator).to(device)
        if sampler == "ddpm":
            x = ddpm_step(schedule, output, x, t, noise, variance, learn_sigma, clip_denoised)
        else:
            x = ddim_step(schedule, output, x, t, noise, eta, learn_sigma, clip_denoised)
        bar.update(1)
    return x


@torch.no_grad()
def vary(
    model: Model,
    schedule: DiffusionSchedule,
    images: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    steps: int,
    skip: int,
    generator: torch.Generator | None = None,
    eta: float = 0.0,
    learn_sigma: bool | None = None,
    batch_size: int = 256,
    clip_denoised: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """SDEdit variations of ``images [N, C, H, W]`` (pixels, or latents with ``clip_denoised=False``), on the CPU.

    The schedule is respaced to ``steps`` DDIM steps (indices ``0 .. steps - 1``, the last the noisiest). Each
    image is noised to index ``steps - 1 - skip`` by the forward process and denoised from there by
    ``steps - skip`` DDIM steps, conditioned on ``labels`` (None: the null class of a class-conditional model).
    ``skip`` is DPImageBench's Private Evolution "variation degree": 0 starts at the noisiest step (the most
    variation), ``steps - 1`` takes one denoising step (the least). Noise comes from ``generator``.
    """
    learn_sigma = bool(getattr(model, "learn_sigma", False)) if learn_sigma is None else learn_sigma
    _check_options("ddim", "fixed_small", steps, schedule, learn_sigma)
    if not 0 <= skip < steps:
        raise ConfigError(f"a variation skips 0 to {steps - 1} of the {steps} steps, got {skip}")
    device = torch.device(device) if device is not None else _model_device(model)
    spaced = schedule.respace(steps) if steps != schedule.num_timesteps else schedule
    start = spaced.num_timesteps - 1 - skip
    if labels is None and getattr(model, "num_classes", 0):
        labels = torch.full((len(images),), int(model.null_class), dtype=torch.long)
    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()
    chunks = []
    for begin in range(0, len(images), batch_size):
        x0 = images[begin : begin + batch_size].to(device)
        batch_labels = None if labels is None else labels[begin : begin + batch_size].to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        t = torch.full((len(x0),), start, dtype=torch.long, device=device)
        x = spaced.q_sample(x0, t, noise)
        for index in reversed(range(start + 1)):
            t = torch.full((len(x0),), index, dtype=torch.long, device=device)
            output = model(x, spaced.to_model_timesteps(t), batch_labels)
            step_noise = torch.randn(x0.shape, generator=generator).to(device)
            x = ddim_step(spaced, output, x, t, step_noise, eta, learn_sigma, clip_denoised)
        chunks.append(x.cpu())
    if was_training:
        model.train()
    if not chunks:
        return torch.empty(0, *images.shape[1:])
    result = torch.cat(chunks)
    return result.clamp(-1.0, 1.0) if clip_denoised else result
