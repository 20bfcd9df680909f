"""``dpsynth bench smoke`` end to end on two methods: the JSON, the table, the plot, skipping and resuming."""

import json

import pytest
from conftest import REPO, interrupt_after_steps

from dpsynth.bench.table import markers
from dpsynth.config import find_config

CELL_KEYS = {
    "method",
    "preset",
    "epsilon",
    "accuracy_mean",
    "accuracy_std",
    "fid",
    "canary_epsilon_lower",
    "wall_s",
    "peak_mib",
    "command",
    "machine",
}
TINY = ["--run-budget-min", "30"]  # the budget is not under test here: a loaded machine must not fail the run


@pytest.mark.e2e
def test_bench_smoke_reports_each_runs_own_numbers_skips_finished_runs_and_resumes(cli, tmp_path, monkeypatch):
    # The bench in this process (its runs are processes of their own either way), in the directory it writes to;
    # its runs import this checkout's dpsynth, as run_cli's processes do.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    md = tmp_path / "BENCHMARKS.md"
    start, end = markers("smoke")
    md.write_text(f"# Benchmarks\n\nkept before\n\n{start}\nold\n{end}\n\nkept after\n")
    paths = ["--out", "out", "--results", "results.json", "--benchmarks-md", str(md), "--plot", "img/smoke.png"]
    # the baseline cell was interrupted before (config.yaml and a checkpoint, no result): the bench continues it
    # with --resume, beside the dppm cell it runs from the start
    interrupted = tmp_path / "out" / "smoke" / "dpsgd-classifier_eps10"
    with pytest.raises(KeyboardInterrupt):
        interrupt_after_steps(
            find_config("dpsgd-classifier/smoke"),
            interrupted,
            3,  # past the checkpoint at step 2 of 4
            ["dpsgd-classifier.steps=4", "dpsgd-classifier.checkpoint_every=2"],
        )
    assert (interrupted / "config.yaml").is_file() and not (interrupted / "diagnostics" / "metrics.json").exists()
    first = cli("bench", "smoke", "--only", "dpsgd-classifier,dppm", "--epsilons", "10", *paths, *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "--resume" in first.stderr and "resuming" in (interrupted / "log.txt").read_text()

    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["name"], c["epsilon"]["target"]): c for c in results["cells"]}
    assert len(cells) == 14  # every cell of the suite; the ones not selected are not run yet
    baseline, dppm = cells[("dpsgd-classifier", 10.0)], cells[("dppm", 10.0)]
    for cell in (baseline, dppm):
        assert CELL_KEYS <= set(cell) and cell["status"] == "finished", cell
        run_dir = tmp_path / cell["runs"][0]["run_dir"]
        privacy = json.loads((run_dir / "privacy.json").read_text())
        metrics = json.loads((run_dir / "diagnostics" / "metrics.json").read_text())
        audit = json.loads((run_dir / "diagnostics" / "audit.json").read_text())
        [(model, headline)] = [(k, v) for k, v in metrics["accuracy"].items() if isinstance(v, dict)]  # one classifier
        assert cell["accuracy_model"] == model == ("logreg" if cell is dppm else "dpsgd-classifier")
        assert cell["accuracy_mean"] == headline["mean"] and cell["accuracy_std"] == headline["std"]
        assert cell["epsilon"]["spent"] == privacy["epsilon"] <= 10.0
        assert cell["canary_epsilon_lower"] == audit["canary"]["epsilon_lower_bound"] >= 0.0
        assert cell["peak_mib"] > 50 and cell["wall_s"] > 0 and cell["machine"]["torch"]
        assert cell["command"].startswith(f"dpsynth run {cell['preset']} --out out/smoke/")
    assert cells[("dppm", 1.0)]["status"] == "pending"
    # the numbers are the run's own evaluation, which the bench asked for through the evaluate section
    dppm_metrics = json.loads((tmp_path / dppm["runs"][0]["run_dir"] / "diagnostics" / "metrics.json").read_text())
    assert dppm["fid"] == dppm_metrics["fid"] > 0
    assert dppm_metrics["meta"]["fid_reference"] == "test" and dppm_metrics["meta"]["max_fid_samples"] == 6
    assert baseline["fid"] is None and 1.0 < baseline["accuracy_mean"] <= 100.0
    # the resumed baseline spent its plan, calibrated into [target - 0.01, target]: no step lost or counted twice
    assert 10.0 - 0.01 <= baseline["epsilon"]["spent"] <= 10.0

    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept before\n\n") and text.endswith(f"{end}\n\nkept after\n")
    section = text.split(start)[1].split(end)[0]
    assert (
        "old" not in section and "dpsgd-classifier (baseline" in section and "| dppm | `dppm/smoke` | 10 |" in section
    )
    assert "![accuracy against ε, smoke](img/smoke.png)" in section
    assert (tmp_path / "img" / "smoke.png").read_bytes().startswith(b"\x89PNG")

    run_dirs = [tmp_path / cell["runs"][0]["run_dir"] for cell in (baseline, dppm)]
    stamps = [(d / "privacy.json").stat().st_mtime_ns for d in run_dirs]
    again = cli("bench", "smoke", "--only", "dpsgd-classifier,dppm", "--epsilons", "10", *paths, *TINY)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("finished earlier, skipped") == 2 and "dpsynth run" not in again.stderr
    assert [(d / "privacy.json").stat().st_mtime_ns for d in run_dirs] == stamps

    # a run made from an older version of its preset is still skipped, but the bench says which settings moved
    saved = run_dirs[1] / "config.yaml"
    older = saved.read_text().replace("  accountant: prv\n", "  accountant: rdp\n", 1)
    assert older != saved.read_text()
    saved.write_text(older)
    stale = cli("bench", "smoke", "--only", "dppm", "--epsilons", "10", *paths, *TINY)
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert "its preset has changed since it ran: privacy.accountant; delete" in stale.stderr

    spent = f"{baseline['epsilon']['spent']:.3f}"
    assert f"| dpsgd-classifier (baseline: DP-SGD on the private data) | `dpsgd-classifier/smoke` | 10 | {spent} |" in (
        md.read_text()
    )
