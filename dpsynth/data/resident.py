"""A private train set resident on the training device, gathered by device indices.

The fixed-shape private step (:mod:`dpsynth.dpsgd.fixed_shape`) gathers its batch on the device: a CUDA graph
cannot read host arrays. :class:`ResidentRecords` copies every record's model input (and label) to the device at
the first gather, so a run whose step stays eager never copies the set, and a memory-mapped set is read whole only
when the captured step asks for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Records = tuple[torch.Tensor, torch.Tensor | None]


class ResidentRecords:
    """``records(indices) -> (inputs[indices], labels[indices] or None)`` on ``device``; ``load()`` gives every
    record's input and label (None: unlabelled) and is called once, at the first gather."""

    def __init__(self, load: Callable[[], Records], device: torch.device | str) -> None:
        self._load, self.device = load, torch.device(device)
        self._records: Records | None = None

    def __call__(self, indices: torch.Tensor) -> Records:
        if self._records is None:
            inputs, labels = self._load()
            self._records = (inputs.to(self.device), None if labels is None else labels.to(self.device))
        inputs, labels = self._records
        return inputs[indices], None if labels is None else labels[indices]
