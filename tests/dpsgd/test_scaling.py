"""The scaling rule of the ``auto`` presets: batch, steps, sample rate, model and samples from N and the shape."""

from __future__ import annotations

import pytest

from dpsynth.dpsgd.scaling import SAFETY, AutoSection, estimated_seconds, scale
from dpsynth.errors import ConfigError

AUTO = AutoSection(
    time_budget_s=600,
    dpsgd="m",
    fixed_s=30,
    sample_s=0.01,
    step_s=0.1,
    side_multiple=4,
    public={1: "glyphs", 3: "glyphs32"},
    models=[
        {"up_to": 20000, "example_step_s": 0.002, "keys": {"m.width": 16}},
        {"up_to": None, "example_step_s": 0.006, "keys": {"m.width": 32}},
    ],
)
SIZES = (100, 173, 1438, 10_000, 60_000, 1_000_000)
SHAPES = ((1, 8, 8), (1, 28, 28), (3, 32, 32))


def settings_of(n, shape, auto=AUTO, has_public=False):
    return {setting.key: setting.value for setting in scale(n, shape, auto, has_public=has_public)}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", SIZES)
def test_the_plan_fits_the_data_and_the_budget(n, shape):
    settings = settings_of(n, shape)
    batch, steps = settings["m.batch_size"], settings["m.steps"]
    assert 1 <= batch <= AUTO.max_sample_rate * n  # q = B / N <= 0.25 < 1
    assert steps >= 1 and steps * batch / n <= AUTO.max_epochs
    assert settings["m.physical_batch_size"] == min(batch, AUTO.physical_batch)
    assert settings["generate.num"] == min(max(n, 100), AUTO.max_samples)
    estimate = estimated_seconds(AUTO, n, shape, batch, steps, settings["generate.num"])
    assert estimate <= SAFETY * AUTO.time_budget_s + 1e-6


def test_batch_grows_with_n_until_its_cap_and_small_sets_are_capped_by_epochs():
    small_model = [n for n in SIZES if n <= 20000]  # the larger model costs more, so its batch restarts lower
    batches = [settings_of(n, (1, 28, 28))["m.batch_size"] for n in small_model]
    assert batches == sorted(batches) and batches[0] == 25 and batches[-1] == AUTO.max_batch
    small = settings_of(100, (1, 28, 28))
    assert small["m.steps"] == int(AUTO.max_epochs * 100 / small["m.batch_size"])  # epochs, not time, bind
    large = settings_of(1_000_000, (1, 28, 28))
    assert large["m.steps"] * large["m.batch_size"] < 1_000_000  # time binds: less than one epoch


def test_larger_images_cost_more_so_fewer_example_steps_fit():
    grey = settings_of(1_000_000, (1, 28, 28))
    colour = settings_of(1_000_000, (3, 32, 32))
    assert colour["m.steps"] * colour["m.batch_size"] < grey["m.steps"] * grey["m.batch_size"]


def test_model_size_follows_n_and_the_side_is_rounded_for_the_network():
    assert settings_of(19_000, (1, 28, 28))["m.width"] == 16
    assert settings_of(21_000, (1, 28, 28))["m.width"] == 32
    assert settings_of(200, (1, 25, 25))["data.image_size"] == 28
    assert "data.image_size" not in settings_of(200, (1, 28, 28))


def test_a_network_with_a_minimum_side_gets_small_images_resized_up_to_it():
    gan = AUTO.model_copy(update={"min_side": 16})
    assert settings_of(200, (1, 8, 8), auto=gan)["data.image_size"] == 16
    assert settings_of(200, (1, 14, 14), auto=gan)["data.image_size"] == 16
    assert settings_of(200, (1, 25, 25), auto=gan)["data.image_size"] == 28
    assert "data.image_size" not in settings_of(200, (1, 28, 28), auto=gan)


def test_public_set_matches_the_channels_unless_one_is_given():
    assert settings_of(200, (1, 28, 28))["data.public"] == "glyphs"
    assert settings_of(200, (3, 32, 32))["data.public"] == "glyphs32"
    assert "data.public" not in settings_of(200, (3, 32, 32), has_public=True)
    grey_only = AUTO.model_copy(update={"public": {1: "glyphs"}})
    with pytest.raises(ConfigError, match=r"data\.public.*3-channel.*--set data\.public="):
        settings_of(200, (3, 32, 32), auto=grey_only)


def test_a_budget_below_the_fixed_costs_names_the_key_and_the_fix():
    short = AUTO.model_copy(update={"time_budget_s": 20.0})
    with pytest.raises(ConfigError, match=r"'auto\.time_budget_s' = 20: too short .* give at least \d+"):
        settings_of(1000, (1, 28, 28), auto=short)


def test_every_setting_says_why():
    for setting in scale(1000, (1, 28, 28), AUTO, has_public=False):
        assert setting.why and setting.key


def test_a_method_without_dp_steps_gets_samples_model_and_public_only():
    one_release = AUTO.model_copy(update={"dpsgd": None})  # a kernel method: one noisy release, no DP steps
    settings = settings_of(5000, (1, 28, 28), auto=one_release)
    assert set(settings) == {"generate.num", "m.width", "data.public"}


ONE_PASS = AutoSection(
    **{
        **AUTO.model_dump(),
        "release_rate": "m.stats.sample_rate",
        "release_pass_s": 60.0,
        "models": [
            {"up_to": 20000, "example_step_s": 0.002, "pass_record_s": 0.001, "keys": {}},
            {"up_to": None, "example_step_s": 0.006, "pass_record_s": 0.002, "keys": {}},
        ],
    }
)


@pytest.mark.parametrize("n", SIZES)
def test_a_one_pass_release_reads_every_record_until_its_time_share_then_a_poisson_share(n):
    """Rule step 5: the pass takes at most release_pass_s whatever N, and its time comes off training."""
    rate = settings_of(n, (1, 28, 28), auto=ONE_PASS)["m.stats.sample_rate"]
    record_s = 0.001 if n <= 20000 else 0.002
    full_s = n * record_s
    assert rate == (1.0 if full_s <= 60 else pytest.approx(60 / full_s, rel=1e-3))
    assert rate * n * record_s <= 60 * (1 + 1e-3)
    if full_s > 60:  # the pass's minute is no longer in the training share
        with_pass, without = settings_of(n, (1, 28, 28), auto=ONE_PASS), settings_of(n, (1, 28, 28))
        assert with_pass["m.steps"] * with_pass["m.batch_size"] < without["m.steps"] * without["m.batch_size"]


def test_a_one_pass_release_without_a_measured_cost_is_refused():
    unmeasured = AutoSection(**{**ONE_PASS.model_dump(), "models": [{"up_to": None, "example_step_s": 0.002}]})
    with pytest.raises(ConfigError, match=r"auto\.release_rate .* no pass_record_s"):
        settings_of(1000, (1, 28, 28), auto=unmeasured)


@pytest.mark.parametrize("n", SIZES)
def test_delta_is_at_most_a_tenth_of_one_over_n(n):
    """Rule step 5: the preset's δ stays while it is at most 1/(10 N); above that a power of ten below it."""
    settings = {s.key: s.value for s in scale(n, (1, 28, 28), AUTO, has_public=True, delta=1e-5)}
    delta = settings.get("privacy.delta", 1e-5)
    assert delta <= 1 / (10 * n) or ("privacy.delta" not in settings and 1e-5 <= 1 / (10 * n))
    assert delta > 1 / (100 * n) or "privacy.delta" not in settings  # no smaller than it needs to be
    assert "privacy.delta" not in {s.key for s in scale(n, (1, 28, 28), AUTO, has_public=True)}
