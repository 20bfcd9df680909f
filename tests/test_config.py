import json
import time

import pytest
from conftest import REPO, assert_one_line_error

from dpsynth.config import (
    common_keys,
    find_config,
    list_presets,
    load_config,
    method_keys,
    parse_overrides,
    reference_markdown,
    resolve_config,
)
from dpsynth.errors import ConfigError, PrivacyError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, "method: dpsgd-classifier\nprivacy: {epsilon: 3}\n")
    config = load_config(path, ["privacy.delta=1e-6", "dpsgd-classifier.lr=0.5", "data.max_train=100"])
    assert config.privacy.epsilon == 3 and config.privacy.delta == pytest.approx(1e-6)
    assert config.section.lr == 0.5 and config.data.max_train == 100
    assert config.section.batch_size == 256  # a default filled in
    assert config.name == "c"
    stored = config.to_dict()  # what config.yaml holds: the section under the method's name
    assert stored["dpsgd-classifier"]["lr"] == 0.5 and stored["privacy"]["epsilon"] == 3


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    config = load_config(write(tmp_path, "method: dpsgd-classifier\nprivacy: {delta: 1e-5}\n"))
    assert isinstance(config.privacy.delta, float)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("method: dpsgd-classifier\nbogus: 1\n", "'bogus'"),
        ("method: dpsgd-classifier\ndata: {privte: x}\n", "'data.privte'"),
        ("method: dpsgd-classifier\ndpsgd-classifier: {lrr: 1}\n", "'dpsgd-classifier.lrr'"),
        ("method: no-such-method\n", "unknown method 'no-such-method'"),
        ("data: {private: mnist10k}\n", "must name a method"),
        ("method: dpsgd-classifier\ndpsgd-classifier: {lr: fast}\n", "'dpsgd-classifier.lr'"),
        ("- a list\n", "mapping"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("epsilon, delta", [(0, 1e-5), (-1, 1e-5), (float("inf"), 1e-5), (1, 0), (1, 1), (1, 1.5)])
def test_bad_privacy_target(epsilon, delta):
    with pytest.raises(PrivacyError):
        resolve_config({"method": "dpsgd-classifier", "privacy": {"epsilon": epsilon, "delta": delta}})


def test_override_syntax():
    assert parse_overrides(["a.b.c=[1, 2]", "x=null"]) == {"a": {"b": {"c": [1, 2]}}, "x": None}
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])


# ------------------------------------------------------------------ typed schemas, checked at load

EARLY_ERRORS = [
    ("dp-imgsyn.release.labels=bogus", "'dp-imgsyn.release.labels' = 'bogus'", "'teacher' or 'target'"),
    ("dp-imgsyn.synthesis.init=nosuch", "'dp-imgsyn.synthesis.init' = 'nosuch'", "'public' or 'noise'"),
    ("dp-imgsyn.stats.clip_quantile=7.0", "'dp-imgsyn.stats.clip_quantile' = 7.0", "less than or equal to 1"),
    ("dp-imgsyn.release.temperature=-1", "'dp-imgsyn.release.temperature' = -1", "greater than 0"),
]


@pytest.fixture
def refuse_data(monkeypatch):
    import dpsynth.data
    import dpsynth.runner

    def refuse(*args, **kwargs):
        raise AssertionError("data was read")

    monkeypatch.setattr(dpsynth.runner, "load_run_data", refuse)
    monkeypatch.setattr(dpsynth.data, "load_private", refuse)


@pytest.mark.parametrize("override, key, allowed", EARLY_ERRORS)
def test_bad_values_fail_at_load_in_one_line(override, key, allowed, tmp_path, refuse_data):
    from dpsynth.runner import run_config

    load_config(find_config("dp-imgsyn/smoke"))  # warm the imports: the timing is of the check itself
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        run_config("dp-imgsyn/smoke", [override], out=tmp_path / "run")
    assert time.perf_counter() - started < 5
    message = str(error.value)
    assert "\n" not in message and key in message and allowed in message
    assert not (tmp_path / "run").exists()


def test_bad_value_on_the_command_line_leaves_no_run_directory(cli, tmp_path):
    result = cli("run", "dp-imgsyn/smoke", "--set", EARLY_ERRORS[0][0], "--out", str(tmp_path / "run"))
    assert_one_line_error(result, EARLY_ERRORS[0][1], EARLY_ERRORS[0][2])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"dpdm": {"loss": "hybrid", "learn_sigma": False}}, "needs learn_sigma"),
        ({"dpdm": {"timestep_weights": [0.5, 0.5]}}, "timestep_boundaries needs 3 entries"),
        ({"dpdm": {"unet": {"base_chanels": 8}}}, "unknown UNet key 'base_chanels'"),
        ({"dpdm": {"model": "huge"}}, "'dpdm.model' = 'huge'"),
        ({"pdp-diffusion": {"class_init": "random"}}, "'pdp-diffusion.class_init'"),
        ({"device": "gpu"}, "'device' = 'gpu'"),
        ({"evaluate": {"metrics": ["acuracy"]}}, "unknown metric 'acuracy'"),
        ({"dpsgd-classifier": {"optimizer": "rmsprop"}}, "'dpsgd-classifier.optimizer' = 'rmsprop'"),
    ],
)
def test_cross_field_and_choice_errors(raw, fragment):
    method = next((k for k in raw if k in ("dpdm", "pdp-diffusion", "dpsgd-classifier")), "dpsgd-classifier")
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        resolve_config({"method": method, **raw})


def test_public_data_a_phase_requires_is_checked_at_load():
    with pytest.raises(ConfigError, match="needs public data"):
        resolve_config({"method": "dp-imgsyn", "data": {"public": None}})
    resolve_config({"method": "dp-imgsyn", "dp-imgsyn": {"synthesis": {"init": "noise"}}})


def test_dict_overrides_match_set_overrides(tmp_path):
    path = write(tmp_path, "method: dpdm\n")
    assert load_config(path, {"dpdm.steps": 20, "privacy.epsilon": 2}) == load_config(
        path, ["dpdm.steps=20", "privacy.epsilon=2"]
    )


def test_config_show_lists_every_key_with_default_type_and_description(cli):
    result = cli("config", "show", "dp-imgsyn", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["key"]: r for r in json.loads(result.stdout)["keys"]}
    assert rows["dp-imgsyn.release.labels"]["default"] == "target"
    assert "'teacher' | 'target'" in rows["dp-imgsyn.release.labels"]["type"]
    assert all(r["description"] for r in rows.values())
    assert {r["key"] for r in method_keys("dpdm")} >= {"dpdm.steps", "dpdm.lr_schedule", "dpdm.sampler"}
    assert {r["key"] for r in common_keys()} >= {"privacy.epsilon", "data.private", "generate.num"}


def test_generated_config_reference_is_up_to_date():
    stored = (REPO / "docs" / "config-reference.md").read_text()
    assert stored.strip() == reference_markdown().strip(), (
        "regenerate: dpsynth config reference > docs/config-reference.md"
    )


def test_presets_resolve_by_name_and_every_preset_loads():
    names = list_presets()
    assert "demo" in names and "dpdm/mnist10k_eps10" in names and "dp-imgsyn/smoke" in names
    for name in names:
        assert load_config(find_config(name)).method
    with pytest.raises(ConfigError, match="no packaged preset 'dpdm/nope'"):
        find_config("dpdm/nope")
