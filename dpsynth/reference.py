"""The generated parts of the docs: the API reference (docs/api.md) from docstrings, README.md's method table
from the method registry, and BENCHMARKS.md's suite tables from the recorded results JSON.

Each is a pure function of the code (and, for a suite table, of ``experiments/results/SUITE.json``), so a test
regenerates it and compares it with the committed text, as it does for docs/config-reference.md. ``dpsynth docs
update`` rewrites all of them in place; a generated block inside a hand-written page sits between two markers
and nothing outside them changes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pprint
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dpsynth.errors import DataError

#: The public Python API the reference covers: the package's exports, the method contract a method
#: implements, and the contract tests a method's test class inherits (docs/methods/authoring.md).
API_MODULES: tuple[tuple[str, str], ...] = (
    ("dpsynth", "The package: fit a method on your images, sample, evaluate (docs/python.md)."),
    ("dpsynth.contract", "The method contract: what every synthesis method declares and implements."),
    ("dpsynth.testing", "The contract tests a method's test class inherits (docs/methods/authoring.md)."),
)
#: Names a module re-exports as part of its public surface although they are defined elsewhere.
REEXPORTED = {"dpsynth.contract": ("EvaluationProtocol",)}

METHODS_MARKERS = ("<!-- methods:start -->", "<!-- methods:end -->")
#: Where README.md's rows point for each method's measured figures: the generated suite table.
RESULTS_LINK = "[`mnist10k-cpu` table](BENCHMARKS.md#benchmark-suite-mnist10k-cpu)"

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


# ------------------------------------------------------------------------------ API reference
def api_markdown() -> str:
    """docs/api.md: every public class and function of :data:`API_MODULES`, with its signature and docstring."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `dpsynth docs api`; do not edit by hand (`dpsynth docs update` rewrites",
        "it). The guide to the Python API is [python.md](python.md); the contract in prose is",
        "[contract.md](contract.md) and [architecture.md](architecture.md).",
        "",
    ]
    for module_name, blurb in API_MODULES:
        lines += [f"- [`{module_name}`](#{_slug(module_name)}): {blurb}"]
    lines.append("")
    for module_name, blurb in API_MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## {module_name}", "", blurb, ""]
        for name in _public_names(module):
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                lines += _document(f"{module_name}.{name}", obj, level=3)
            else:
                lines += _data(module, name, obj)
    return "\n".join(lines).rstrip() + "\n"


def _public_names(module: Any) -> list[str]:
    """``__all__`` where the module declares it, else the classes and functions defined in it, in source order;
    plus :data:`REEXPORTED`."""
    if hasattr(module, "__all__"):
        names = [name for name in module.__all__ if not name.startswith("_")]
    else:
        defined = [
            (inspect.getsourcelines(obj)[1], name)
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == module.__name__
        ]
        names = [name for _, name in sorted(defined)]
    return names + [name for name in REEXPORTED.get(module.__name__, ()) if name not in names]


def _document(qualified: str, obj: Any, level: int) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "def"
    lines = [f"{'#' * level} `{qualified}`", "", "```python", f"{kind} {obj.__name__}{_signature(obj)}", "```", ""]
    lines += [_markdown(inspect.getdoc(obj) or "(no docstring)"), ""]
    if inspect.isclass(obj):
        for name, member in _members(obj):
            lines += _member(obj, name, member)
    return lines


def _data(module: Any, name: str, value: Any) -> list[str]:
    """A module-level constant: its value and the ``#:`` comment above its assignment."""
    source = inspect.getsource(module).splitlines()
    at = next(i for i, line in enumerate(source) if re.match(rf"{name}\s*[:=]", line))
    comment = []
    while at > 0 and source[at - 1].startswith("#:"):
        at -= 1
        comment.insert(0, source[at].removeprefix("#:").strip())
    shown = pprint.pformat(value, width=100, sort_dicts=False)
    return [f"### `{module.__name__}.{name}`", "", "```python", f"{name} = {shown}", "```", ""] + (
        [_markdown(" ".join(comment)), ""] if comment else []
    )


def _members(cls: type) -> Iterable[tuple[str, Any]]:
    """The public methods and properties a class defines itself (not inherited), in source order."""
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            yield name, member
        elif isinstance(member, property) or inspect.isfunction(member):
            yield name, member


def _member(cls: type, name: str, member: Any) -> list[str]:
    heading = f"#### `{cls.__name__}.{name}`"
    if isinstance(member, property):
        doc = inspect.getdoc(member) or "(no docstring)"
        return [heading, "", "Property.", "", _markdown(doc), ""]
    function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
    prefix = {classmethod: "@classmethod\n", staticmethod: "@staticmethod\n"}.get(type(member), "")
    if getattr(function, "__isabstractmethod__", False):
        prefix = "@abstractmethod\n" + prefix
    signature = f"{prefix}def {name}{_signature(function)}"
    doc = inspect.getdoc(function) or "(no docstring)"
    return [heading, "", "```python", signature, "```", "", _markdown(doc), ""]


def _signature(obj: Any) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    # postponed annotations are strings: shown as written, not as quoted reprs
    parameters = [p.replace(annotation=_written(p.annotation)) for p in signature.parameters.values()]
    signature = signature.replace(parameters=parameters, return_annotation=_written(signature.return_annotation))
    text = str(signature)
    # an object's default repr may hold its address, which would change from run to run
    return re.sub(r" at 0x[0-9a-f]+", "", text)


class _Written:
    """An annotation shown as its source text (``inspect`` shows a string annotation as its repr, in quotes)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _written(annotation: Any) -> Any:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _markdown(doc: str) -> str:
    """reST roles and double backticks as Markdown code spans."""
    return _ROLE.sub(r"`\1`", doc).replace("``", "`")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces
    as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ------------------------------------------------------------------------------ README's method table
def methods_table(methods: Mapping[str, Any] | None = None) -> str:
    """README.md's method table: each method's id, paper and mechanism, from its registered class's ``paper`` and
    ``summary``, and where its measured figures are; ``methods`` (name -> class) defaults to the methods dpsynth
    ships (:func:`dpsynth.methods.shipped_methods`)."""
    from dpsynth.methods import shipped_methods

    shipped = sorted((shipped_methods() if methods is None else methods).values(), key=lambda cls: cls.name)
    lines = [
        "Generated from the method registry (each method's `paper` and `summary`) by `dpsynth docs methods`;",
        "do not edit between the markers.",
        "",
        "| `method:` | paper | mechanism | results |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{cls.name}` | {_cell(cls.paper)} | {_cell(cls.summary)} | {RESULTS_LINK} |" for cls in shipped]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# ------------------------------------------------------------------------------ BENCHMARKS.md's suite tables
def suite_table(suite_name: str, results: Path, benchmarks_md: Path) -> str:
    """A suite's block in BENCHMARKS.md, rebuilt from its recorded results JSON alone: what ``dpsynth bench``
    wrote there from the same cells."""
    from dpsynth.bench.cells import FINISHED
    from dpsynth.bench.suite import load_suite
    from dpsynth.bench.table import markdown_section

    try:
        cells = json.loads(results.read_text())["cells"]
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{results}: no readable results JSON ({exc})") from exc
    plot = benchmarks_md.parent / "docs" / "img" / f"bench_{suite_name}.png"  # where `dpsynth bench` draws it
    finished = any(c["status"] == FINISHED and c["accuracy_mean"] is not None for c in cells)
    link = Path(_relative(plot, benchmarks_md)) if finished else None
    return markdown_section(load_suite(suite_name), cells, link)


def _relative(target: Path, page: Path) -> str:
    import os

    return Path(os.path.relpath(target.resolve(), page.resolve().parent)).as_posix()


# ------------------------------------------------------------------------------ writing them
def replace_block(text: str, markers: tuple[str, str], block: str, where: str) -> str:
    """``text`` with what lies between the two markers replaced by ``block``; the markers must appear once each,
    in order."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise DataError(f"{where}: expected one {start} and, after it, one {end}; fix the file by hand")
    before, rest = text.split(start, 1)
    return f"{before}{start}\n{block}\n{end}{rest.split(end, 1)[1]}"


def generated_files(root: Path) -> dict[Path, Callable[[str], str]]:
    """Every generated file under the checkout ``root``: a function from its current text to its current
    generated text."""
    from dpsynth.bench.suite import available_suites
    from dpsynth.bench.table import markers
    from dpsynth.config import reference_markdown

    benchmarks = root / "BENCHMARKS.md"

    def with_suites(text: str) -> str:
        for name in available_suites():
            results = root / "experiments" / "results" / f"{name}.json"
            if results.is_file() and markers(name)[0] in text:
                text = replace_block(text, markers(name), suite_table(name, results, benchmarks), str(benchmarks))
        return text

    return {
        root / "docs" / "api.md": lambda _: api_markdown(),
        root / "docs" / "config-reference.md": lambda _: reference_markdown() + "\n",  # as `print` writes it
        root / "README.md": lambda text: replace_block(text, METHODS_MARKERS, methods_table(), "README.md"),
        benchmarks: with_suites,
    }


def stale_files(root: Path) -> list[Path]:
    """The generated files under ``root`` whose committed text differs from what the code generates now."""
    return [
        path
        for path, generate in generated_files(root).items()
        if not path.is_file() or path.read_text() != generate(path.read_text())
    ]


def update(root: Path) -> list[Path]:
    """Rewrite every stale generated file under ``root``; the paths rewritten."""
    from dpsynth.checkpoint import atomic_write_text

    stale = stale_files(root)
    generators = generated_files(root)
    for path in stale:
        atomic_write_text(path, generators[path](path.read_text() if path.is_file() else ""))
    return stale
