"""``dataset.yaml``: what a custodian declares once about their own images, beside the data.

Classes, pixel range, channels and size are never read off private values (docs/privacy.md, "What
is treated as public"), so own data has to state them. Rather than repeat ``--set data.num_classes=2
--set data.pixel_range=[0,1] ...`` on every command, a small YAML file beside the data states them::

    # faces/dataset.yaml (a folder: inside it; an .npz: in the same folder as the file)
    classes: [face, non-face]      # or num_classes: 2
    pixel_range: [0, 255]          # float .npz pixels: their declared range, e.g. [0, 1]
    channels: 1                    # optional: 1 or 3
    image_size: 25                 # optional: the side of the (square) images

The config layer fills the ``data`` keys it declares (``data.num_classes``, ``data.class_names``,
``data.pixel_range``, ``data.channels``, ``data.image_size``) where the config leaves them unset, so a
preset, ``--set data.*`` or a Python override always wins. A bad file fails at load with one line
naming the file, the key and the fix, before any record is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field

from dpsynth.data.registry import REGISTRY, parse_spec
from dpsynth.errors import DataError
from dpsynth.schema import Section

#: the file name, looked up inside a data folder or beside a data file
DATASET_FILE = "dataset.yaml"
#: where a folder reader's pixels come from: decoded image files are 0..255 by format
UINT8_RANGE = [0.0, 255.0]


class DatasetDeclaration(Section):
    """The keys of ``dataset.yaml``; each maps to the ``data`` key of the same meaning."""

    classes: list[str] | None = Field(None, min_length=1, description="class names, in label order")
    num_classes: int | None = Field(None, ge=1, description="the class count (when classes are not named)")
    pixel_range: list[float] | None = Field(None, description="[low, high] of the stored pixels")
    channels: Literal[1, 3] | None = Field(None, description="1 (grey) or 3 (colour)")
    image_size: int | None = Field(None, ge=1, description="side of the square images")

    @pydantic.field_validator("classes", mode="before")
    @classmethod
    def _names_as_text(cls, names: Any) -> Any:
        """``classes: [0, 1, 2]`` names digits: YAML reads them as numbers, they are names all the same."""
        if isinstance(names, list):
            return [
                str(name) if isinstance(name, (int, float)) and not isinstance(name, bool) else name for name in names
            ]
        return names

    @pydantic.field_validator("classes")
    @classmethod
    def _distinct(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError("class names must be distinct")
        return names

    @pydantic.field_validator("pixel_range")
    @classmethod
    def _ordered(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (len(value) != 2 or not value[0] < value[1]):
            raise ValueError(f"expected [low, high] with low < high, got {list(value)}")
        return value

    @pydantic.model_validator(mode="after")
    def _classes_agree(self) -> DatasetDeclaration:
        if self.classes is not None and self.num_classes is not None and len(self.classes) != self.num_classes:
            raise ValueError(
                f"num_classes {self.num_classes} but {len(self.classes)} classes named; give one of the two"
            )
        return self

    def data_keys(self) -> dict[str, Any]:
        """The ``data`` section keys this declaration sets (only those it states)."""
        keys: dict[str, Any] = {}
        if self.classes is not None:
            keys["num_classes"], keys["class_names"] = len(self.classes), list(self.classes)
        elif self.num_classes is not None:
            keys["num_classes"] = self.num_classes
        for name in ("pixel_range", "channels", "image_size"):
            if getattr(self, name) is not None:
                keys[name] = getattr(self, name)
        return keys


def declaration_path(spec: str | Path | None) -> Path | None:
    """The ``dataset.yaml`` of a path spec (inside a folder, beside a file), or None (a name, or no file)."""
    if not spec:
        return None
    name = parse_spec(str(spec))[0]
    if name in REGISTRY:
        return None  # a registered dataset declares itself in the registry
    path = Path(name).expanduser()
    candidate = path / DATASET_FILE if path.is_dir() else path.parent / DATASET_FILE
    return candidate if path.exists() and candidate.is_file() else None


def read_declaration(spec: str | Path | None) -> dict[str, Any]:
    """The ``data`` keys the ``dataset.yaml`` of ``spec`` declares ({} when it has none).

    Raises DataError, one line naming the file and the key, for a file that is not a mapping, an
    unknown key, a bad value, a pixel range an image folder cannot have, or class names that differ
    from a folder tree's class folders.
    """
    path = declaration_path(spec)
    if path is None:
        return {}
    declaration = _validated(path)
    data_path = Path(parse_spec(str(spec))[0]).expanduser()
    _check_against_folder(declaration, data_path, path)
    return declaration.data_keys()


def _validated(path: Path) -> DatasetDeclaration:
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DataError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if not isinstance(loaded, dict):
        raise DataError(
            f"{path}: expected a mapping of keys (classes, num_classes, pixel_range, channels, image_size), "
            f"got {type(loaded).__name__}"
        )
    try:
        return DatasetDeclaration.model_validate(loaded)
    except pydantic.ValidationError as exc:
        raise _one_line(exc, path) from None


def _one_line(exc: pydantic.ValidationError, path: Path) -> DataError:
    error = exc.errors(include_url=False)[0]
    key = ".".join(str(part) for part in error["loc"]) or "(file)"
    if error["type"] == "extra_forbidden":
        known = ", ".join(DatasetDeclaration.model_fields)
        return DataError(f"{path}: unknown key {key!r} (known: {known})")
    message = str(error["msg"]).removeprefix("Value error, ")
    if message.startswith("Input should be"):
        message = "expected" + message[len("Input should be") :]
    shown = "" if isinstance(error["input"], dict) else f" = {error['input']!r}"
    return DataError(" ".join(f"{path}: key {key!r}{shown}: {message}".split()))


def _check_against_folder(declaration: DatasetDeclaration, data_path: Path, path: Path) -> None:
    """An image folder's pixels are 0..255 and a folder tree's classes are its folder names: a declaration
    must agree."""
    from dpsynth.data.readers import flat, folder

    tree = data_path.is_dir() and folder.is_folder_tree(data_path)
    if not (tree or (data_path.is_dir() and flat.is_flat_folder(data_path))):
        return
    if declaration.pixel_range is not None and [float(v) for v in declaration.pixel_range] != UINT8_RANGE:
        raise DataError(
            f"{path}: key 'pixel_range' = {declaration.pixel_range}: image files are 0..255 by format; "
            "drop the key or set [0, 255]"
        )
    if not tree:
        return
    folders = folder.class_names_of(data_path)
    if declaration.classes is not None and declaration.classes != folders:
        raise DataError(
            f"{path}: key 'classes' = {declaration.classes} differs from the class folders {folders} "
            "(sorted by name); list the folders in that order, or drop the key"
        )
    if declaration.num_classes is not None and declaration.num_classes != len(folders):
        raise DataError(
            f"{path}: key 'num_classes' = {declaration.num_classes} but the folder has {len(folders)} class "
            "folders; fix the count or drop the key"
        )


def with_declaration(data: dict[str, Any]) -> dict[str, Any]:
    """The raw ``data`` section with the keys of its private set's ``dataset.yaml`` filled in where unset."""
    declared = read_declaration(data.get("private"))
    filled = dict(data)
    for key, value in declared.items():
        if filled.get(key) is None:
            filled[key] = value
    return filled
