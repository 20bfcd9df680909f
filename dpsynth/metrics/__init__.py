"""Metric computations: fidelity (FID, KID, precision/recall, IS), downstream utility, model selection,
membership inference, the canary statistics, and the evaluation protocol with the metric lists.

These are functions of arrays and models; they open no run directory. The runs that use them
(``dpsynth evaluate``, the audit, the run canary) are in :mod:`dpsynth.eval`. Modules are imported on
demand (``dpsynth.metrics.fidelity``, ``.inception``, ``.utility``, ``.model_selection``,
``.membership``, ``.canary``, ``.audit_stats``, ``.protocol``) so that importing the package stays cheap.
"""
