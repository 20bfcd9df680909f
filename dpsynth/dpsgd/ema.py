"""Exponential moving average of model weights (used by PDP-Diffusion, dp-diffusion-finetuning.txt §4).

The average is a function of the already privatised parameter sequence, so it costs no privacy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """Keeps ``ema = decay * ema + (1 - decay) * params`` in a frozen copy of the model."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.model = copy.deepcopy(model)
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in model.parameters()]
        # lerp_(x, w) = self + w (x - self): one fused update over all tensors.
        torch._foreach_lerp_(ema_params, params, 1.0 - self.decay)
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
