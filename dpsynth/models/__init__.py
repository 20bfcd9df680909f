"""Neural networks: classifiers and the diffusion UNet (docs/architecture.md, models/)."""

from dpsynth.models.classifiers import build_classifier, list_classifiers  # noqa: F401
from dpsynth.models.unet import UNet, build_unet  # noqa: F401
