"""dpsynth: differentially private synthetic image data, with one privacy core and one evaluation protocol."""

__version__ = "0.1.0"
