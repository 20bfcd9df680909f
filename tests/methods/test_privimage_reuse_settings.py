"""PrivImage's selection phase across runs: a re-use must have the private train split the selection queried,
and a run stopped after the query resumes without querying or charging again.

The runs stop right after the selection phase (fine-tuning is replaced by a sentinel), so each costs
only data loading, a tiny query classifier and the selection.
"""

from __future__ import annotations

import json

import pytest

from dpsynth.config import find_config
from dpsynth.errors import DataError, PrivacyError
from dpsynth.methods.privimage import PrivImage
from dpsynth.runner import run_config
from dpsynth.selection import SELECTION_PHASE

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


def _query_releases(run) -> int:
    privacy = json.loads((run / "privacy.json").read_text())
    return sum(m["steps"] for m in privacy["mechanisms"] if m["name"] == "semantic-query")


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


def test_a_run_stopped_after_the_query_resumes_the_selection_and_never_charges_it_twice(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Selected):
        run_config(SMOKE_G, FAST, out=run, echo=False)
    released = (run / "selection.json").read_text()
    assert _query_releases(run) == 1
    with pytest.raises(Selected):  # the checkpoint holds the release: reloaded, nothing charged
        run_config(SMOKE_G, FAST, out=run, resume=True, echo=False)
    assert "selection: resumed from the checkpoint (already charged)" in (run / "log.txt").read_text()
    assert _query_releases(run) == 1 and (run / "selection.json").read_text() == released

    # Stopped between the charge and the checkpoint: the ledger is one release ahead and the noisy
    # histogram is lost; querying again would spend beyond the plan, so the run is refused.
    (run / "checkpoints" / f"{SELECTION_PHASE}.pt").unlink()
    with pytest.raises(PrivacyError, match="noisy histogram is lost"):
        run_config(SMOKE_G, FAST, out=run, resume=True, echo=False)
    assert _query_releases(run) == 1


def test_a_reuse_stopped_between_charge_and_checkpoint_reads_the_file_again_uncharged(tmp_path):
    with pytest.raises(Selected):
        run_config(SMOKE_G, FAST, out=tmp_path / "first", echo=False)
    settings = [*FAST, f"privimage.selection.reuse={tmp_path / 'first'}"]
    run = tmp_path / "second"
    with pytest.raises(Selected):
        run_config(SMOKE_G, settings, out=run, echo=False)
    (run / "checkpoints" / f"{SELECTION_PHASE}.pt").unlink()  # the ledger holds the charge, no checkpoint
    with pytest.raises(Selected):  # the selection file is public: read again, the charge not repeated
        run_config(SMOKE_G, settings, out=run, resume=True, echo=False)
    assert _query_releases(run) == 1
    assert (run / "selection.json").read_text() == (tmp_path / "first" / "selection.json").read_text()
