"""Evaluation: fidelity (FID, KID, precision/recall, IS), downstream utility, model selection, privacy audit.

Modules are imported on demand (``dpsynth.eval.evaluate``, ``.fidelity``, ``.utility``,
``.model_selection``, ``.audit`` with ``.membership``, ``.canary`` and ``.audit_stats``) so that
importing the package stays cheap.
"""
