"""``glyphs``: a deterministic public dataset of printed digits and letters.

It plays the role ImageNet/EMNIST play as public data in the papers (pre-training in
Ghalebikesabi et al. (arXiv:2302.13861) §4, semantic selection in PrivImage (arXiv:2311.12850) §3) without any download:
every image is a character rendered with a font shipped in matplotlib's wheel (DejaVu Sans,
Serif and Mono with their bold/oblique cuts, STIX General, Computer Modern), then jittered.

Generation, in two stages so that 20,000 images take a few seconds on one core:

1. each (font, character) pair the dataset draws is rendered once per process with PIL, at
   twice the output resolution, in every stroke variant. All characters of a font share one scale
   (cap height = 62 % of the side) and one
   baseline, so "o" stays smaller than "O" and "p" hangs lower than "P";
   strokes: eroded (thin), plain, and PIL strokes of 1 and 2 source pixels (bold);
2. each example draws a font, a stroke variant and a random affine map (rotation, anisotropic
   scale, shear, translation), applied to its base glyph with one batched bilinear
   ``grid_sample`` at 2x resolution followed by 2x2 average pooling (anti-aliasing), then an
   optional light blur. ``color=True`` paints the glyph and the background with two random RGB
   colours whose luma differs by at least 0.35.

Everything is drawn from ``numpy.random.default_rng(SeedSequence([seed, split]))``, so a seed
gives the same images on every machine with the same fonts and Pillow; results are cached as
``.npz`` under ``$DPSYNTH_CACHE`` (default ``~/.cache/dpsynth``), keyed by every parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpsynth.checkpoint import atomic_write, cache_dir
from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import DataError

if TYPE_CHECKING:  # torch and PIL are imported lazily: listing datasets must not pay for them
    import torch
    from PIL import ImageFont

GENERATOR_VERSION = 1
DIGITS = "0123456789"
CHARACTERS = DIGITS + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Text fonts of matplotlib's wheel. Left out: the DejaVu "Display" cuts and STIX NonUni/Size
# fonts (no Latin glyphs), LastResort (one glyph for everything), cmsy10/cmex10 (symbols) and
# cmmi10 (old-style digits that read as letters).
FONT_FILES = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "cmr10.ttf",
    "cmb10.ttf",
    "cmss10.ttf",
    "cmti10.ttf",
    "cmtt10.ttf",
)
STROKE_VARIANTS = ("thin", "plain", "stroke1", "stroke2")
CAP_HEIGHT = 0.62  # of the image side; MNIST digits span ~20 of 28 pixels
MAX_WIDTH = 0.86  # wider glyphs (W, m) are shrunk to fit
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


@dataclasses.dataclass(frozen=True)
class GlyphSpec:
    """Every parameter that changes the generated images (and so the cache key)."""

    size: int = 20000
    image_size: int = 28
    color: bool = False
    digits_only: bool = False
    seed: int = 0
    max_rotation: float = 12.0  # degrees
    scale_range: tuple[float, float] = (0.75, 1.1)
    max_aspect: float = 0.15  # relative x/y scale difference
    max_shear: float = 0.25  # tan of the shear angle
    max_translation: float = 0.08  # of the image side
    blur_probability: float = 0.3
    split: str = "train"

    @property
    def characters(self) -> str:
        return DIGITS if self.digits_only else CHARACTERS

    def key(self, fonts: list[Path]) -> str:
        """Cache key: the parameters, the generator version and the exact font files and Pillow."""
        import PIL

        described = {
            **dataclasses.asdict(self),
            "version": GENERATOR_VERSION,
            "pillow": PIL.__version__,
            "fonts": [(f.name, f.stat().st_size) for f in fonts],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def font_directory() -> Path:
    """matplotlib's bundled TrueType folder, found without importing matplotlib."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the glyphs dataset needs matplotlib's bundled fonts; install matplotlib")
    return Path(list(spec.submodule_search_locations)[0]) / "mpl-data" / "fonts" / "ttf"


def available_fonts() -> list[Path]:
    folder = font_directory()
    fonts = [folder / name for name in FONT_FILES if (folder / name).is_file()]
    if not fonts:
        raise DataError(f"no usable fonts in {folder}")
    return fonts


@functools.cache
def _sized_font(path: Path, side: int) -> tuple[ImageFont.FreeTypeFont, float]:
    """The font at the size that makes its cap height CAP_HEIGHT * side, and its baseline y."""
    from PIL import ImageFont

    probe = ImageFont.truetype(str(path), 100)
    cap = -probe.getbbox("H", anchor="ls")[1]
    font = ImageFont.truetype(str(path), max(4, round(100 * CAP_HEIGHT * side / cap)))
    return font, side / 2 + CAP_HEIGHT * side / 2  # cap-height band centred vertically


@functools.cache
def glyph_variants(path: Path, char: str, side: int) -> np.ndarray:
    """uint8 [len(STROKE_VARIANTS), side, side]: one character of one font, once per stroke variant.

    Cached per process and rendered only for the (font, character) pairs a dataset uses, so a
    small dataset does not pay for the whole font table.
    """
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    font, baseline = _sized_font(path, side)
    left, _, right, _ = font.getbbox(char, anchor="ls", stroke_width=2)
    shrink = min(1.0, MAX_WIDTH * side / max(1, right - left))
    if shrink < 1.0:
        font = ImageFont.truetype(str(path), max(4, round(font.size * shrink)))
    out = np.zeros((len(STROKE_VARIANTS), side, side), dtype=np.uint8)
    for v, variant in enumerate(STROKE_VARIANTS):
        stroke = {"stroke1": 1, "stroke2": 2}.get(variant, 0)
        canvas = Image.new("L", (side, side))
        x0, _, x1, _ = font.getbbox(char, anchor="ls", stroke_width=stroke)
        ImageDraw.Draw(canvas).text(
            (side / 2 - (x0 + x1) / 2, baseline),
            char,
            fill=255,
            font=font,
            anchor="ls",
            stroke_width=stroke,
            stroke_fill=255,
        )
        pixels = np.asarray(canvas)
        if variant == "thin":
            eroded = np.asarray(canvas.filter(ImageFilter.MinFilter(3)))
            # Erode only glyphs thick enough to survive it; hairline serifs would fade away.
            if eroded.sum(dtype=np.int64) >= 0.5 * pixels.sum(dtype=np.int64):
                pixels = eroded
        out[v] = pixels
    return out


def _affine_matrices(rng: np.random.Generator, count: int, spec: GlyphSpec) -> np.ndarray:
    """float32 [count, 2, 3] maps from output to source coordinates (normalised to [-1, 1])."""
    angle = np.deg2rad(rng.uniform(-spec.max_rotation, spec.max_rotation, count))
    scale = rng.uniform(*spec.scale_range, count)
    aspect = rng.uniform(-spec.max_aspect, spec.max_aspect, count)
    shear = rng.uniform(-spec.max_shear, spec.max_shear, count)
    shift = rng.uniform(-spec.max_translation, spec.max_translation, (count, 2)) * 2.0
    cos, sin = np.cos(angle), np.sin(angle)
    rotation = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)
    shearing = np.zeros((count, 2, 2))
    shearing[:, 0, 0] = shearing[:, 1, 1] = 1.0
    shearing[:, 0, 1] = shear
    scaling = np.zeros((count, 2, 2))
    scaling[:, 0, 0] = scale * (1 + aspect)
    scaling[:, 1, 1] = scale * (1 - aspect)
    forward = rotation @ shearing @ scaling  # source -> output
    inverse = np.linalg.inv(forward)
    offset = -(inverse @ shift[..., None])[..., 0]
    return np.concatenate([inverse, offset[..., None]], axis=2).astype(np.float32)


def _sampling_grid(theta: torch.Tensor, side: int) -> torch.Tensor:
    """What ``affine_grid(theta, align_corners=False)`` returns, by broadcasting (several times faster)."""
    import torch

    centres = (torch.arange(side, dtype=torch.float32) * 2.0 + 1.0) / side - 1.0
    x, y = centres.view(1, 1, side), centres.view(1, side, 1)
    t = theta[:, :, :, None, None]
    grid_x = t[:, 0, 0] * x + t[:, 0, 1] * y + t[:, 0, 2]
    grid_y = t[:, 1, 0] * x + t[:, 1, 1] * y + t[:, 1, 2]
    return torch.stack([grid_x, grid_y], dim=-1)


def _blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur (3 taps) by shifted sums: elementwise, so deterministic on any core count."""
    import torch

    weight = float(np.exp(-1.0 / (2 * sigma * sigma)))
    total = 1.0 + 2.0 * weight
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1), mode="replicate")
    rows = (padded[..., :-2, :] * weight + padded[..., 1:-1, :] + padded[..., 2:, :] * weight) / total
    return (rows[..., :, :-2] * weight + rows[..., :, 1:-1] + rows[..., :, 2:] * weight) / total


def _colourise(rng: np.random.Generator, ink: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3]: background + ink * (foreground - background), colours with luma gap >= 0.35."""
    count = len(ink)
    colours = rng.uniform(0.0, 1.0, (count, 2, 3))
    luma = np.array([0.299, 0.587, 0.114])
    for _ in range(100):  # rejection sampling of the low-contrast pairs; converges in a few rounds
        weak = np.abs(colours[:, 0] @ luma - colours[:, 1] @ luma) < 0.35
        if not weak.any():
            break
        colours[weak] = rng.uniform(0.0, 1.0, (int(weak.sum()), 2, 3))
    colours = colours.astype(np.float32)
    out = np.empty((*ink.shape, 3), dtype=np.uint8)
    for start in range(0, count, 4096):  # float32 in chunks: the whole batch in float64 is ~0.5 GB
        part = slice(start, start + 4096)
        foreground, background = colours[part, 0, None, None, :], colours[part, 1, None, None, :]
        mixed = background + ink[part, ..., None] * (foreground - background)
        out[part] = np.clip(np.rint(mixed * 255.0), 0, 255).astype(np.uint8)
    return out


def render(spec: GlyphSpec, chunk: int = 2048) -> ImageDataset:
    """Generate ``spec.size`` images (balanced classes) without touching the cache."""
    import torch

    if spec.size < 1 or spec.image_size < 8:
        raise DataError(f"glyphs need size >= 1 and image_size >= 8, got {spec.size} and {spec.image_size}")
    if spec.split not in SPLIT_SEEDS:
        raise DataError(f"glyphs have no '{spec.split}' split; use train, val or test")
    characters = spec.characters
    side = 2 * spec.image_size
    fonts = available_fonts()
    classes, variants = len(characters), len(STROKE_VARIANTS)
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, SPLIT_SEEDS[spec.split], GENERATOR_VERSION]))
    labels = rng.permutation(np.arange(spec.size) % classes).astype(np.int64)
    font_index = rng.integers(0, len(fonts), spec.size)
    variant_index = rng.integers(0, variants, spec.size)
    matrices = _affine_matrices(rng, spec.size, spec)
    blur_sigma = np.where(rng.uniform(size=spec.size) < spec.blur_probability, rng.choice([0.6, 0.9], spec.size), 0.0)
    # Render only the (font, character) pairs drawn, then index them per example.
    pairs, pair_of_example = np.unique(font_index * classes + labels, return_inverse=True)
    table = torch.from_numpy(
        np.stack([glyph_variants(fonts[p // classes], characters[p % classes], side) for p in pairs])
    )
    ink = np.empty((spec.size, spec.image_size, spec.image_size), dtype=np.float32)
    for start in range(0, spec.size, chunk):
        part = slice(start, start + chunk)
        source = table[pair_of_example[part], variant_index[part]].unsqueeze(1).float().div_(255.0)
        theta = torch.from_numpy(matrices[part])
        grid = _sampling_grid(theta, side)
        warped = torch.nn.functional.grid_sample(
            source, grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )
        small = torch.nn.functional.avg_pool2d(warped, 2)
        for sigma in (0.6, 0.9):
            chosen = torch.from_numpy(np.flatnonzero(blur_sigma[part] == sigma))
            if len(chosen):
                small[chosen] = _blur(small[chosen], sigma)
        ink[part] = small[:, 0].clamp_(0.0, 1.0).numpy()
    if spec.color:
        images = _colourise(rng, ink)
    else:
        images = np.clip(np.round(ink * 255.0), 0, 255).astype(np.uint8)[..., None]
    name = ("glyphs32" if spec.color else "glyphs") + ("-digits" if spec.digits_only else "")
    return ImageDataset(images, labels, classes, name, list(characters))


def generate(spec: GlyphSpec, use_cache: bool = True) -> ImageDataset:
    """The glyph dataset for ``spec``, from the cache when it was made before."""
    if not use_cache:
        return render(spec)
    path = cache_dir() / "glyphs" / f"{spec.key(available_fonts())}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as cached:
                return ImageDataset(
                    cached["images"], cached["labels"], len(spec.characters), str(cached["name"]), list(spec.characters)
                )
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is simply regenerated
    dataset = render(spec)
    _write_atomically(path, dataset)
    return dataset


def _write_atomically(path: Path, dataset: ImageDataset) -> None:
    """Write the cache file through a temporary file and ``os.replace`` (no half-written entries)."""
    try:
        atomic_write(
            path,
            lambda stream: np.savez_compressed(
                stream, images=dataset.images, labels=dataset.labels, name=np.array(dataset.name)
            ),
        )
    except OSError:
        pass  # caching is an optimisation: a read-only home must not stop a run
