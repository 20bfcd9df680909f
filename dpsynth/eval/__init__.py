"""Evaluation runs: ``dpsynth evaluate`` on a run directory or a samples file (:mod:`.evaluate`), the
privacy audit of a run (:mod:`.audit`) and the canary retraining of its method (:mod:`.run_canary`).

They open runs and write their diagnostics; the metric computations they call are in
:mod:`dpsynth.metrics`. Modules are imported on demand so that importing the package stays cheap.
"""
