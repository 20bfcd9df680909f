"""Own data, first try: every method's ``auto`` preset sized by the scaling rule on a custodian's folder or npz.

Two sets stand in for a custodian's data (docs/own-data.md): 200 face/non-face-like 25×25 grey images of 2 classes,
and scikit-learn's 1,797 8×8 digits, each written as an image-per-class folder tree and as an ``.npz``, both
with a ``dataset.yaml`` that declares the classes. Every registered method's ``auto`` preset resolves and
dry-runs on each (no private read, nothing written), printing the keys the rule set; the cheapest method
runs end to end on the faces through the CLI and the Python API.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpsynth.api import Synthesizer
from dpsynth.cli import main
from dpsynth.config import DEFAULT_AUTO_METHOD, PRESETS_DIR, load_config
from dpsynth.data import load_dataset
from dpsynth.errors import ConfigError
from dpsynth.methods import METHODS, get_method

BUILT_IN = sorted(name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth."))
CHEAPEST = "dpsgd-classifier"
FACE_CLASSES = ["face", "non-face"]
DIGIT_CLASSES = [str(d) for d in range(10)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def face_arrays(count=200, side=25, seed=0):
    """Distinct grey records of 2 classes; class 1 carries a bright square, so it can be learnt."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 2
    images = rng.integers(0, 200, (count, side, side), dtype=np.uint8)
    images[labels == 1, 8:17, 8:17] = 255
    return images, labels


def digit_arrays():
    parts = [load_dataset("digits8x8", split) for split in ("train", "val", "test")]
    return np.concatenate([p.images[..., 0] for p in parts]), np.concatenate([p.labels for p in parts])


def write_sets(root: Path, images: np.ndarray, labels: np.ndarray, classes: list[str]) -> dict[str, Path]:
    """The same images as an .npz (dataset.yaml beside it) and as a class-folder tree (dataset.yaml inside)."""
    archive_dir, tree = root / "npz", root / "tree"
    archive_dir.mkdir(parents=True)
    np.savez(archive_dir / "images.npz", images=images, labels=labels)
    (archive_dir / "dataset.yaml").write_text(f"classes: {json.dumps(classes)}\npixel_range: [0, 255]\n")
    for index, name in enumerate(classes):
        (tree / name).mkdir(parents=True)
        for number in np.flatnonzero(labels == index):
            Image.fromarray(images[number]).save(tree / name / f"{number:05d}.png")
    (tree / "dataset.yaml").write_text(f"classes: {json.dumps(classes)}\nchannels: 1\n")
    return {"npz": archive_dir / "images.npz", "folder": tree}


@pytest.fixture(scope="module")
def own_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    return {
        "faces": write_sets(root / "faces", *face_arrays(), FACE_CLASSES),
        "digits": write_sets(root / "digits", *digit_arrays(), DIGIT_CLASSES),
    }


def dry_run(capsys, preset: str, *overrides: str, as_json: bool = True) -> dict | str:
    capsys.readouterr()
    args = ["run", preset, "--dry-run", *(["--json"] if as_json else [])] + [f"--set={item}" for item in overrides]
    code = main(args)
    console = capsys.readouterr()
    assert code == 0, console.err
    return json.loads(console.out) if as_json else console.out


def test_every_registered_method_has_an_auto_preset():
    for method in BUILT_IN:
        config = load_config(f"{method}/auto")
        assert config.auto is not None and config.auto.applied, method
        assert config.evaluate.metrics or METHODS[method].releases == "model", f"{method}/auto evaluates its release"


@pytest.mark.parametrize("layout", ["folder", "npz"])
@pytest.mark.parametrize("dataset", ["faces", "digits"])
@pytest.mark.parametrize("method", BUILT_IN)
def test_auto_preset_dry_runs_on_own_data(method, dataset, layout, own_sets, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = dry_run(capsys, f"{method}/auto", f"data.private={own_sets[dataset][layout]}")
    auto, config, plan = result["auto"], result["config"], result["plan"]
    classes = FACE_CLASSES if dataset == "faces" else DIGIT_CLASSES
    assert config["data"]["num_classes"] == len(classes) and config["data"]["class_names"] == classes
    total = 200 if dataset == "faces" else 1797
    assert 0.7 * total < auto["num_examples"] < 0.9 * total  # 10 % test and 10 % val held out, by content
    side = 25 if dataset == "faces" else 8
    assert auto["image_shape"] == [1, side, side]
    dpsgd = config["auto"]["dpsgd"]
    keys = {item["key"]: item["value"] for item in auto["set"]}
    assert all(item["why"] for item in auto["set"])
    if dpsgd is None:  # one noisy release (dp-merf, dp-ntk) or a fixed schedule (gs-wgan): nothing sized by DP steps
        assert "generate.num" in keys and not any(key.endswith((".batch_size", ".steps")) for key in keys)
    else:
        assert {f"{dpsgd}.batch_size", f"{dpsgd}.steps"} <= set(keys)
        batch = keys[f"{dpsgd}.batch_size"]
        assert 1 <= batch <= 0.25 * auto["num_examples"]
        rates = {m["sample_rate"] for m in plan["mechanisms"] if m["kind"] == "subsampled_gaussian"}
        assert any(abs(rate - batch / auto["num_examples"]) < 1e-9 for rate in rates), rates
    if plan["guarantee"] == "dp":
        assert plan["epsilon"] <= plan["target_epsilon"]
    # the estimate builds the method's networks at the planned shape: one that cannot take it fails here
    assert "unavailable" not in result["estimate"], result["estimate"]
    phases = get_method(method).phases(load_config(f"{method}/auto"))
    if any(phase.public == "required" for phase in phases):
        assert config["data"]["public"] == "glyphs"  # a built-in public set with the private channels
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


@pytest.mark.parametrize("method", BUILT_IN)
def test_dry_run_prints_the_keys_the_rule_set_before_the_plan(method, own_sets, capsys):
    text = dry_run(capsys, f"{method}/auto", f"data.private={own_sets['faces']['npz']}", as_json=False)
    before_plan = text.split("privacy plan")[0]
    dpsgd = load_config(f"{method}/auto").auto.dpsgd
    if dpsgd is None:
        assert "auto: set generate.num = " in before_plan
    else:
        assert f"auto: set {dpsgd}.batch_size = " in before_plan and f"auto: set {dpsgd}.steps = " in before_plan
    assert "auto: " + method + " sized for N=" in before_plan


def test_your_own_value_wins_over_the_rule_and_is_listed_as_kept(own_sets, capsys):
    result = dry_run(capsys, f"{CHEAPEST}/auto", f"data.private={own_sets['faces']['npz']}", f"{CHEAPEST}.steps=7")
    assert result["config"][CHEAPEST]["steps"] == 7 and result["auto"]["kept"] == [f"{CHEAPEST}.steps"]
    assert f"{CHEAPEST}.steps" not in {item["key"] for item in result["auto"]["set"]}


def test_run_auto_picks_the_default_method_and_says_why(own_sets, capsys):
    text = dry_run(capsys, "auto", f"data.private={own_sets['faces']['folder']}", as_json=False)
    assert f"method: {DEFAULT_AUTO_METHOD}" in text
    assert f"auto: method {DEFAULT_AUTO_METHOD} (the default for own data): " in text


def one_error_line(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(list(args)) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (f"{CHEAPEST}.batch_size=500", [f"'{CHEAPEST}.batch_size' = 500", "sample rate", "set it to at most"]),
        (f"{CHEAPEST}.steps=10000000", [f"'{CHEAPEST}.steps' = 10000000", "auto.time_budget_s", f"lower {CHEAPEST}"]),
        ("auto.time_budget_s=30", ["'auto.time_budget_s' = 30", "give at least"]),
    ],
    ids=["batch-over-n", "steps-over-budget", "budget-too-short"],
)
def test_a_setting_that_cannot_work_fails_at_load(override, fragments, own_sets, capsys, tmp_path):
    out = tmp_path / "run"
    line = one_error_line(
        capsys,
        "run",
        f"{CHEAPEST}/auto",
        f"--set=data.private={own_sets['faces']['npz']}",
        f"--set={override}",
        "--out",
        str(out),
    )
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()


def test_colour_data_without_a_public_set_for_it_names_the_key(tmp_path, capsys):
    rng = np.random.default_rng(1)
    np.savez(
        tmp_path / "colour.npz",
        images=rng.integers(0, 256, (200, 16, 16, 3), dtype=np.uint8),
        labels=np.arange(200) % 2,
        num_classes=2,
    )
    grey_only = tmp_path / "grey_only.yaml"  # an auto preset whose method knows a public set for grey only
    preset = (PRESETS_DIR / "pdp-diffusion" / "auto.yaml").read_text()
    grey_only.write_text(preset.replace("public: {1: glyphs, 3: glyphs32}", "public: {1: glyphs}"))
    line = one_error_line(capsys, "run", str(grey_only), f"--set=data.private={tmp_path / 'colour.npz'}", "--dry-run")
    assert "'data.public' is unset" in line and "3-channel" in line and "--set data.public=" in line


def finished(run_dir: Path) -> None:
    """A release (the privacy record, the model or samples) and a report."""
    assert json.loads((run_dir / "privacy.json").read_text())["epsilon"] <= 10.0
    assert (run_dir / "report.html").is_file() and (run_dir / "log.txt").is_file()
    log = (run_dir / "log.txt").read_text()
    assert f"auto: set {CHEAPEST}.batch_size = " in log  # the log names the keys the rule set


FAST = ["auto.max_epochs=2"]  # the rule still sizes everything; two epochs keep the test short


def test_cheapest_auto_runs_end_to_end_through_the_cli(own_sets, capsys, tmp_path):
    out = tmp_path / "cli-run"
    args = ["run", f"{CHEAPEST}/auto", f"--set=data.private={own_sets['faces']['folder']}", "--out", str(out)]
    capsys.readouterr()
    assert main(args + [f"--set={item}" for item in FAST]) == 0
    console = capsys.readouterr()
    assert console.out.strip() == str(out) and "done: " in console.err
    finished(out)


def test_cheapest_auto_runs_end_to_end_through_the_api(tmp_path):
    images, labels = face_arrays()
    synth = Synthesizer.from_config(f"{CHEAPEST}/auto", {"auto.max_epochs": 2})
    synth.fit(images, labels, num_classes=2, out=tmp_path / "api-run")
    auto = synth.settings.auto
    assert 0.7 * 200 < auto.num_examples < 0.9 * 200 and auto.image_shape == [1, 25, 25]  # sized for the arrays
    assert synth.settings.section.batch_size <= 0.25 * auto.num_examples
    finished(synth.run_dir)


def test_dp_imgsyn_auto_subsamples_its_statistics_at_a_million_images_and_refuses_a_full_pass():
    """At 10^6 records the statistics read a Poisson share (one subsampled Gaussian in the plan); asking for
    every record instead is refused at load: the pass alone would take about 20 minutes."""
    config = load_config("dp-imgsyn/auto", num_examples=1_000_000)
    assert config.privacy.delta == 1e-7  # at most 1/(10 N)
    assert load_config("dp-imgsyn/auto", ["privacy.delta=1e-6"], num_examples=1_000_000).privacy.delta == 1e-6
    rate = config.section.stats.sample_rate
    assert 0.01 < rate < 0.1
    plan = get_method(config.method)().plan(config, 1_000_000)
    assert any(getattr(m, "sample_rate", None) == rate for m in plan.mechanisms)
    with pytest.raises(ConfigError, match=r"'dp-imgsyn\.stats\.sample_rate' = 1\.0: the plan needs about"):
        load_config("dp-imgsyn/auto", ["dp-imgsyn.stats.sample_rate=1.0"], num_examples=1_000_000)
