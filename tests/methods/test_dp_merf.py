"""DP-MERF: the method contract and its config rules (the release itself is tested for both mean-embedding methods
in tests/kernels/test_mean_embedding_method.py, the public bandwidth rule in tests/kernels/test_bandwidths.py)."""

from __future__ import annotations

import pytest

from dpsynth.api import Synthesizer
from dpsynth.errors import ConfigError
from dpsynth.testing import MethodContractTests


class TestDPMerfContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dp-merf/smoke`` preset."""

    method = "dp-merf"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dp-merf.num_features": 201}, "even"),
        ({"dp-merf.bandwidth_rule": "fixed"}, "needs bandwidths"),
        ({"dp-merf.bandwidth_rule": "noise-median", "dp-merf.bandwidths": [4.0, 8.0]}, "use 'fixed'"),
        ({"dp-merf.bandwidth_rule": "fixed", "dp-merf.bandwidths": [4.0, -1.0]}, "> 0"),
        ({"dp-merf.denominator": "realised-counts"}, "dp-merf.denominator"),
        ({"dp-merf.count_weight": 0}, "dp-merf.count_weight"),
    ],
)
def test_bad_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Synthesizer.from_config("dp-merf/smoke", overrides)


def test_public_median_needs_public_data_at_load():
    with pytest.raises(ConfigError, match="public"):
        Synthesizer.from_config("dp-merf/smoke", {"dp-merf.bandwidth_rule": "public-median"})
