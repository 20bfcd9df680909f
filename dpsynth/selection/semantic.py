"""The semantic query function of PrivImage (Li et al., arXiv:2311.12850, §3.2, Eq. 4).

A classifier ``Q`` is trained, without privacy, on the *public* dataset's own labels (its
"semantics": ImageNet's 1,000 categories in the paper, the 62 glyph characters here) with the
cross-entropy of Eq. 4. Applied to an image it returns the image's top-k1 public classes.

Training reads public data only, so it costs no privacy; the trained model is cached on disk under
a key made from the public data (spec *and* content fingerprint), the image shape, the classifier
and its training settings, so every run with the same public set reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpsynth.checkpoint import atomic_write, cache_dir
from dpsynth.errors import DataError

CACHE_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SemanticQuerySettings:
    """How the semantic query classifier is trained (non-private; public data only)."""

    classifier: str = "cnn"  # any name of dpsynth.models.classifiers.build_classifier
    preset: str = "gpu"  # classifier width preset: gpu (the full-width network) | cpu (a smaller one)
    epochs: int = 3
    batch_size: int = 128
    lr: float = 1e-3
    max_steps: int | None = None  # cap on optimisation steps (smoke runs)
    seed: int = 0


@dataclasses.dataclass
class SemanticQuery:
    """A trained semantic query function: ``topk(images, k)`` -> public class indices."""

    model: torch.nn.Module
    num_semantics: int
    key: str
    cached: bool

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """``Q(x)``: softmax over the public classes, float32 ``[N, NS]`` (images in [-1, 1], NCHW)."""
        self.model.eval()
        device = next(self.model.parameters()).device
        parts = [
            torch.softmax(self.model(images[i : i + batch_size].to(device)).float(), dim=1).cpu()
            for i in range(0, len(images), batch_size)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, self.num_semantics)

    def topk(self, images: torch.Tensor, k: int, batch_size: int = 512) -> torch.Tensor:
        """The top-k public classes of every image, int64 ``[N, k]`` (§3.2: "top-k1 probable semantics")."""
        if not 1 <= k <= self.num_semantics:
            raise DataError(f"k1 must be in [1, {self.num_semantics}] (the public classes), got {k}")
        return self.probabilities(images, batch_size).topk(k, dim=1).indices

    def class_profiles(self, public: Any) -> np.ndarray:
        """``V(s)`` for the SDS of Eq. 5: the mean ``Q(x)`` over the public images of class ``s``.

        The paper embeds each semantic *word* with a text encoder; no such encoder ships here, so a
        class is represented by what the query function itself sees in it (rows of its confusion
        profile). Classes it confuses (glyph "0" and "O") come out similar, unrelated ones near 0.
        Public data only, so it costs no privacy.
        """
        return self.profile_public(public)[0]

    def profile_public(self, public: Any) -> tuple[np.ndarray, float]:
        """``(class profiles, accuracy on the public set)`` from one pass over the public images.

        The accuracy of Eq. 4's classifier on its own (public) training data is public: it may be logged
        and released.
        """
        images, labels = public.to_tensors()
        probabilities = self.probabilities(images).double().numpy()
        profiles = np.zeros((self.num_semantics, self.num_semantics))
        np.add.at(profiles, labels.numpy(), probabilities)
        counts = np.bincount(labels.numpy(), minlength=self.num_semantics)[:, None]
        accuracy = float((probabilities.argmax(1) == labels.numpy()).mean()) if len(labels) else 0.0
        return profiles / np.maximum(counts, 1), accuracy


def public_fingerprint(public: Any) -> str:
    """SHA-256 of a dataset's pixels and labels (an edited file never hits a stale cache entry)."""
    digest = hashlib.sha256()
    digest.update(str(public.images.shape).encode())
    digest.update(np.ascontiguousarray(public.images).tobytes())
    digest.update(np.ascontiguousarray(public.labels, dtype=np.int64).tobytes())
    return digest.hexdigest()


def semantic_query_key(public: Any, public_spec: str, settings: SemanticQuerySettings) -> str:
    payload = {
        "version": CACHE_FORMAT_VERSION,
        "public_spec": str(public_spec),
        "public_content": public_fingerprint(public),
        "image_shape": list(public.image_shape),
        "num_classes": int(public.num_classes),
        "settings": dataclasses.asdict(settings),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def train_semantic_query(
    public: Any,
    public_spec: str,
    settings: SemanticQuerySettings,
    *,
    device: torch.device | str = "cpu",
    use_cache: bool = True,
    log: Callable[[str], None] = print,
) -> SemanticQuery:
    """Train (or load from the cache) the semantic query classifier on ``public`` (Eq. 4)."""
    from dpsynth.metrics.utility import TrainConfig, train_classifier
    from dpsynth.models.classifiers import build_classifier

    if public is None or len(public) == 0:
        raise DataError("the semantic query needs a non-empty public dataset (data.public)")
    if public.num_classes < 2:
        raise DataError(
            f"the semantic query needs a public dataset with labels (>= 2 classes), got {public.num_classes}"
        )
    key = semantic_query_key(public, public_spec, settings)
    path: Path = cache_dir() / "semantic-query" / f"{key}.pt"
    channels, size = public.image_shape[0], public.image_shape[1]
    if use_cache and path.exists():
        model = build_classifier(settings.classifier, channels, public.num_classes, size, settings.preset)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        log(f"semantic query: cache hit {path}")
        return SemanticQuery(model.to(device).eval(), public.num_classes, key, cached=True)
    images, labels = public.to_tensors()
    config = TrainConfig(
        epochs=settings.epochs,
        batch_size=settings.batch_size,
        lr=settings.lr,
        max_steps=settings.max_steps,
        preset=settings.preset,
    )
    model = train_classifier(
        settings.classifier, images, labels, public.num_classes, config, seed=settings.seed, device=device
    ).model.eval()
    if use_cache:
        state = {name: value.cpu() for name, value in model.state_dict().items()}
        atomic_write(path, lambda f: torch.save(state, f))
    log(
        f"semantic query: trained {settings.classifier} on {len(public)} public images "
        f"({public.num_classes} classes){', cached at ' + str(path) if use_cache else ''}"
    )
    return SemanticQuery(model, public.num_classes, key, cached=False)
