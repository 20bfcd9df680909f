"""The repository stands alone: its docs, code, presets and tests never point into the design workspace outside it
or at the tracker's issue numbers; they cite papers (title, arXiv id) and the repository's own docs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|\bissues? #?\d", re.IGNORECASE)


def test_no_doc_code_preset_or_test_points_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/**/*.md")]
    files += [*ROOT.glob("dpsynth/**/*.py"), *ROOT.glob("dpsynth/**/*.yaml"), *ROOT.glob("experiments/*.py")]
    files += [*ROOT.glob("tests/**/*.py")]
    offenders = [str(path.relative_to(ROOT)) for path in files if OUTSIDE.search(path.read_text(encoding="utf-8"))]
    assert not offenders, f"these cite the design workspace or an issue number; cite a paper or docs/: {offenders}"
