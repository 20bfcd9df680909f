"""The generated parts of the docs are current: docs/api.md (docstrings), README.md's method table (the method
registry) and BENCHMARKS.md's suite table (the recorded results JSON); `dpsynth docs update` rewrites them."""

import re
import shutil
from pathlib import Path

import pytest

from dpsynth.bench.table import markers
from dpsynth.errors import DataError
from dpsynth.methods import METHODS
from dpsynth.reference import METHODS_MARKERS, api_markdown, methods_table, replace_block, stale_files, suite_table

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "regenerate: python -m dpsynth docs update"


def _between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, f"one {start} and one {end}"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_the_api_reference_is_current():
    assert (ROOT / "docs" / "api.md").read_text() == api_markdown(), REGENERATE


def test_readme_method_table_is_current_and_has_a_row_per_shipped_method():
    readme = (ROOT / "README.md").read_text()
    assert _between(readme, *METHODS_MARKERS) == methods_table().strip(), REGENERATE
    rows = [line for line in methods_table().splitlines() if line.startswith("| `") and "`method:`" not in line]
    shipped = {name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth.")}
    assert {row.split("`")[1] for row in rows} == shipped
    for row in rows:
        method, paper, mechanism, results = (cell.strip() for cell in row.strip("|").split(" | "))
        assert paper and mechanism, f"{method}: declare `paper` and `summary` on the method class"
        assert "BENCHMARKS.md#benchmark-suite-mnist10k-cpu" in results


def test_readme_starts_with_the_two_commands_a_newcomer_runs():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines.index("```bash") <= 3, "the commands come first"
    block = lines[lines.index("```bash") + 1 :][:2]
    assert block[0].startswith("make demo") and block[1].startswith("make test"), block


def test_the_benchmarks_suite_table_is_the_recorded_results_json():
    benchmarks = ROOT / "BENCHMARKS.md"
    results = ROOT / "experiments" / "results" / "mnist10k-cpu.json"
    committed = _between(benchmarks.read_text(), *markers("mnist10k-cpu"))
    assert committed == suite_table("mnist10k-cpu", results, benchmarks).strip(), REGENERATE
    assert "## Benchmark suite `mnist10k-cpu`" in benchmarks.read_text()  # the anchor README's rows link to


def test_update_rewrites_only_stale_files_and_only_between_the_markers(tmp_path, cli):
    for name in ("README.md", "BENCHMARKS.md", "docs/api.md", "docs/config-reference.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "experiments/results/mnist10k-cpu.json", tmp_path / "experiments/results")
    assert stale_files(tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(replace_block(readme, METHODS_MARKERS, "| stale |", "README.md"))
    (tmp_path / "docs" / "api.md").write_text("stale\n")
    assert set(stale_files(tmp_path)) == {tmp_path / "README.md", tmp_path / "docs" / "api.md"}
    assert cli("docs", "update", "--root", str(tmp_path), "--check").returncode == 1
    assert cli("docs", "update", "--root", str(tmp_path)).returncode == 0
    assert (tmp_path / "README.md").read_text() == readme
    assert (tmp_path / "docs" / "api.md").read_text() == api_markdown()
    assert stale_files(tmp_path) == []


def test_a_block_without_its_markers_is_refused():
    with pytest.raises(DataError, match="expected one"):
        replace_block("no markers here", METHODS_MARKERS, "table", "README.md")
    start, end = METHODS_MARKERS
    with pytest.raises(DataError, match="expected one"):
        replace_block(f"{end}\n{start}", METHODS_MARKERS, "table", "README.md")


def test_benchmarks_holds_the_current_figures_not_a_diary():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 400, "BENCHMARKS.md is the current figures; the history goes to CHANGELOG.md"
    assert not re.search(r"`[0-9a-f]{7,40}`", text), "a commit hash: name the command and machine instead"
    assert "fresh clone of" not in text
