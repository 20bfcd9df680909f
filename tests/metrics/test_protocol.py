"""One evaluation protocol per method: `dpsynth run`, `dpsynth evaluate RUN` and `dpsynth.evaluate` agree, and
DPImageBench's gen.npz layout goes both ways."""

import json
import re

import numpy as np
import pytest

from dpsynth.config import load_config
from dpsynth.errors import ConfigError
from dpsynth.methods import get_method
from dpsynth.metrics.protocol import (
    BENCHMARK_MODELS,
    CALL,
    EVALUATE_SECTION,
    SAMPLES,
    EvaluateSection,
    EvaluationProtocol,
    resolve_protocol,
    without_soft_labels,
)

# The dp-imgsyn smoke preset with a few more teacher steps and a student protocol of its own (3 epochs, not the
# preset's 2 or the default 10, so the tests can tell where it came from), evaluated after the run. (The
# accuracy itself depends on the run's DP noise, drawn from entropy; what must hold is that every entry
# point computes the same one.)
SMOKE_RUN = (
    "dp-imgsyn/smoke",
    "--set=dp-imgsyn.teacher.steps=20",
    "--set=generate.num=100",
    "--set=dp-imgsyn.student.epochs=3",
    "--set=dp-imgsyn.student.lr=0.003",
    "--set=dp-imgsyn.student.temperature=1.0",
    "--set=evaluate.metrics=[accuracy]",
    "--set=evaluate.seeds=2",
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """(run directory, the metrics.json the run itself wrote). The run goes through the command line in this
    process, as the tests' ``dpsynth evaluate`` calls do: the same thread count, and no interpreter importing
    torch again for it."""
    from conftest import run_cli_in_process

    out = tmp_path_factory.mktemp("protocol") / "run"
    done = run_cli_in_process("run", *SMOKE_RUN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "diagnostics" / "metrics.json").read_text())


def test_evaluate_run_without_flags_repeats_the_runs_own_number(smoke_run, cli):
    run_dir, at_run = smoke_run
    protocol = at_run["meta"]["protocol"]
    # dp-imgsyn's protocol: the KD student of its student section, soft labels at its T, the last epoch.
    assert (protocol["labels"], protocol["kd_temperature"], protocol["selection"]) == ("soft", 1.0, "last")
    assert protocol["models"] == ["cnn"] and (protocol["epochs"], protocol["lr"]) == (3, 0.003)
    assert at_run["meta"]["protocol_overrides"] == {"seeds": EVALUATE_SECTION}

    again = cli("evaluate", str(run_dir), "--json")
    assert again.returncode == 0, again.stderr
    payload = json.loads(again.stdout)
    # the run's own metrics (and the accuracy baselines), not the CLI's accuracy + fidelity default
    assert set(payload) == {"accuracy", "accuracy_baselines", "meta"}
    assert payload["accuracy"] == at_run["accuracy"]  # same seeds, same protocol: bit-identical
    assert payload["meta"]["protocol"] == protocol and payload["meta"]["seeds"] == [0, 1]


def test_seeds_flag_reports_mean_and_std_and_is_recorded(smoke_run, cli):
    run_dir, at_run = smoke_run
    done = cli("evaluate", str(run_dir), "--metrics", "accuracy", "--seeds", "3", "--show")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("accuracy cnn"))
    # "± std" is left out when the seeds agree exactly (e.g. three classifiers all at chance on a collapsed release)
    found = re.match(r"accuracy cnn: ([\d.]+)(?: ± ([\d.]+))? %", line)
    mean, std = float(found.group(1)), float(found.group(2) or 0.0)
    assert "seeds from the call" in done.stdout
    written = json.loads((run_dir / "diagnostics" / "metrics.json").read_text())
    runs = written["accuracy"]["cnn"]["runs"]
    assert len(runs) == 3 and runs[:2] == at_run["accuracy"]["cnn"]["runs"]  # seeds 0 and 1 train as before
    assert mean == pytest.approx(np.mean(runs), abs=0.006) and std == pytest.approx(np.std(runs), abs=0.006)
    assert written["meta"]["protocol_overrides"] == {"seeds": CALL} and written["meta"]["seeds"] == [0, 1, 2]


def test_python_evaluate_gives_the_same_number(smoke_run):
    import dpsynth

    run_dir, at_run = smoke_run
    # the run went through the CLI in this process, at this process's thread count (float sums depend on it)
    result = dpsynth.evaluate(run_dir, seeds=1, write=False)  # seed 0 of the run's two
    assert result["accuracy"]["cnn"]["runs"] == at_run["accuracy"]["cnn"]["runs"][:1]
    assert result["meta"]["protocol"] == {**at_run["meta"]["protocol"], "seeds": 1}


def test_dpimagebench_gen_npz_round_trip(smoke_run, cli, tmp_path):
    """`generate --format dpimagebench` writes DPImageBench's layout, and `evaluate gen.npz --data` scores it
    exactly as the native file of the same samples (hard labels: gen.npz has no soft labels)."""
    import dpsynth

    run_dir, _ = smoke_run
    bench = cli("generate", str(run_dir), "--num", "100", "--format", "dpimagebench")
    assert bench.returncode == 0, bench.stderr
    gen_path = run_dir / "gen" / "gen.npz"  # where DPImageBench's eval.py looks for it
    assert bench.stdout.strip() == str(gen_path)
    native_path = dpsynth.Synthesizer.load(run_dir).generate(100, tmp_path / "native.npz")  # the same draw
    with np.load(gen_path) as gen, np.load(native_path) as ours:
        assert sorted(gen.files) == ["x", "y"] and "soft_labels" in ours.files
        x, y = gen["x"], gen["y"]
        assert x.dtype == np.float32 and x.shape == (100, 1, 28, 28) and 0.0 <= x.min() and x.max() <= 1.0
        assert y.dtype == np.int64 and np.array_equal(y, ours["labels"])
        assert np.array_equal(np.round(x * 255).astype(np.uint8), ours["images"].transpose(0, 3, 1, 2))
    options = {"data": "mnist10k", "models": ["cnn"], "seeds": 1, "write": False}
    from_bench = cli(
        "evaluate", str(gen_path), "--data", "mnist10k", "--metrics", "accuracy", "--models", "cnn", "--seeds", "1"
    )
    assert from_bench.returncode == 0, from_bench.stderr
    bench_result = json.loads(gen_path.with_suffix(".metrics.json").read_text())
    # the CLI ran in this process, at the thread count used here
    native_result = dpsynth.evaluate(native_path, ["accuracy"], protocol={"labels": "hard"}, **options)
    assert bench_result["accuracy"] == native_result["accuracy"]
    assert bench_result["meta"]["protocol"] == native_result["meta"]["protocol"]
    assert bench_result["meta"]["protocol"]["labels"] == "hard" and bench_result["meta"]["method"] is None


def test_overrides_take_precedence_and_are_recorded():
    base = EvaluationProtocol(models=("cnn",), labels="soft", kd_temperature=100.0, selection="last")
    resolved = resolve_protocol(base, {"epochs": 4, "kd_temperature": None}, {"epochs": 7, "lr": 0.01}, seeds=[3, 5])
    assert resolved.protocol.epochs == 7 and resolved.protocol.lr == 0.01 and resolved.protocol.kd_temperature == 100.0
    assert resolved.seeds == (3, 5) and resolved.protocol.seeds == 2
    assert resolved.overrides == {"epochs": CALL, "lr": CALL, "seeds": CALL}
    assert resolve_protocol(base, {"epochs": 4}).overrides == {"epochs": EVALUATE_SECTION}
    assert resolve_protocol(base).seeds == (0, 1, 2)  # the protocol's three seeds
    hard = without_soft_labels(resolve_protocol(base))
    assert hard.protocol.labels == "hard" and hard.overrides == {"labels": SAMPLES}
    assert resolve_protocol(EvaluationProtocol(), call={"preset": "gpu"}).protocol.model_names == BENCHMARK_MODELS
    with pytest.raises(ConfigError, match="unknown evaluation protocol field 'temperature'"):
        resolve_protocol(base, call={"temperature": 10})
    with pytest.raises(ConfigError, match="kd_temperature must be positive"):
        resolve_protocol(base, call={"kd_temperature": 0})


def test_each_method_declares_its_protocol():
    dp_imgsyn = load_config("dp-imgsyn/mnist10k_eps1")
    student = get_method("dp-imgsyn").evaluation_protocol(dp_imgsyn)
    section = dp_imgsyn.section.student
    assert (student.labels, student.selection, student.models) == ("soft", "last", (section.model,))
    assert (student.kd_temperature, student.epochs, student.lr) == (section.temperature, section.epochs, 1e-3)
    paper_student = get_method("dp-imgsyn").evaluation_protocol(load_config("dp-imgsyn/celeba_gender_eps10_lsun"))
    assert paper_student.lr == EvaluationProtocol.lr  # the paper's SGD lr of 0.1 is not applied to Adam
    hard = get_method("dpdm").evaluation_protocol(load_config("dpdm/mnist10k_eps1"))
    assert (hard.labels, hard.selection) == ("hard", "synthetic")


def test_the_run_config_cannot_select_on_private_data():
    """Noisy private-val selection spends budget, so only an explicit `dpsynth evaluate` call may ask for it."""
    import pydantic

    with pytest.raises(pydantic.ValidationError):
        EvaluateSection(selection="private-val")
    assert EvaluateSection().model_dump()["seeds"] is None  # unset: the method's protocol decides


def test_size_rule_leaves_a_release_of_full_size_as_declared():
    from dpsynth.metrics.protocol import FULL_PROTOCOL_SAMPLES, size_protocol

    paper = EvaluationProtocol(models=("resnet18",), preset="gpu", epochs=200, labels="soft", selection="last")
    for n in (FULL_PROTOCOL_SAMPLES, 2000, 60000):  # the mnist10k-cpu presets release 2,000 to 10,000
        assert size_protocol(paper, n, (28, 28, 1)) == (paper, [])


def test_size_rule_shrinks_a_small_releases_classifier_and_epochs():
    from dpsynth.metrics.protocol import SIZE_RULE, size_protocol

    paper = EvaluationProtocol(models=("resnet18",), preset="gpu", epochs=200, labels="soft", selection="last")
    sized, why = size_protocol(paper, 200, (25, 25, 1))
    assert (sized.models, sized.preset, sized.seeds) == (("cnn",), "cpu", 3)
    assert sized.epochs == 32  # max(10, ceil(5,000 / (200 * 625 / 784)))
    assert (sized.labels, sized.selection) == ("soft", "last")  # what the method learns from is not sized
    assert [entry.field for entry in why] == ["models", "preset", "epochs"] and all(entry.why for entry in why)
    # the benchmark family collapses to one CNN; the default protocol's 10 epochs are never cut
    bench, _ = size_protocol(EvaluationProtocol(preset="gpu"), 500, (32, 32, 3))
    assert bench.model_names == ("cnn",) and bench.epochs == 10
    assert size_protocol(EvaluationProtocol(), 100, (8, 8, 1)) == (EvaluationProtocol(), [])
    # an explicit value (the run's evaluate section, the call) wins over the rule, field by field
    resolved = resolve_protocol(sized, {"epochs": 5}, {"models": ["resnet18"]}, None, why)
    assert resolved.protocol.epochs == 5 and resolved.protocol.models == ("resnet18",)
    assert resolved.overrides == {"models": CALL, "preset": SIZE_RULE, "epochs": EVALUATE_SECTION}
    assert [entry.field for entry in resolved.sizing] == ["preset"]
    assert resolved.meta()["protocol_sizing"][0]["field"] == "preset"
