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
finaliser (Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014) used as a
counter-based generator. The record key is a hash of the record's own bytes and label
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

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_int(z: int) -> int:
    """SplitMix64's finaliser on a Python int (exact, for scalar keys)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors; multiplication wraps modulo 2^64 as in two's complement."""
    z = z ^ _shift_right(z, 30)
    z = z * _signed(_MIX1)
    z = z ^ _shift_right(z, 27)
    z = z * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


class Draws(Protocol):
    """Random inputs for ``count`` records: every method returns ``[count, *shape]``."""

    count: int

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor: ...


class RecordDraws:
    """Draws for the records with content keys ``record_keys`` at one step; row i depends on record i alone.

    Each call of :meth:`rand`, :meth:`randn` or :meth:`randint` takes the next sub-stream, so a batch
    builder that makes the same calls for every micro-batch gives each record the same inputs in
    whichever micro-batch, batch position or batch it lands.
    """

    def __init__(self, key: int, step: int, record_keys: torch.Tensor) -> None:
        if record_keys.dtype != torch.int64 or record_keys.dim() != 1:
            raise ValueError("record keys must be an int64 vector (content keys as int64 bit patterns)")
        stream = _mix_int(_mix_int(key) ^ _mix_int((int(step) + 1) * _GOLDEN))
        self.count = len(record_keys)
        self._bases = mix(record_keys.cpu() ^ _signed(stream))
        self._calls = 0

    def _bits(self, size: int) -> torch.Tensor:
        """int64 [count, size] of independent 64-bit patterns from this call's sub-stream."""
        self._calls += 1
        call = mix(self._bases + _signed(self._calls * _GOLDEN))
        offsets = torch.arange(1, size + 1, dtype=torch.int64) * _signed(_GOLDEN)
        return mix(call[:, None] + offsets[None, :])

    def _uniform(self, size: int) -> torch.Tensor:
        """float64 [count, size] in [0, 1) with 53 random bits each."""
        return _shift_right(self._bits(size), 11).to(torch.float64) * 2.0**-53

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
        record_keys: int64 [N], the content keys of the private records in dataset order.
        key: the secret key; ``None`` draws 64 bits of OS entropy that are never stored.
    """

    def __init__(self, record_keys: np.ndarray | torch.Tensor, key: int | None = None) -> None:
        if isinstance(record_keys, np.ndarray):
            record_keys = torch.from_numpy(np.ascontiguousarray(record_keys).view(np.int64))
        self.record_keys = record_keys.to(torch.int64).cpu()
        self._key = secrets.randbits(64) if key is None else int(key)

    @classmethod
    def for_tests(cls, record_keys: np.ndarray | torch.Tensor, key: int = 0) -> RecordRandomness:
        """A fixed key, so two batches can be compared draw for draw; never used by a run."""
        return cls(record_keys, key=key)

    def __len__(self) -> int:
        return len(self.record_keys)

    def draws(self, step: int, indices: torch.Tensor) -> RecordDraws:
        """The draws of the records at dataset positions ``indices`` in step ``step``."""
        return RecordDraws(self._key, step, self.record_keys[indices.cpu()])

    def __repr__(self) -> str:  # never show the key
        return f"RecordRandomness({len(self)} records)"
