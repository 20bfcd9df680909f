"""Feature-statistics inversion: images synthesised so that a frozen classifier's internal statistics on them
match released target statistics (Soufleri et al., "DP-ImgSyn: Dataset Alignment for Obfuscated,
Differentially Private Image Synthesis", TMLR 2024, §4.1–4.3).

* :mod:`~dpsynth.inversion.feature_stats`: the per-example GroupNorm input moments, their batch statistics
  and the feature loss ``R_feature`` (Eq. 1);
* :mod:`~dpsynth.inversion.statistics`: the one private access, the clipped moment sums and their count as
  one bounded-sum Gaussian release (§4.1), and the public clip norm;
* :mod:`~dpsynth.inversion.alignment`: the starting images, the alignment optimisation (Algorithm 1,
  Eq. 1–5) and the soft-label release (§4.3), all post-processing of released values and public data.
"""
