"""The DP-SGD classifier baseline: the common method contract."""

from __future__ import annotations

from dpsynth.testing import MethodContractTests


class TestDPSGDClassifierContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dpsgd-classifier/smoke`` preset."""

    method = "dpsgd-classifier"
