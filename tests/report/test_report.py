"""The per-run HTML report and the multi-run comparison, on run directories written by the test."""

from __future__ import annotations

import argparse
import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml

from dpsynth.errors import DataError
from dpsynth.report.compare import mean_accuracy, summarize_run, write_comparison
from dpsynth.report.html import SECTION_IDS, write_report


class PageParser(HTMLParser):
    """Collects ids, images and text; records unbalanced tags so malformed HTML fails the test."""

    VOID = frozenset({"meta", "img", "br", "hr", "input", "link"})

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.images: list[str] = []
        self.links: list[str] = []
        self.alerts = 0
        self.text: list[str] = []
        self.rows: list[list[str]] = []  # table rows, cell texts
        self.badges: dict[str, str] = {}  # section id -> its coverage badge
        self._section: str | None = None
        self._cell: list[str] | None = None
        self._badge: list[str] | None = None
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if "id" in attributes:
            self.ids.add(attributes["id"])
        if tag == "img":
            self.images.append(attributes.get("src", ""))
        if tag == "a":
            self.links.append(attributes.get("href", ""))
        if attributes.get("class") == "warning":
            self.alerts += 1
        if tag == "section":
            self._section = attributes.get("id")
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._cell = []
        if "coverage" in (attributes.get("class") or "").split():
            self._badge = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        if tag == "p" and self._badge is not None:
            self.badges[self._section] = "".join(self._badge)
            self._badge = None
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)
        for sink in (self._cell, self._badge):
            if sink is not None:
                sink.append(data)


def parse(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text())
    parser.close()
    assert parser.errors == [] and parser.stack == [], (parser.errors, parser.stack)
    return parser


def make_run(
    root: Path,
    name: str,
    *,
    method: str = "dpsgd-classifier",
    epsilon: float = 1.0,
    guarantee: str = "dp",
    with_metrics: bool = True,
    accuracy: float = 0.8,
    fid: float = 40.0,
    with_figure: bool = False,
) -> Path:
    """A run directory with real files in the run-directory contract (docs/contract.md)."""
    run = root / name
    run.mkdir(parents=True)
    config = {
        "method": method,
        "name": name,
        "seed": 0,
        "data": {"private": "digits8x8", "public": None},
        "privacy": {"epsilon": epsilon, "delta": 1e-5, "accountant": "prv"},
        method: {"note": "<script>alert('x')</script>"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(30, 8, 8, 1), dtype=np.uint8)
    labels = np.repeat(np.arange(3), 10).astype(np.int64)
    np.savez(run / "samples.npz", images=images, labels=labels)
    privacy = {
        "epsilon": epsilon * 0.999 if guarantee == "dp" else None,
        "delta": 1e-5,
        "accountant": "prv",
        "guarantee": guarantee,
        "target_epsilon": epsilon,
        "mechanisms": [
            {"name": "dpsgd", "noise_multiplier": 1.1, "sample_rate": 0.01, "steps": 300},
            {"name": "stats", "noise_multiplier": 5.0, "count": 1},
        ],
    }
    (run / "privacy.json").write_text(json.dumps(privacy))
    if with_metrics:
        (run / "diagnostics").mkdir()
        (run / "diagnostics" / "metrics.json").write_text(
            json.dumps(
                {
                    "accuracy": {"logreg": accuracy - 0.1, "mlp": accuracy, "cnn": accuracy + 0.1},
                    "fid": fid,
                    "transfer": {"mean": 92.60000000000001, "runs": [92.60000000000001, 92.6]},
                }
            )
        )
        audit = {
            "membership_inference": {
                "nearest_neighbour": {
                    "attack": "nearest_neighbour",
                    "auc": 0.52,
                    "tpr_at_fpr": 0.11,
                    "fpr": 0.1,
                    "num_members": 100,
                    "num_nonmembers": 100,
                }
            },
            "canary": {
                "claimed_epsilon": epsilon,
                "epsilon_lower_bound": 0.0,
                "exceeds_claim": False,
                "num_canaries": 64,
                "num_guesses": 16,
                "num_correct": 9,
                "confidence": 0.95,
            },
        }
        (run / "diagnostics" / "audit.json").write_text(json.dumps(audit))
    if with_figure:
        from dpsynth.report.plots import image_png

        (run / "figures").mkdir()
        (run / "figures" / "selection.png").write_bytes(image_png(rng.integers(0, 256, (8, 16), dtype=np.uint8)))
        (run / "figures" / "selection.txt").write_text("public classes selected by the noisy histogram\n")
    with open(run / "curves.jsonl", "w") as handle:
        handle.writelines(
            json.dumps({"step": step, "loss": 2.0 / step, "epsilon": epsilon * step / 20}) + "\n"
            for step in range(1, 21)
        )
    return run


def test_report_has_every_section_and_inline_images(tmp_path):
    run = make_run(tmp_path, "full")
    path = write_report(run)
    assert path == run / "report.html"
    page = parse(path)
    assert set(SECTION_IDS) | {"audit"} <= page.ids
    # 3 class strips, inline PNGs that decode, and the curves as inline SVG: a line per logged series
    assert len(page.images) == 3
    curves = path.read_text().split('id="curves"', 1)[1].split("</section>", 1)[0]
    assert curves.count("<svg") == 1 and curves.count("<polyline") == 2  # loss and ε spent, 20 steps each
    assert ">loss</text>" in curves and ">ε spent</text>" in curves and ">20</text>" in curves  # the last step
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert ["dpsgd", "1.1", "0.01", "300"] == page.rows[_row_index(page, "dpsgd")][:4]  # the mechanism table
    assert ["accuracy.cnn", "0.9"] in page.rows  # 0.8 + 0.1 from diagnostics/metrics.json, rounded
    assert ["ε spent", "0.999"] in page.rows
    assert page.alerts == 0
    html_source = path.read_text()
    assert "<script>" not in html_source and "&lt;script&gt;" in html_source  # config text escaped


def test_curves_svg_draws_each_finite_series_and_escapes_its_name():
    from dpsynth.report.plots import training_curves_svg

    assert training_curves_svg([]) is None and training_curves_svg([{"step": 1, "note": "text"}]) is None
    svg = training_curves_svg([{"step": 1, "<b>": 1.0}, {"step": 2, "<b>": float("nan")}, {"step": 3, "loss": 0.5}])
    assert "&lt;b&gt;" in svg and "<b>" not in svg
    assert svg.count("<circle") == 2 and "<polyline" not in svg  # one finite point per series: a dot each
    wide = training_curves_svg([{"step": s, "loss": 1 / s} for s in range(1, 5)])
    points = wide.split('points="', 1)[1].split('"', 1)[0].split()
    assert len(points) == 4 and points == sorted(points, key=lambda p: float(p.split(",")[0]))


def _row_index(page: PageParser, first_cell: str) -> int:
    return next(i for i, row in enumerate(page.rows) if row and row[0] == first_cell)


def test_report_marks_what_epsilon_covers(tmp_path):
    run = make_run(tmp_path, "marked", with_figure=True)
    page = parse(write_report(run))
    for section in ("samples", "privacy", "figures", "curves", "config"):
        assert page.badges[section] == "covered by ε", section
    assert page.badges["metrics"] == "private diagnostic (not covered)"
    # The method's extra figure is shown with its caption; samples (3) and the figure are inline PNGs.
    assert len(page.images) == 4 and "public classes selected by the noisy histogram" in "".join(page.text)


def test_report_numbers_have_sensible_precision(tmp_path):
    run = make_run(tmp_path, "precise")
    source = write_report(run).read_text()
    assert "92.60000000000001" not in source and "0.9000000000000001" not in source
    page = parse(run / "report.html")
    assert ["transfer.mean", "92.6"] in page.rows and ["transfer.runs", "92.6, 92.6"] in page.rows


def test_release_report_leaves_private_diagnostics_out(tmp_path):
    from dpsynth.rundir import RELEASE_REPORT_FILE as RELEASE_FILE

    run = make_run(tmp_path, "release", with_figure=True)
    path = write_report(run, release=True)
    assert path == run / RELEASE_FILE
    page = parse(path)
    assert {"samples", "privacy", "figures", "curves", "config"} <= page.ids
    assert "metrics" not in page.ids and "audit" not in page.ids
    assert set(page.badges.values()) == {"covered by ε"}
    text = "".join(page.text)
    assert "92.6" not in text and "accuracy" not in text and "nearest_neighbour" not in text
    assert not any(row and row[0].startswith("accuracy") for row in page.rows)


def test_cli_release_report(tmp_path, capsys):
    from dpsynth.cli.report import register

    runs = [make_run(tmp_path, "a", epsilon=1.0), make_run(tmp_path, "b", epsilon=5.0)]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", str(runs[0]), "--release", "--json"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["report"] == str(runs[0] / "report-release.html")
    assert printed["runs"][0]["accuracy"] is None and printed["runs"][0]["mia_tpr"] is None
    assert "metrics" not in parse(runs[0] / "report-release.html").ids
    out = tmp_path / "cmp.html"
    args = parser.parse_args(["report", str(runs[0]), str(runs[1]), "--release", "--out", str(out), "--json"])
    assert args.func(args) == 0
    capsys.readouterr()
    page = parse(out)
    assert page.rows[0] == ["run", "method", "dataset", "ε", "target ε", "δ", "guarantee"]
    assert all(len(row) == 7 for row in page.rows) and page.images == []  # no accuracy/FID columns or plots
    assert page.links == ["a/report-release.html", "b/report-release.html"]


def test_report_warns_loudly_without_guarantee(tmp_path):
    run = make_run(tmp_path, "unsound", guarantee="none", method="dppm")
    page = parse(write_report(run))
    assert page.alerts >= 1
    assert "".join(page.text).index("NO PRIVACY GUARANTEE") < "".join(page.text).index("Samples")  # a top banner
    assert page.badges["samples"] == "released without a privacy guarantee"
    assert page.badges["metrics"] == "private diagnostic (not covered)"


def test_report_survives_missing_files(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "config.yaml").write_text("method: dpdm\n")
    page = parse(write_report(run))
    assert set(SECTION_IDS) <= page.ids
    text = "".join(page.text)
    assert "No metrics yet" in text and "samples.npz not found" in text and "No privacy statement" in text
    assert page.images == []


def test_comparison_of_two_runs(tmp_path):
    low = make_run(tmp_path / "runs", "eps1", epsilon=1.0, accuracy=0.7, fid=60.0)
    high = make_run(tmp_path / "runs", "eps10", epsilon=10.0, accuracy=0.9, fid=20.0)
    write_report(low)
    out = tmp_path / "out" / "compare.html"
    path, summaries = write_comparison([low, high], out)
    assert path == out
    page = parse(out)
    assert {"runs", "tradeoffs"} <= page.ids
    assert len(page.images) == 2  # accuracy vs ε and FID vs ε
    assert [s.run for s in summaries] == ["eps1", "eps10"]
    assert summaries[0].accuracy == pytest.approx(0.7) and summaries[1].fid == pytest.approx(20.0)
    assert summaries[1].epsilon == pytest.approx(9.99)
    assert summaries[0].mia_tpr == pytest.approx(0.11)
    # The link to the run's own report is relative to the comparison page and resolves.
    assert page.links == ["../runs/eps1/report.html"]
    assert (out.parent / page.links[0]).resolve() == (low / "report.html").resolve()


def test_comparison_marks_runs_without_guarantee_and_skips_them_in_plots(tmp_path):
    sound = make_run(tmp_path, "sound", epsilon=10.0)
    unsound = make_run(tmp_path, "unsound", guarantee="none", method="dppm")
    _, summaries = write_comparison([sound, unsound], tmp_path / "c.html")
    assert summaries[1].epsilon is None and summaries[1].guarantee == "none"
    page = parse(tmp_path / "c.html")
    assert page.alerts == 1 and "unsound" in "".join(page.text)


def test_comparison_rejects_a_non_run(tmp_path):
    with pytest.raises(DataError):
        write_comparison([tmp_path / "missing"], tmp_path / "x.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError):
        summarize_run(tmp_path / "empty")


def test_mean_accuracy_shapes():
    assert mean_accuracy(0.5) == 0.5
    assert mean_accuracy({"mean": 0.9, "mlp": 0.1}) == 0.9
    assert mean_accuracy({"mlp": 0.6, "cnn": {"accuracy": 0.8}}) == pytest.approx(0.7)
    assert mean_accuracy({"cnn": {"mean": 0.4, "std": 0.1}}) == pytest.approx(0.4)
    assert mean_accuracy("n/a") is None
    evaluator_shape = {
        "mlp": {"mean": 90.0, "std": 1.0, "runs": [89.0, 91.0], "epochs": [3, 4]},
        "cnn": {"mean": 96.0, "std": 0.0, "runs": [96.0], "epochs": [5]},
        "mean_of_models": {"mean": 93.0, "std": 3.0},
    }
    assert mean_accuracy(evaluator_shape) == pytest.approx(93.0)
    del evaluator_shape["mean_of_models"]
    assert mean_accuracy(evaluator_shape) == pytest.approx(93.0)


def test_cli_report_command(tmp_path, capsys):
    from dpsynth.cli.report import register

    runs = [make_run(tmp_path, "a", epsilon=1.0), make_run(tmp_path, "b", epsilon=5.0)]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "cmp.html"
    args = parser.parse_args(["report", str(runs[0]), str(runs[1]), "--out", str(out), "--json"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["report"] == str(out) and [r["run"] for r in printed["runs"]] == ["a", "b"]
    assert out.is_file()
