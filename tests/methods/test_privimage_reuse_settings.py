"""A run that re-uses PrivImage's selection must have the private train split the selection queried.

The runs stop right after the selection phase (fine-tuning is replaced by a sentinel), so each costs
only data loading, a tiny query classifier and the selection.
"""

from __future__ import annotations

import pytest

from dpsynth.config import find_config
from dpsynth.errors import DataError
from dpsynth.methods.privimage import PrivImage
from dpsynth.runner import run_config

SMOKE_G = find_config("privimage/smoke_gan")
FAST = [
    "data.max_train=120",
    "data.max_public=300",
    "privimage.selection.classifier_max_steps=4",
    "privimage.selection.classifier_batch_size=64",
]


class Selected(Exception):
    """Raised where fine-tuning would start: the selection phase finished."""


@pytest.fixture(autouse=True)
def stop_after_selection(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))

    def stop(self, ctx, config):
        raise Selected

    monkeypatch.setattr(PrivImage, "fit_gan", stop)


def test_reusing_a_selection_made_with_another_split_seed_is_refused(tmp_path):
    with pytest.raises(Selected):
        run_config(SMOKE_G, FAST, out=tmp_path / "first", echo=False)
    reuse = f"privimage.selection.reuse={tmp_path / 'first'}"
    with pytest.raises(Selected):  # the same split: accepted, charged again, on to fine-tuning
        run_config(SMOKE_G, [*FAST, reuse], out=tmp_path / "same", echo=False)
    # split_seed picks which 120 of mnist10k's train records max_train keeps, hence which were queried
    with pytest.raises(DataError, match=r"differing: data\.split_seed 0 there, 1 here\)") as err:
        run_config(SMOKE_G, [*FAST, reuse, "data.split_seed=1"], out=tmp_path / "other", echo=False)
    assert "\n" not in str(err.value)
