"""Which parameters a fine-tuning method trains: trainable-parameter selectors and LoRA adapters.

Partial fine-tuning of a publicly pre-trained diffusion model trains few parameters, so the DP noise
covers a small dimension:

* ``attention`` — DP-LDM (Liu et al., *Differentially Private Latent Diffusion Models*, arXiv:2305.15759,
  §3.2): only the attention blocks and the label embedder are trained, everything else stays at its
  public pre-trained value;
* ``lora`` — DP-LoRA (Tsai et al., *Differentially Private Fine-Tuning of Diffusion Models*,
  arXiv:2406.01355, §3): rank-r adapters ``W + (alpha / r) B A`` on the attention projections (``A``
  Gaussian, ``B`` zero, so the adapted model starts as the pre-trained one) plus the label embedder;
* ``all`` — every parameter (PDP-Diffusion, DPDM).

A frozen parameter gets ``requires_grad=False``: the DP-SGD engine computes per-example gradients, clips
and noises only the trainable ones, so the sensitivity C covers exactly what is released as trained. The
adapters are 1x1 convolutions (or Linear layers) over token tensors, so the engine's layer taps give
their per-example gradients as for any other layer. :func:`merge_lora_adapters` folds the adapters
back into the projections before release, so the released network is a plain UNet of the same spec.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dpsynth.errors import ConfigError
from dpsynth.models.unet import AttentionBlock

__all__ = [
    "TRAINABLE_SELECTORS",
    "LoRAAdapter",
    "add_lora_adapters",
    "merge_lora_adapters",
    "select_trainable",
]

TRAINABLE_SELECTORS = ("all", "attention", "lora")
# The label embedder trained with the attention blocks (DP-LDM §3.2) or the adapters (DP-LoRA §3).
_LABEL_EMBEDDER = "class_embedding"
_PROJECTIONS = ("qkv", "proj")


class LoRAAdapter(nn.Module):
    """``base(x) + (alpha / r) * up(down(x))`` around a frozen 1x1 ``Conv1d`` or ``Linear`` projection.

    ``down`` (r outputs) starts Gaussian with std 1/r and ``up`` at zero, as DP-LoRA's adapters (PEFT's
    "gaussian" initialisation), so the wrapped layer computes exactly the base layer at step 0.
    """

    def __init__(self, base: nn.Conv1d | nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ConfigError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.base.requires_grad_(False)
        self.scale = alpha / rank
        if isinstance(base, nn.Linear):
            self.down: nn.Module = nn.Linear(base.in_features, rank, bias=False)
            self.up: nn.Module = nn.Linear(rank, base.out_features, bias=False)
        elif isinstance(base, nn.Conv1d) and base.kernel_size == (1,) and base.groups == 1:
            self.down = nn.Conv1d(base.in_channels, rank, 1, bias=False)
            self.up = nn.Conv1d(rank, base.out_channels, 1, bias=False)
        else:
            raise TypeError(f"LoRA adapts Linear and 1x1 Conv1d projections, not {type(base).__name__}")
        nn.init.normal_(self.down.weight, std=1.0 / rank)
        nn.init.zeros_(self.up.weight)
        self.to(base.weight.device, base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.up(self.down(x))

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """A copy of the base projection with ``W + (alpha / r) B A`` folded in (the adapter is unchanged)."""
        up, down = self.up.weight, self.down.weight
        delta = self.scale * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1))
        merged = copy.deepcopy(self.base)
        merged.weight.add_(delta.reshape(merged.weight.shape))
        return merged


def _attention_blocks(model: nn.Module) -> list[tuple[str, AttentionBlock]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, AttentionBlock)]


def add_lora_adapters(model: nn.Module, rank: int, alpha: float) -> list[str]:
    """Wrap the ``qkv`` and ``proj`` projections of every attention block in a :class:`LoRAAdapter`.

    Returns the names of the adapted projections; a ConfigError if the model has no attention block."""
    blocks = _attention_blocks(model)
    if not blocks:
        raise ConfigError("LoRA fine-tuning needs a UNet with attention blocks (unet.attention_levels is empty)")
    adapted = []
    for block_name, block in blocks:
        for attribute in _PROJECTIONS:
            projection = getattr(block, attribute)
            if not isinstance(projection, LoRAAdapter):
                setattr(block, attribute, LoRAAdapter(projection, rank, alpha))
            adapted.append(f"{block_name}.{attribute}")
    return adapted


def merge_lora_adapters(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRAAdapter` in ``model`` by its merged projection (in place); returns ``model``."""
    for block in (module for _, module in _attention_blocks(model)):
        for attribute in _PROJECTIONS:
            projection = getattr(block, attribute)
            if isinstance(projection, LoRAAdapter):
                setattr(block, attribute, projection.merged())
    return model


def select_trainable(model: nn.Module, selector: str) -> int:
    """Set ``requires_grad`` by ``selector`` (:data:`TRAINABLE_SELECTORS`); returns the trainable count.

    ``attention``: the attention blocks and the label embedder; ``lora``: the adapters (added first by
    :func:`add_lora_adapters`) and the label embedder; ``all``: every parameter."""
    if selector not in TRAINABLE_SELECTORS:
        raise ConfigError(f"unknown trainable selector {selector!r}; choose one of {', '.join(TRAINABLE_SELECTORS)}")
    if selector == "all":
        model.requires_grad_(True)
        return sum(p.numel() for p in model.parameters())
    model.requires_grad_(False)
    embedder = getattr(model, _LABEL_EMBEDDER, None)
    trainable: list[nn.Module] = [] if embedder is None else [embedder]
    if selector == "attention":
        trainable += [block for _, block in _attention_blocks(model)]
    else:
        adapters = [module for module in model.modules() if isinstance(module, LoRAAdapter)]
        if not adapters:
            raise ConfigError("trainable: lora needs adapters; add them with add_lora_adapters first")
        trainable += [part for adapter in adapters for part in (adapter.down, adapter.up)]
    for module in trainable:
        module.requires_grad_(True)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count == 0:
        raise ConfigError(f"trainable: {selector} selects no parameter of this model (no attention block)")
    return count
