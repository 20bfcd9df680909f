"""``toy-embedding``: a mean-embedding method added in a test, in three places: this module, its preset
(``presets/smoke.yaml``) and its test class (``tests/methods/test_toy_embedding.py``).

It states only what differs from the mean-embedding skeleton
(:class:`~dpsynth.methods.families.mean_embedding.MeanEmbeddingMethod`): its feature map, random Fourier
features of one Gaussian kernel whose length scale is a fixed, public config value (the single-kernel
"sphere" features of Harder et al., "DP-MERF", AISTATS 2021, arXiv:2002.11603, §2.2). The one Gaussian
release of the class-wise feature sums, σ's calibration, moment matching, checkpoints, resume, the released
generator and sampling are the skeleton's; registering the class puts it in ``dpsynth methods``, ``dpsynth
config list`` (through :attr:`presets_dir`) and the generated method and config tables.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import Field

from dpsynth.contract import RunContext, register_method
from dpsynth.kernels import RandomFourierFeatures
from dpsynth.methods.families.mean_embedding import FEATURE_MAP_INIT, MeanEmbeddingMethod, MeanEmbeddingSection
from dpsynth.seeding import stream_seed


class ToyEmbeddingSection(MeanEmbeddingSection):
    """The ``toy-embedding`` section: the skeleton's release and generator keys, plus the random features."""

    num_features: int = Field(64, ge=2, description="D, an even number of random Fourier features")
    length_scale: float = Field(20.0, gt=0, description="the Gaussian kernel's length scale on [-1, 1] pixels")


@register_method
class ToyEmbedding(MeanEmbeddingMethod):
    name = "toy-embedding"
    summary = "a test's toy: random Fourier features of one public Gaussian kernel, released once, then moment matching"
    paper = "Harder, Adamczewski, Park, DP-MERF, AISTATS 2021 (arXiv:2002.11603), with a single fixed kernel"
    config_schema = ToyEmbeddingSection
    mechanism_name = "toy-embedding"
    presets_dir = Path(__file__).parent / "presets"

    def feature_map(self, ctx: RunContext) -> RandomFourierFeatures:
        section = ctx.section
        seed = stream_seed(ctx.seed, "model-init", FEATURE_MAP_INIT)  # public randomness only
        inputs = math.prod(ctx.image_shape)
        return RandomFourierFeatures(inputs, section.num_features, section.length_scale, seed, device=ctx.device)
