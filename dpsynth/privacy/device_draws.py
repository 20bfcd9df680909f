"""Per-record draws computed on the device, bit for bit those of :class:`~dpsynth.privacy.record_draws.RecordDraws`.

A captured private step (:mod:`dpsynth.dpsgd.fixed_shape`) cannot read host numpy arrays: the draws of a record
(diffusion timesteps and noise, crops, label dropout) must come from device ops whose only inputs are the secret
key, the step, the record's content key and the call index. :class:`DeviceRecordDraws` evaluates the same
counter-based generator as ``RecordDraws`` (the SplitMix64 finaliser of Steele et al., "Fast splittable
pseudorandom number generators", OOPSLA 2014) in torch int64 ops: products wrap modulo 2^64 exactly as uint64
ones do, and a logical right shift is an arithmetic one masked to the low bits. The step is a device tensor, so
a graph captured once reads the step of each replay from it; the call index is part of the captured program (a
batch builder makes the same calls every step). Row ``i`` depends on ``record_keys[i]`` alone, so a record's draws
are the same wherever it sits in the fixed-shape buffer and whatever else was sampled.
"""

from __future__ import annotations

import torch

from dpsynth.privacy.record_draws import RecordRandomness, UniformDraws
from dpsynth.seeding import GOLDEN

_GOLDEN = int(GOLDEN)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 with the bits of ``value`` modulo 2^64."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_torch(z: torch.Tensor) -> torch.Tensor:
    """:func:`dpsynth.seeding.splitmix64` on int64 tensors holding uint64 bit patterns (wrapping arithmetic)."""
    z = (z ^ _shift_right(z, 30)) * _signed(_M1)
    z = (z ^ _shift_right(z, 27)) * _signed(_M2)
    return z ^ _shift_right(z, 31)


def stream_of(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The step's stream word, ``mix(mix(key) ^ mix((step + 1) * GOLDEN))``, as a 0-d int64 device tensor."""
    return splitmix64_torch(splitmix64_torch(key) ^ splitmix64_torch((step + 1) * _signed(_GOLDEN)))


class DeviceRecordDraws(UniformDraws):
    """The :class:`~dpsynth.privacy.record_draws.Draws` of ``record_keys`` (int64 bit patterns of the uint64
    content keys, on the device) at the step held in ``step`` (a 0-d int64 device tensor)."""

    def __init__(self, key: torch.Tensor, step: torch.Tensor, record_keys: torch.Tensor) -> None:
        if record_keys.dtype != torch.int64 or record_keys.dim() != 1:
            raise ValueError("device record keys must be an int64 vector (the uint64 content keys' bits)")
        self.count = record_keys.shape[0]
        self._bases = splitmix64_torch(record_keys ^ stream_of(key, step))
        self._calls = 0

    def _bits(self, size: int) -> torch.Tensor:
        self._calls += 1
        call = splitmix64_torch(self._bases + _signed(self._calls * _GOLDEN))
        offsets = torch.arange(1, size + 1, dtype=torch.int64, device=call.device) * _signed(_GOLDEN)
        return splitmix64_torch(call[:, None] + offsets[None, :])

    def _uniform(self, size: int) -> torch.Tensor:
        """float64 [count, size] in [0, 1) from the top 53 bits, as on the host."""
        return _shift_right(self._bits(size), 11).to(torch.float64) * 2.0**-53


class DeviceRecordRandomness:
    """A :class:`~dpsynth.privacy.record_draws.RecordRandomness` moved to ``device``: the content keys beside
    the images and the secret key as a device scalar (never read back to the host or written anywhere)."""

    def __init__(self, randomness: RecordRandomness, device: torch.device | str) -> None:
        keys = randomness.record_keys.astype("uint64").view("int64")
        self.record_keys = torch.from_numpy(keys.copy()).to(device)
        self._key = torch.tensor(_signed(randomness.secret_key()), dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return self.record_keys.shape[0]

    def draws(self, step: torch.Tensor, indices: torch.Tensor) -> DeviceRecordDraws:
        """The draws of the records at dataset positions ``indices`` (a device tensor) in the step held by ``step``."""
        return DeviceRecordDraws(self._key, step, self.record_keys[indices])

    def __repr__(self) -> str:  # never show the key
        return f"DeviceRecordRandomness({len(self)} records)"
