"""One cache for models pre-trained on public data only (docs/backbone.md).

A public pre-training (the latent backbone's autoencoder, PDP-Diffusion's pixel diffusion model) is free
(docs/contract.md, privacy rule 4) and often the longest phase on a CPU, so its result is stored once and
reused by every run, preset and process that asks for the same thing:

    <cache>/pretrained/<kind>/<key>.pt          the finished state (written last, atomically)
    <cache>/pretrained/<kind>/<key>.json        what the key covers, for a person reading the cache
    <cache>/pretrained/<kind>/<key>.partial.pt  resumable snapshots of an interrupted build

``<cache>`` is ``$DPSYNTH_CACHE`` or ``~/.cache/dpsynth`` (:func:`dpsynth.checkpoint.cache_dir`). ``key``
hashes the public data's *content* (:func:`public_content_key`: every record's content key, in order, with
the image shape and the label space) together with the caller's description of everything else that
determines the weights (model, training settings, seed). A changed public set, even one edited in place
under the same path, or a changed config gives another key and so a fresh build; an identical one is a
cache hit. Only public data may go in: the entries live in a shared user directory, outside any run's
trust boundary (docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.checkpoint import atomic_write, atomic_write_json, cache_dir

__all__ = ["CACHE_FORMAT", "CacheEntry", "Snapshots", "cache_entry", "load_or_build", "public_content_key"]

#: Part of every key: bump it when a stored state's layout changes, so old entries are never misread.
CACHE_FORMAT = 1


def public_content_key(dataset: Any) -> str:
    """A SHA-256 of a public ``ImageDataset``'s content: its records' content keys in order, shape and classes.

    ``record_keys`` hash each record's pixels and label (:func:`dpsynth.data.splits.content_keys`), so this
    changes with any edited, added, removed or reordered record (the order matters: training draws batches
    by position). Class names are part of it because they decide how a label space is transferred.
    """
    digest = hashlib.sha256()
    header = {
        "image_shape": list(dataset.image_shape),
        "num_classes": int(dataset.num_classes),
        "class_names": dataset.class_names,
        "records": len(dataset),
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(dataset.record_keys, dtype=np.uint64).tobytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Snapshots:
    """Where a resumable training loop keeps its state: ``save(state)`` and ``load() -> state | None``."""

    save: Callable[[dict[str, Any]], None]
    load: Callable[[], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cached pre-trained model: ``kind`` (a folder, e.g. ``autoencoder``) and ``key`` (its file stem)."""

    kind: str
    key: str
    directory: Path
    description: Mapping[str, Any]

    @property
    def path(self) -> Path:
        return self.directory / f"{self.key}.pt"

    @property
    def partial_path(self) -> Path:
        return self.directory / f"{self.key}.partial.pt"

    @property
    def manifest_path(self) -> Path:
        return self.directory / f"{self.key}.json"

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self) -> dict[str, Any]:
        import torch

        return torch.load(self.path, map_location="cpu", weights_only=False)

    def store(self, state: dict[str, Any]) -> None:
        """Write the finished state atomically (a reader sees the old entry or the whole new one), then its
        description, then drop the snapshots of the build."""
        import torch

        atomic_write(self.path, lambda f: torch.save(state, f))
        atomic_write_json(self.manifest_path, {"kind": self.kind, "key": self.key, **self.description})
        self.partial_path.unlink(missing_ok=True)

    def snapshots(self) -> Snapshots:
        """Resumable snapshots beside the entry: an interrupted build continues where it stopped."""
        import torch

        def save(state: dict[str, Any]) -> None:
            atomic_write(self.partial_path, lambda f: torch.save(state, f))

        def load() -> dict[str, Any] | None:
            if not self.partial_path.is_file():
                return None
            return torch.load(self.partial_path, map_location="cpu", weights_only=False)

        return Snapshots(save=save, load=load)


def cache_entry(kind: str, description: Mapping[str, Any], root: str | Path | None = None) -> CacheEntry:
    """The entry of ``kind`` whose key hashes ``description`` (JSON-able: the public content key, the model
    and training config, the seed) and :data:`CACHE_FORMAT`. ``root`` defaults to ``<cache>/pretrained``."""
    payload = {"format": CACHE_FORMAT, "kind": kind, **description}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    directory = Path(root) if root is not None else cache_dir() / "pretrained"
    return CacheEntry(kind=kind, key=key, directory=directory / kind, description=dict(description))


def load_or_build(
    entry: CacheEntry, build: Callable[[Snapshots | None], dict[str, Any]], use_cache: bool = True
) -> tuple[dict[str, Any], bool]:
    """``(state, cached)``: the stored state of ``entry``, or ``build(snapshots)``'s, stored for the next caller.

    With ``use_cache`` false nothing is read or written and ``build`` gets no snapshots.
    """
    if use_cache and entry.exists():
        return entry.load(), True
    state = build(entry.snapshots() if use_cache else None)
    if use_cache:
        entry.store(state)
    return state, False
