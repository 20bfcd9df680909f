"""The repository stands alone: its docs, code and presets never point into the design workspace outside it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "../shared"


def test_no_doc_code_or_preset_points_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/**/*.md")]
    files += [*ROOT.glob("dpsynth/**/*.py"), *ROOT.glob("dpsynth/**/*.yaml"), *ROOT.glob("experiments/*.py")]
    offenders = [str(path.relative_to(ROOT)) for path in files if OUTSIDE in path.read_text(encoding="utf-8")]
    assert not offenders, f"these files refer to {OUTSIDE}: cite the paper (title, arXiv id) instead: {offenders}"
