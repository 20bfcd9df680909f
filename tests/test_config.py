import pytest

from dpsynth.config import load_config, parse_overrides, resolve_config
from dpsynth.errors import ConfigError, PrivacyError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, "method: dpsgd-classifier\nprivacy: {epsilon: 3}\n")
    config = load_config(path, ["privacy.delta=1e-6", "dpsgd-classifier.lr=0.5", "data.max_train=100"])
    assert config["privacy"]["epsilon"] == 3 and config["privacy"]["delta"] == pytest.approx(1e-6)
    assert config["dpsgd-classifier"]["lr"] == 0.5 and config["data"]["max_train"] == 100
    assert config["dpsgd-classifier"]["batch_size"] == 256  # a default filled in
    assert config["name"] == "c"


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    config = load_config(write(tmp_path, "method: dpsgd-classifier\nprivacy: {delta: 1e-5}\n"))
    assert isinstance(config["privacy"]["delta"], float)


@pytest.mark.parametrize("text, fragment", [
    ("method: dpsgd-classifier\nbogus: 1\n", "'bogus'"),
    ("method: dpsgd-classifier\ndata: {privte: x}\n", "'data.privte'"),
    ("method: dpsgd-classifier\ndpsgd-classifier: {lrr: 1}\n", "'dpsgd-classifier.lrr'"),
    ("method: no-such-method\n", "unknown method 'no-such-method'"),
    ("data: {private: mnist10k}\n", "must name a method"),
    ("method: dpsgd-classifier\ndpsgd-classifier: {lr: fast}\n", "'dpsgd-classifier.lr'"),
    ("- a list\n", "mapping"),
])
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
