"""Does a release's class balance follow the requested label distribution?

Every shipped method is asked for a balanced release: sample i gets class ``i mod K`` (each class
``n // K`` or one more). A method whose released hard labels come from a network instead (a teacher's
argmax, a decoded label row) can drift from that request, down to every sample carrying one class, which
makes the release useless for training a classifier. This check runs after generation, in the shared
layer (the runner, ``Synthesizer.sample`` and the report call it), whatever the method.

The released labels are public output (part of ``samples.npz``), and the requested distribution comes
from the config and the sample count, so the result quotes no private value: it may go to the log, the
console, the release report and ``metrics.json``.

A release is flagged when a class that was requested has no sample, or when the total variation
distance between the released and the requested class shares exceeds :data:`FAR_FROM_REQUESTED`
(docs/report.md, "Label balance").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpsynth.errors import ConfigError

#: total variation distance (half the L1 distance of the class shares, in [0, 1]) above which the
#: released labels are "far" from the request: on 2 classes a 70/30 split is 0.2, one class alone 0.5;
#: on 10 classes, one class missing and its share spread over the others is 0.1
FAR_FROM_REQUESTED = 0.2
#: the label distribution every method is asked for (the only one today)
BALANCED = "balanced"
#: class counts quoted in a warning line before it is shortened
MAX_LISTED = 10


def balanced_labels(num: int, num_classes: int, generator: torch.Generator | None = None) -> np.ndarray:
    """``num`` balanced labels, int64: each class ``num // K`` or one more; the only definition in dpsynth.

    Without ``generator`` (every release): sample i gets class ``i mod K``, exactly the request that
    :func:`label_balance` checks. With ``generator`` (a training batch of public labels, e.g. a moment-matching
    generator's): the cycle starts at a random class and the order is shuffled, so that over many batches
    the remainder ``num mod K`` favours no class. The draws come from public randomness, never from data.
    """
    if num < 0 or num_classes < 1:
        raise ConfigError(f"cannot draw {num} labels over {num_classes} classes")
    if generator is None:
        return np.arange(num, dtype=np.int64) % num_classes
    offset = int(torch.randint(num_classes, (1,), generator=generator))
    labels = (torch.arange(num, dtype=torch.int64) + offset) % num_classes
    return labels[torch.randperm(num, generator=generator)].numpy()


def balanced_draw(images: np.ndarray, labels: np.ndarray, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``num`` of a released set's (image, label) pairs, labels from :func:`balanced_labels` over the classes the set
    holds, each class's images in an order seeded by ``seed`` (public), repeated only when more are asked for than
    the class holds (a method that releases a fixed set of images, e.g. Private Evolution's final population)."""
    classes = np.unique(labels)
    rng = np.random.default_rng(seed)
    orders = {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in classes}
    wanted = classes[balanced_labels(num, len(classes))] if len(classes) else np.zeros(0, np.int64)
    taken = {int(c): 0 for c in classes}
    picks = []
    for label in wanted.tolist():
        order = orders[label]
        picks.append(order[taken[label] % len(order)])
        taken[label] += 1
    index = np.asarray(picks, dtype=np.int64)
    return images[index], labels[index].astype(np.int64)


def requested_counts(num: int, num_classes: int) -> np.ndarray:
    """Class counts of ``num`` balanced labels (:func:`balanced_labels`): each class ``num // K`` or one more."""
    return np.bincount(balanced_labels(num, num_classes), minlength=num_classes)


def label_balance(labels: Any, num_classes: int) -> dict[str, Any]:
    """The released class counts beside the requested (balanced) ones, their total variation distance,
    the requested classes with no sample, and a one-line ``warning`` (None when the balance is fine)."""
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    num = len(labels)
    inside = labels[(labels >= 0) & (labels < num_classes)]
    released = np.bincount(inside, minlength=num_classes)
    requested = requested_counts(num, num_classes)
    distance = 0.5 * float(np.abs(released - requested).sum()) / num if num else 0.0
    missing = [int(k) for k in np.flatnonzero((requested > 0) & (released == 0))]
    result = {
        "requested_distribution": BALANCED,
        "num_classes": int(num_classes),
        "num_samples": int(num),
        "released": released.tolist(),
        "requested": requested.tolist(),
        "total_variation": distance,
        "threshold": FAR_FROM_REQUESTED,
        "missing_classes": missing,
        "outside_classes": int(num - len(inside)),
    }
    result["warning"] = _warning(result)
    return result


def _warning(balance: dict[str, Any]) -> str | None:
    missing, distance = balance["missing_classes"], balance["total_variation"]
    if not missing and distance <= FAR_FROM_REQUESTED and not balance["outside_classes"]:
        return None
    problems = []
    if missing:
        named = ", ".join(str(k) for k in missing[:MAX_LISTED]) + (" ..." if len(missing) > MAX_LISTED else "")
        problems.append(f"no sample of requested class(es) {named}")
    if distance > FAR_FROM_REQUESTED:
        problems.append(f"total variation distance {distance:.2f} > {FAR_FROM_REQUESTED:g}")
    if balance["outside_classes"]:
        problems.append(f"{balance['outside_classes']} label(s) outside 0..{balance['num_classes'] - 1}")
    return (
        f"the released labels do not follow the requested balanced distribution: {'; '.join(problems)}; "
        f"released counts per class {_counts(balance['released'])}, requested {_counts(balance['requested'])}"
    )


def _counts(counts: list[int]) -> str:
    shown = ", ".join(str(c) for c in counts[:MAX_LISTED])
    return f"[{shown}{', ...' if len(counts) > MAX_LISTED else ''}]"
