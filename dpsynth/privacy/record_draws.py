"""Per-record randomness of private training that no other record can shift (docs/privacy.md,
"Per-record randomness").

A DP-SGD step clips one gradient per record, and the analysis assumes that adding or removing one
record changes the clipped sum by at most C. That holds only if every *other* record's gradient is
unchanged, so a record's random inputs (diffusion timesteps and noise, flips and crops, the latents
of the fakes paired with it, label dropout) must not depend on which other records are in the batch.
Drawing one ``[B, ...]`` tensor from a generator and indexing it by batch position breaks that: a
record inserted at the front shifts every later record's draws.

:class:`RecordDraws` therefore derives row ``i`` of every draw from (secret key, step, the record's
content key, the call's position in the batch builder, the element index) with the SplitMix64
finaliser (:func:`dpsynth.seeding.splitmix64`, the one the split uses too) as a counter-based
generator. The record key is a hash of the record's own bytes and label
(:func:`dpsynth.data.splits.content_keys`), so the draws of a record are the same whatever else
is sampled, and the clipped sums of neighbouring batches differ by exactly one record's term.

The secret key comes from OS entropy and is never written anywhere (not in the config, a
checkpoint or a log), like the DP noise: a published seed replays none of it. A fixed key is for
tests only (:meth:`RecordRandomness.for_tests`); the sensitivity argument does not need the key to
be secret, but the runs of a toolkit stay unreproducible in their private randomness by design.
"""

from __future__ import annotations

import math
import secrets
from typing import Protocol

import numpy as np
import torch

from dpsynth.seeding import GOLDEN, splitmix64


def _mix_scalar(value: int) -> np.uint64:
    """SplitMix64 of one value taken modulo 2^64."""
    return splitmix64(np.array([int(value) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]


class Draws(Protocol):
    """Random inputs for ``count`` records: every method returns ``[count, *shape]``."""

    count: int

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor: ...


class UniformDraws:
    """:class:`Draws` from a subclass's ``_uniform(size)``: float64 ``[count, size]`` in [0, 1) with 53 random
    bits each, one sub-stream a call. The host (:class:`RecordDraws`) and the device
    (:class:`~dpsynth.privacy.device_draws.DeviceRecordDraws`) share these transforms, so both give a record the
    same values from the same bits."""

    count: int

    def _uniform(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._uniform(math.prod(shape)).reshape(self.count, *shape).to(dtype)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        size = math.prod(shape)
        uniform = self._uniform(2 * size)
        # Box-Muller; 1 - u lies in (0, 1], so the logarithm is finite.
        radius = torch.sqrt(-2.0 * torch.log1p(-uniform[:, :size]))
        normal = radius * torch.cos(2.0 * math.pi * uniform[:, size:])
        return normal.reshape(self.count, *shape).to(dtype)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        if high <= low:
            raise ValueError(f"randint needs low < high, got [{low}, {high})")
        uniform = self._uniform(math.prod(shape))
        values = low + torch.floor(uniform * (high - low)).to(torch.int64)
        return values.clamp_max(high - 1).reshape(self.count, *shape)


class RecordDraws(UniformDraws):
    """Draws for the records with content keys ``record_keys`` at one step; row i depends on record i alone.

    Each call of :meth:`rand`, :meth:`randn` or :meth:`randint` takes the next sub-stream, so a batch
    builder that makes the same calls for every micro-batch gives each record the same inputs in
    whichever micro-batch, batch position or batch it lands.
    """

    def __init__(self, key: int, step: int, record_keys: np.ndarray) -> None:
        record_keys = np.asarray(record_keys)
        if record_keys.dtype != np.uint64 or record_keys.ndim != 1:
            raise ValueError("record keys must be a uint64 vector (dpsynth.data.splits.content_keys)")
        stream = _mix_scalar(int(_mix_scalar(key)) ^ int(_mix_scalar((int(step) + 1) * int(GOLDEN))))
        self.count = len(record_keys)
        self._bases = splitmix64(record_keys ^ stream)
        self._calls = 0

    def _bits(self, size: int) -> np.ndarray:
        """uint64 [count, size] of independent 64-bit patterns from this call's sub-stream."""
        self._calls += 1
        with np.errstate(over="ignore"):
            call = splitmix64(self._bases + np.uint64(self._calls) * GOLDEN)
            offsets = np.arange(1, size + 1, dtype=np.uint64) * GOLDEN
            return splitmix64(call[:, None] + offsets[None, :])

    def _uniform(self, size: int) -> torch.Tensor:
        """float64 [count, size] in [0, 1) with 53 random bits each."""
        return torch.from_numpy((self._bits(size) >> np.uint64(11)).astype(np.float64) * 2.0**-53)


class GeneratorDraws:
    """The :class:`Draws` interface over a torch generator: for public data and public probes only,
    where no neighbouring-dataset argument is needed."""

    def __init__(self, count: int, generator: torch.Generator | None = None) -> None:
        self.count = int(count)
        self.generator = generator

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand((self.count, *shape), generator=self.generator, dtype=dtype)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn((self.count, *shape), generator=self.generator, dtype=dtype)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, (self.count, *shape), generator=self.generator)


def as_draws(source: Draws | torch.Generator | None, count: int) -> Draws:
    """``source`` as per-record :class:`~dpsynth.privacy.record_draws.Draws`; a generator (or None, the
    global one) is accepted for public data only, where no record's draws need to be batch-independent."""
    if source is None or isinstance(source, torch.Generator):
        return GeneratorDraws(count, source)
    if source.count != count:
        raise ValueError(f"draws for {source.count} records, but the batch holds {count}")
    return source


class RecordRandomness:
    """The per-record randomness of one private training: a secret key and the records' content keys.

    Args:
        record_keys: uint64 [N], the content keys of the private records in dataset order.
        key: the secret key; ``None`` draws 64 bits of OS entropy that are never stored.
    """

    def __init__(self, record_keys: np.ndarray, key: int | None = None) -> None:
        self.record_keys = np.asarray(record_keys)
        self._key = secrets.randbits(64) if key is None else int(key)

    @classmethod
    def for_tests(cls, record_keys: np.ndarray, key: int = 0) -> RecordRandomness:
        """A fixed key, so two batches can be compared draw for draw; never used by a run."""
        return cls(record_keys, key=key)

    def __len__(self) -> int:
        return len(self.record_keys)

    def secret_key(self) -> int:
        """The key, for moving the same generator to a device (:mod:`dpsynth.privacy.device_draws`) only."""
        return self._key

    def draws(self, step: int, indices: torch.Tensor) -> RecordDraws:
        """The draws of the records at dataset positions ``indices`` in step ``step``."""
        return RecordDraws(self._key, step, self.record_keys[indices.cpu().numpy()])

    def __repr__(self) -> str:  # never show the key
        return f"RecordRandomness({len(self)} records)"
