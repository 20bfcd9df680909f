"""docs/index.md reaches every page under docs/, and no relative link of the docs is broken (a file that is not
there, or a heading anchor that no heading of the target page makes)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "index.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings (duplicates numbered), plus explicit ``id``/``name``s."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    anchors: set[str] = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, fragment = target.partition("#")
    return (page if not path else (page.parent / path).resolve()), fragment


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *sorted(ROOT.glob("docs/**/*.md"))]


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for page in _pages():
        for target in _links(page):
            path, fragment = _resolve(page, target)
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading makes #{fragment})")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_index():
    reached, queue = {INDEX}, [INDEX]
    while queue:
        page = queue.pop()
        for target in _links(page):
            path, _ = _resolve(page, target)
            if path.suffix == ".md" and path.is_file() and ROOT in path.parents and path not in reached:
                reached.add(path)
                queue.append(path)
    unreachable = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/**/*.md") if p.resolve() not in reached)
    assert not unreachable, f"link these from docs/index.md (or a page it reaches): {unreachable}"


def test_the_anchor_rule_follows_github():
    page = ROOT / "BENCHMARKS.md"
    assert "benchmark-suite-mnist10k-cpu" in _anchors(page)  # "## Benchmark suite `mnist10k-cpu`"
