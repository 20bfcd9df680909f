"""``report.html``: one self-contained page per run (docs/report.md).

Sections, each with a stable ``id`` so tools and tests can find them: ``samples`` (one image row
per class), ``privacy`` (the ledger's statement, with a loud warning when there is no guarantee),
``figures`` (every PNG a method released in ``figures/``), ``curves`` (``curves.jsonl``: ε spent,
clip norm and public monitors per step), ``config`` (the resolved ``config.yaml``) and ``metrics``
(``diagnostics/metrics.json`` and the privacy audit). Each section is marked "covered by ε" (computed
only from the release or public data) or "private diagnostic (not covered)" (computed from private
data without noise); ``release=True`` leaves the diagnostics out, for a page a custodian may hand out.
Images are inline base64 PNGs, so the file can be mailed or archived on its own. Every piece of text
from the run directory is escaped with :func:`html.escape`; a missing or unreadable file yields a
note, never a crash.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.errors import DPSynthError
from dpsynth.report.balance import label_balance
from dpsynth.report.grids import class_grid
from dpsynth.report.plots import image_png, png_data_uri, training_curves_svg
from dpsynth.report.usefulness import INTERVAL_NOTE, baseline_rows, format_accuracy, verdict, versus_dpsgd
from dpsynth.rundir import (
    AUDIT_FILE,
    CONFIG_FILE,
    CURVES_FILE,
    DIAGNOSTICS_DIR,
    FIGURES_DIR,
    METRICS_FILE,
    PRIVACY_FILE,
    RELEASE_REPORT_FILE,
    REPORT_FILE,
    SAMPLES_FILE,
    is_run_dir,
    read_config_file,
    read_config_text,
)

SECTION_IDS = ("samples", "privacy", "figures", "curves", "config", "metrics")
DIAGNOSTIC_SECTIONS = ("metrics",)
SAMPLES_PER_CLASS = 10
COVERED = "covered by ε"
DIAGNOSTIC = "private diagnostic (not covered)"
UNGUARANTEED = "released without a privacy guarantee"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2em; } section { margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: middle; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #666; font-style: italic; }
.warning { border: 3px solid #b00020; background: #fde7ea; color: #600010; padding: 0.8em 1em;
           font-weight: bold; margin: 0.8em 0; }
.ok { border: 1px solid #2e7d32; background: #e8f5e9; padding: 0.5em 1em; margin: 0.8em 0; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; }
.coverage { display: inline-block; padding: 0.1em 0.6em; border-radius: 0.8em; font-size: 0.85em; }
.covered { background: #e8f5e9; color: #1b5e20; } .diagnostic { background: #fff3e0; color: #8a4b00; }
.unguaranteed { background: #fde7ea; color: #600010; }
figure { margin: 1em 0; } figcaption { color: #444; }
img.pixelated { image-rendering: pixelated; }
"""


# ------------------------------------------------------------------ building blocks (shared)

#: audit.json keys of the canary audits and their headings
CANARY_KEYS = {
    "canary": "Canary audit of the engine (one training run)",
    "run_canary": "Canary audit of the method (retrained with planted canaries)",
}


def esc(value: Any) -> str:
    """Escape any value for HTML text and attributes."""
    return html.escape(str(value), quote=True)


def format_value(value: Any) -> str:
    """A compact, escaped rendering of a metric or parameter value."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:.1f}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value)
    return esc(value)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], raw_columns: Sequence[int] = ()) -> str:
    """A table; cells are formatted with :func:`format_value` except the ``raw_columns`` (trusted HTML)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            if index in raw_columns:
                cells.append(f"<td>{cell}</td>")
            else:
                numeric = isinstance(cell, (int, float)) and not isinstance(cell, bool)
                cells.append(
                    f'<td class="num">{format_value(cell)}</td>' if numeric else f"<td>{format_value(cell)}</td>"
                )
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{esc(section_id)}"><h2>{esc(title)}</h2>{body}</section>'


_COVERAGE_CLASS = {COVERED: "covered", DIAGNOSTIC: "diagnostic", UNGUARANTEED: "unguaranteed"}


def coverage_badge(coverage: str) -> str:
    """The badge that says whether ε covers a figure: :data:`COVERED`, :data:`DIAGNOSTIC` or :data:`UNGUARANTEED`."""
    return f'<p class="coverage {_COVERAGE_CLASS[coverage]}">{esc(coverage)}</p>'


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def warning_box(text: str) -> str:
    return f'<div class="warning" role="alert">{esc(text)}</div>'


def image_tag(png: bytes, alt: str, pixelated: bool = False) -> str:
    css = ' class="pixelated"' if pixelated else ""
    return f'<img{css} alt="{esc(alt)}" src="{png_data_uri(png)}">'


def html_page(title: str, body: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>"
        f'<p class="note">generated by dpsynth on {esc(stamp)}</p>{body}</body></html>\n'
    )


def read_json(path: Path) -> tuple[Any, str | None]:
    """``(content, problem)``: content is None when the file is missing or unreadable."""
    if not path.is_file():
        return None, f"{path.name} not found"
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:
        return None, f"{path.name} could not be read: {exc}"


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as ``(dotted.key, leaf)`` pairs, in file order."""
    pairs: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            pairs.extend(flatten(value, name + "."))
        else:
            pairs.append((name, value))
    return pairs


def diagnostic_file(run_dir: Path, name: str) -> Path:
    """``run_dir/diagnostics/NAME``, or ``run_dir/NAME`` in a run written before diagnostics were kept apart."""
    path = run_dir / DIAGNOSTICS_DIR / name
    return path if path.is_file() or not (run_dir / name).is_file() else run_dir / name


def read_metrics(run_dir: Path) -> tuple[Any, str | None]:
    """The run's metrics (a private diagnostic) and, when unreadable, why."""
    return read_json(diagnostic_file(run_dir, METRICS_FILE))


def read_audit(run_dir: Path) -> Any:
    """The audit figures: ``metrics.json["audit"]`` if the evaluator folded them in, else ``audit.json``."""
    metrics, _ = read_metrics(run_dir)
    if isinstance(metrics, Mapping) and isinstance(metrics.get("audit"), Mapping):
        return metrics["audit"]
    audit, _ = read_json(diagnostic_file(run_dir, AUDIT_FILE))
    return audit if isinstance(audit, Mapping) else None


def read_guarantee(run_dir: Path) -> str | None:
    privacy, _ = read_json(run_dir / PRIVACY_FILE)
    return privacy.get("guarantee", "dp") if isinstance(privacy, Mapping) else None


def release_coverage(run_dir: Path) -> str:
    """The badge of released content: covered by ε, unless the run claims no guarantee."""
    return UNGUARANTEED if read_guarantee(run_dir) in ("none", None) else COVERED


# ------------------------------------------------------------------ sections


def samples_section(run_dir: Path) -> str:
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        return html_section(
            "samples", "Samples", note(f"{SAMPLES_FILE} not found: the run has not generated samples yet.")
        )
    try:
        with np.load(path) as archive:
            images, labels = archive["images"], archive["labels"]
            soft = archive["soft_labels"] if "soft_labels" in archive.files else None
    except (OSError, KeyError, ValueError) as exc:
        return html_section("samples", "Samples", note(f"{SAMPLES_FILE} could not be read: {exc}"))
    if images.ndim != 4 or images.dtype != np.uint8 or len(images) != len(labels):
        return html_section(
            "samples",
            "Samples",
            note(f"{SAMPLES_FILE} does not follow the contract (uint8 images [N,H,W,C] and one label each)."),
        )
    num_classes = release_num_classes(run_dir, labels, soft)
    scale = max(1, 48 // images.shape[1])
    rows = []
    for cls in range(num_classes):
        members = np.flatnonzero(labels == cls)
        if len(members):
            strip = class_grid(images[members], np.zeros(len(members), np.int64), 1, SAMPLES_PER_CLASS)
            picture = image_tag(image_png(strip, scale), f"samples of class {cls}", pixelated=True)
        else:
            picture = esc("no samples")
        rows.append((str(cls), len(members), picture))
    summary = (
        f"<p>{len(images)} samples of shape {esc(tuple(images.shape[1:]))}"
        f"{', with soft labels' if soft is not None else ''}; "
        f"up to {SAMPLES_PER_CLASS} shown per class.</p>"
    )
    balance = label_balance(labels, num_classes)
    flagged = warning_box(balance["warning"].capitalize() + ".") if balance["warning"] else ""
    return html_section(
        "samples",
        "Samples",
        flagged + summary + html_table(("class", "count", "samples"), rows, raw_columns=(2,)),
    )


def release_num_classes(run_dir: Path, labels: np.ndarray, soft: np.ndarray | None) -> int:
    """The class count K of a release: the soft labels' width, else the count the run's label check recorded
    (``metrics.json["label_balance"]``, the declared K: public), else one past the largest label (a release
    that lost its last classes then looks complete; only runs from before the check lack the record)."""
    if soft is not None and soft.ndim == 2:
        return int(soft.shape[1])
    metrics, _ = read_metrics(run_dir)
    recorded = metrics.get("label_balance") if isinstance(metrics, Mapping) else None
    if isinstance(recorded, Mapping) and isinstance(recorded.get("num_classes"), int):
        return max(int(recorded["num_classes"]), int(labels.max(initial=-1) + 1))
    return int(labels.max(initial=-1) + 1)


def privacy_section(run_dir: Path, release: bool = False) -> str:
    privacy, problem = read_json(run_dir / PRIVACY_FILE)
    if not isinstance(privacy, Mapping):
        return html_section(
            "privacy",
            "Privacy",
            warning_box(
                f"No privacy statement: {problem or PRIVACY_FILE + ' is not an object'}. "
                "Until the run writes it, treat anything in this directory as private."
            ),
        )
    parts = []
    guarantee = privacy.get("guarantee", "dp")
    if guarantee == "none":
        parts.append(
            warning_box(
                "NO PRIVACY GUARANTEE. This run used a mechanism that is not differentially private "
                '("guarantee": "none"). The synthetic data and every model in this directory must be '
                "handled as the private data itself."
            )
        )
    epsilon, target = privacy.get("epsilon"), privacy.get("target_epsilon")
    if guarantee != "none" and _is_number(epsilon) and _is_number(target) and epsilon > target + 1e-9:
        parts.append(warning_box(f"The spent ε = {epsilon:.4g} exceeds the target ε = {target:.4g}."))
    audit = None if release else read_audit(run_dir)  # the audit is a private diagnostic
    if audit and any(isinstance(audit.get(k), Mapping) and audit[k].get("exceeds_claim") for k in CANARY_KEYS):
        parts.append(
            warning_box(
                "The canary audit's ε lower bound exceeds the claimed ε: the private "
                "training or its accounting is broken (see the audit below)."
            )
        )
    statement = (
        f"({format_value(epsilon)}, {format_value(privacy.get('delta'))})-differential privacy"
        if guarantee == "dp"
        else "no differential-privacy claim"
    )
    parts.append(f"<p><strong>Guarantee:</strong> {statement}.</p>")
    parts.append(
        html_table(
            ("quantity", "value"),
            [
                ("guarantee", guarantee),
                ("ε spent", epsilon),
                ("target ε", target),
                ("δ", privacy.get("delta")),
                ("accountant", privacy.get("accountant")),
            ],
        )
    )
    mechanisms = [m for m in privacy.get("mechanisms", []) if isinstance(m, Mapping)]
    if mechanisms:
        columns = ["name"] + sorted(
            {k for m in mechanisms for k in m if k != "name"},
            key=lambda k: (k not in ("noise_multiplier", "sample_rate", "steps"), k),
        )
        parts.append("<h3>Mechanisms in the ledger</h3>")
        parts.append(html_table(columns, [[m.get(c) for c in columns] for m in mechanisms]))
    else:
        parts.append(note("The ledger lists no mechanism: no private data was read."))
    assumptions = [a for a in privacy.get("assumptions", []) if isinstance(a, str)]
    if assumptions:
        parts.append("<h3>Assumptions</h3><ul>" + "".join(f"<li>{esc(a)}</li>" for a in assumptions) + "</ul>")
    return html_section("privacy", "Privacy", "".join(parts))


def metrics_section(run_dir: Path) -> str:
    metrics, problem = read_metrics(run_dir)
    parts = [
        note(
            "Every figure here was computed from private data (the test, train or val split) without "
            "noise: it is not covered by ε and is for the data custodian only; "
            "'dpsynth report RUN --release' leaves it out."
        )
    ]
    if isinstance(metrics, Mapping):
        if isinstance(metrics.get("skipped"), str):  # which metric the install could not compute, and the fix
            parts.append(note(metrics["skipped"]))
        parts.append(usefulness_block(metrics))
        rows = [
            (key, value) for key, value in flatten({k: v for k, v in metrics.items() if k not in ("audit", "skipped")})
        ]
        parts.append(html_table(("metric", "value"), rows) if rows else note(f"{METRICS_FILE} is empty."))
    else:
        parts.append(note(f"No metrics yet ({problem}); run 'dpsynth evaluate RUN_DIR' to compute them."))
    parts.append(audit_block(read_audit(run_dir)))
    return html_section("metrics", "Metrics", "".join(parts))


def usefulness_block(metrics: Mapping[str, Any]) -> str:
    """How useful the release is (``id="usefulness"``): every accuracy with its 95 % interval and test size,
    beside the chance and majority-class rates, and one plain sentence on the headline figure, in a red
    box when the release is no better than always answering the majority class."""
    accuracy, baselines = metrics.get("accuracy"), metrics.get("accuracy_baselines")
    entries = {k: v for k, v in accuracy.items() if isinstance(v, Mapping)} if isinstance(accuracy, Mapping) else {}
    if not any("mean" in entry for entry in entries.values()):
        return ""
    parts = ['<h3 id="usefulness">Usefulness</h3>']
    judged = verdict(accuracy, baselines)
    if judged is None:
        parts.append(note("No majority-class baseline recorded: re-run 'dpsynth evaluate RUN' to add it."))
    else:
        tone, sentence = judged
        parts.append(warning_box(sentence) if tone == "warning" else f'<div class="{tone}">{esc(sentence)}</div>')
    rows = [
        (name, format_accuracy(entry), entry.get("versus_majority", "—"))
        for name, entry in entries.items()
        if "mean" in entry
    ]
    parts.append(html_table(("classifier", "accuracy (mean ± std over seeds, 95 % interval)", "vs majority"), rows))
    versus = versus_dpsgd(accuracy, baselines)
    if versus is not None:
        parts.append(f'<div class="note">{esc(versus)}</div>')
    if isinstance(baselines, Mapping):
        parts.append(html_table(("baseline", "accuracy"), baseline_rows(baselines)))
        parts.append(note(INTERVAL_NOTE))
    return "".join(parts)


def audit_block(audit: Any) -> str:
    """The privacy-audit subsection (membership inference and the canary ε lower bound)."""
    title = '<h3 id="audit">Privacy audit</h3>'
    if not isinstance(audit, Mapping):
        return title + note(f"No privacy audit yet ({AUDIT_FILE} not found; see docs/audit.md).")
    parts = [
        title,
        note(
            "Audit figures read private data and are not differentially private: "
            "they are for the data custodian, not for release."
        ),
    ]
    attacks = audit.get("membership_inference")
    if isinstance(attacks, Mapping) and attacks:
        rows = [
            (name, a.get("auc"), a.get("tpr_at_fpr"), a.get("fpr"), a.get("num_members"), a.get("num_nonmembers"))
            for name, a in attacks.items()
            if isinstance(a, Mapping)
        ]
        parts.append("<h4>Membership inference</h4>")
        parts.append(html_table(("attack", "AUC", "TPR at FPR", "FPR", "members", "non-members"), rows))
        parts.append(note("A TPR close to the FPR (0.10) means the attack does no better than guessing."))
    for key, title in CANARY_KEYS.items():
        canary = audit.get(key)
        if not isinstance(canary, Mapping):
            continue
        parts.append(f"<h4>{title}</h4>")
        if canary.get("exceeds_claim"):
            parts.append(warning_box("The empirical ε lower bound exceeds the claimed ε."))
        keys = (
            "claimed_epsilon",
            "epsilon_lower_bound",
            "epsilon_interval",
            "confidence",
            "delta",
            "num_canaries",
            "num_guesses",
            "num_correct",
            "noise_multiplier",
            "sample_rate",
            "steps",
            "canary_kind",
        )
        parts.append(html_table(("quantity", "value"), [(k, canary.get(k)) for k in keys if k in canary]))
    return "".join(parts)


def figures_section(run_dir: Path) -> str:
    """Every PNG a method released in ``figures/`` (caption from a same-named ``.txt``), covered by ε."""
    pngs = sorted((run_dir / FIGURES_DIR).glob("*.png")) if (run_dir / FIGURES_DIR).is_dir() else []
    if not pngs:
        return html_section("figures", "Released figures", note("The method released no extra figures."))
    parts = []
    for png in pngs:
        caption_path = png.with_suffix(".txt")
        caption = caption_path.read_text(errors="replace").strip() if caption_path.is_file() else png.stem
        try:
            data = png.read_bytes()
        except OSError as exc:
            parts.append(note(f"{png.name} could not be read: {exc}"))
            continue
        parts.append(f"<figure>{image_tag(data, caption)}<figcaption>{esc(caption)}</figcaption></figure>")
    return html_section("figures", "Released figures", "".join(parts))


def curves_section(run_dir: Path) -> str:
    path = run_dir / CURVES_FILE
    if not path.is_file():
        return html_section(
            "curves", "Training curves", note(f"{CURVES_FILE} not found: no training curves were logged.")
        )
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and _is_number(record.get("step")):
            records.append(record)
    svg = training_curves_svg(records)
    body = f"<figure>{svg}</figure>" if svg else note(f"{CURVES_FILE} holds no numeric series.")
    if records:
        body += note(f"{len(records)} logged steps, last step {records[-1]['step']}.")
    if skipped:
        body += note(f"{skipped} malformed line(s) skipped.")
    return html_section("curves", "Training curves", body)


def config_section(run_dir: Path) -> str:
    if not is_run_dir(run_dir):
        return html_section("config", "Configuration", note(f"{CONFIG_FILE} not found."))
    text = read_config_text(run_dir, errors="replace")
    return html_section("config", "Configuration (resolved)", f"<pre>{esc(text)}</pre>")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_title(run_dir: Path) -> str:
    """``dpsynth report: <run> (<method> on <dataset>)`` from config.yaml, if readable."""
    import yaml

    method = dataset = None
    try:
        config = read_config_file(run_dir)
        method, dataset = config.get("method"), (config.get("data") or {}).get("private")
    except (OSError, ValueError, AttributeError, yaml.YAMLError, DPSynthError):
        pass
    details = " on ".join(str(x) for x in (method, dataset) if x)
    return f"dpsynth report: {run_dir.resolve().name}" + (f" ({details})" if details else "")


# ------------------------------------------------------------------ entry points


def render_report(run_dir: str | Path, release: bool = False) -> str:
    """The report page of ``run_dir`` as an HTML string; ``release`` leaves out the private diagnostics."""
    run_dir = Path(run_dir)
    covered = release_coverage(run_dir)
    parts = []
    if read_guarantee(run_dir) == "none":
        parts.append(
            warning_box(
                "NO PRIVACY GUARANTEE: this run opted into a mechanism that is not differentially "
                'private ("guarantee": "none"). Treat everything below as private data.'
            )
        )
    parts.append(_badged(samples_section(run_dir), covered))
    parts.append(_badged(privacy_section(run_dir, release=release), covered))
    parts.append(_badged(figures_section(run_dir), covered))
    parts.append(_badged(curves_section(run_dir), covered))
    parts.append(_badged(config_section(run_dir), covered))
    if release:
        parts.append(
            note(
                "Release version: the private diagnostics (metrics computed on private data, the "
                "privacy audit) are left out."
            )
        )
    else:
        parts.append(_badged(metrics_section(run_dir), DIAGNOSTIC))
    return html_page(run_title(run_dir) + (" (release)" if release else ""), "".join(parts))


def _badged(section: str, coverage: str) -> str:
    head, sep, rest = section.partition("</h2>")
    return head + sep + coverage_badge(coverage) + rest


def write_report(run_dir: str | Path, release: bool = False, out: str | Path | None = None) -> Path:
    """Write ``run_dir/report.html`` (``release``: ``run_dir/report-release.html``, or ``out``) atomically."""
    from dpsynth.checkpoint import atomic_write_text

    run_dir = Path(run_dir)
    path = Path(out) if out is not None else run_dir / (RELEASE_REPORT_FILE if release else REPORT_FILE)
    atomic_write_text(path, render_report(run_dir, release=release))
    return path
