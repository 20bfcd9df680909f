"""Exponential moving average of model weights (used by PDP-Diffusion, Ghalebikesabi et al. (arXiv:2302.13861) §4).

The average is a function of the already privatised parameter sequence, so it costs no privacy.

Warm-up: with a fixed decay of 0.9999 the average still weighs the *initial* weights by
0.9999^n ≈ 0.97 after n = 300 updates, so a short run releases what is essentially the untrained
network (for a UNet with a zero-initialised output layer: ε̂ = 0, i.e. pure-noise samples). As in
the reference implementations of improved DDPM / TensorFlow's ``ExponentialMovingAverage(num_updates=...)``,
the decay of update ``n`` (``n`` = updates made before it) is ``min(decay, (1 + n) / (10 + n))``:
the average follows the weights closely early on and reaches the configured decay after about
``10 / (1 - decay)`` updates, so long runs are unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def warmed_up_decay(decay: float, num_updates: int) -> float:
    """``min(decay, (1 + n) / (10 + n))`` for the update that follows ``n`` earlier ones."""
    return min(float(decay), (1.0 + num_updates) / (10.0 + num_updates))


class EMA:
    """Keeps ``ema = d_n * ema + (1 - d_n) * params`` in a frozen copy of the model.

    ``d_n`` is :func:`warmed_up_decay` of the update count ``n`` (or the constant ``decay`` with
    ``warmup=False``). :meth:`state_dict` stores the weights *and* ``n`` so a resumed run continues
    the same average.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.num_updates = 0
        self.model = copy.deepcopy(model)
        self.model.requires_grad_(False)

    def current_decay(self) -> float:
        """The decay the next :meth:`update` will use."""
        return warmed_up_decay(self.decay, self.num_updates) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        weight = 1.0 - self.current_decay()
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in model.parameters()]
        # lerp_(x, w) = self + w (x - self): one fused update over all tensors.
        torch._foreach_lerp_(ema_params, params, weight)
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        """``{"weights": <model state dict>, "num_updates": n}``."""
        return {"weights": self.model.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a bare model state dict (older checkpoints) restarts the count at 0."""
        if "weights" in state and "num_updates" in state:
            self.model.load_state_dict(state["weights"])
            self.num_updates = int(state["num_updates"])
        else:
            self.model.load_state_dict(state)
            self.num_updates = 0
