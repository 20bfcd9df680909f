"""Run configuration: typed schemas, YAML files, dotted ``--set`` overrides, defaults and validation.

Every section is a pydantic model (``extra="forbid"``): each shared layer declares the section it reads,
:class:`dpsynth.sections.RunConfig` composes them, and each method declares its own section next to its
code (``Method.config_schema``). A config is
resolved — defaults filled in, every type, range and choice checked — when it is loaded, before any
data is read or a run directory exists. A bad value raises one :class:`~dpsynth.errors.ConfigError`
line naming the key, the value and what is allowed.

The resolved configuration is a typed :class:`~dpsynth.sections.RunConfig` that travels unchanged to the
method; its ``to_dict()`` is what a run directory stores as ``config.yaml``, so a run can be reproduced
from its directory alone.
"""

from __future__ import annotations

import copy
import functools
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import yaml
from pydantic import Field

from dpsynth.data.declaration import with_declaration
from dpsynth.dpsgd.scaling import AutoSection, check_scaled, get_key, has_key, scale, set_key
from dpsynth.dpsgd.section import check_precision_device
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.sections import RunConfig

if TYPE_CHECKING:
    from dpsynth.data.source import DatasetSource

#: Configs shipped inside the package: ``presets/<method>/<name>.yaml``, run as ``<method>/<name>``.
PRESETS_DIR = Path(__file__).parent / "presets"
#: ``dpsynth run auto``: the method for own data when none is named (why: its preset's ``auto.why``)
DEFAULT_AUTO_METHOD = "dp-imgsyn"
AUTO_PRESET = "auto"


# --------------------------------------------------------------------------- resolving
@functools.cache
def run_schema(method_name: str) -> type[RunConfig]:
    """The full config schema of a run of ``method_name``: the common sections plus the method's own."""
    from dpsynth.methods import get_method

    method = get_method(method_name)
    section = method.config_schema
    return pydantic.create_model(
        f"RunConfig[{method_name}]",
        __base__=RunConfig,
        method_section=(
            section,
            Field(default_factory=section, alias=method_name, description=f"settings of {method_name}"),
        ),
    )


def resolve_config(raw: dict[str, Any] | RunConfig, check_rules: bool = True) -> RunConfig:
    """Fill in every default and check every key, type, range and choice (and the method's rules across
    sections, ``Method.check_config``); return the typed config that travels to the method.

    ``check_rules=False`` skips the rules across sections: for an ``auto`` preset before its scaling rule
    has set the keys they read (:func:`load_config` checks them after it)."""
    from dpsynth.methods import get_method

    if isinstance(raw, RunConfig):
        raw = raw.to_dict()
    if isinstance(raw.get("data"), dict):  # dataset.yaml beside own data fills the data keys left unset
        raw = {**raw, "data": with_declaration(raw["data"])}
    method_name = raw.get("method")
    if not method_name:
        raise ConfigError("the config must name a method (key 'method')")
    schema = run_schema(str(method_name))
    try:
        config = schema.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise one_line_error(exc, schema) from None
    check_precision_device(config.section, str(method_name), config.device)
    if not check_rules:
        return config
    if config.auto is not None:
        check_scaled(config.to_dict(), config.auto)
    get_method(str(method_name)).check_config(config)
    check_baseline_request(config)
    return config


def baseline_refusal(config: RunConfig) -> str | None:
    """Why the run ``config`` describes can have no DP-SGD classifier baseline, or None when it can."""
    from dpsynth.methods import get_method

    method = get_method(str(config.method))
    if method.releases != "samples":
        return f"{config.method} releases a classifier itself, the kind of model the baseline is"
    if method.ledger_guarantee(config.section) != "dp":
        return f"this {config.method} run claims no differential privacy; its DP-SGD baseline has no epsilon to match"
    return None


#: the method of the DP-SGD classifier baseline (dpsynth.eval.baseline trains it)
BASELINE_METHOD = "dpsgd-classifier"


def check_baseline_request(config: RunConfig) -> None:
    """``evaluate.dpsgd_baseline: true`` is refused at load where no baseline can be trained or compared,
    and its ``dpsgd_baseline_settings`` are checked against the baseline method's schema."""
    from dpsynth.methods import get_method

    settings = config.evaluate.dpsgd_baseline_settings
    if not config.evaluate.dpsgd_baseline:
        if settings:
            raise ConfigError(
                "evaluate.dpsgd_baseline_settings are set but evaluate.dpsgd_baseline is false; set it true"
            )
        return
    schema = get_method(BASELINE_METHOD).config_schema
    try:
        schema.model_validate(settings)
    except pydantic.ValidationError as exc:
        raise one_line_error(exc, schema, ("evaluate", "dpsgd_baseline_settings")) from None
    refusal = baseline_refusal(config)
    if refusal is not None:
        raise ConfigError(f"evaluate.dpsgd_baseline: {refusal}; set it false")
    if "accuracy" not in config.evaluate.metrics:
        raise ConfigError(
            "evaluate.dpsgd_baseline: its accuracy stands beside the release's, and evaluate.metrics does not "
            "list accuracy; add it (--set evaluate.metrics=[accuracy]) or set evaluate.dpsgd_baseline false"
        )


def with_changes(config: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """``config`` with the nested ``changes`` merged in, resolved again (every changed key is checked)."""
    return resolve_config(deep_merge(config.to_dict(), changes))


def load_config(
    path: str | Path, overrides: list[str] | dict[str, Any] | None = None, num_examples: int | None = None
) -> RunConfig:
    """Read a YAML config (a path or a packaged preset name), apply overrides (``--set`` strings or a
    ``{dotted key: value}`` dict) and resolve it; the run's name defaults to the file's stem.

    A config with an ``auto`` section (the ``auto`` presets) is sized by the scaling rule
    (:func:`apply_scaling`) for ``num_examples`` (default: N from the data's metadata), between the
    preset and the overrides: a key you set yourself keeps your value."""
    path = find_config(path)
    user = overrides_to_tree(overrides)
    raw = deep_merge(read_yaml(path), user)
    config = resolve_config(raw, check_rules=raw.get("auto") is None)
    if config.auto is not None:
        user_keys = [key for key in _rule_keys(config, num_examples) if has_key(user, key)]
        config = apply_scaling(config, num_examples, user_keys=user_keys)
    return config if config.name is not None else config.replace(name=Path(path).stem)


def _rule_keys(config: RunConfig, num_examples: int | None) -> list[str]:
    n, shape = _planning_inputs(config, num_examples, None)
    return [setting.key for setting in scale(n, shape, config.auto, has_public=False, delta=config.privacy.delta)]


def _planning_inputs(
    config: RunConfig, num_examples: int | None, image_shape: tuple[int, int, int] | None
) -> tuple[int, tuple[int, int, int]]:
    """(N, (C, H, W)) the scaling rule plans for: given, or from the data section's metadata (no pixel read)."""
    from dpsynth.data.sizes import planned_image_shape, planned_train_size

    n = int(num_examples) if num_examples is not None else planned_train_size(config.data)
    if n < 1:
        raise ConfigError(f"the private train size must be positive, got {n}")
    return n, tuple(image_shape) if image_shape is not None else planned_image_shape(config.data)


def apply_scaling(
    config: RunConfig,
    num_examples: int | None = None,
    image_shape: tuple[int, int, int] | None = None,
    user_keys: list[str] | None = None,
) -> RunConfig:
    """``config`` with the keys its ``auto`` section's rule sets for N and the image shape (docs/own-data.md).

    ``num_examples`` and ``image_shape`` default to what the data section's metadata says (no pixel is
    read). Keys in ``user_keys`` (default: those recorded at load) keep their values; every other key the
    rule sets is recorded, with its value and why, in ``auto.applied``. Applying it again, for another N
    (the Python API's arrays), re-sizes the same keys.
    """
    auto: AutoSection = config.auto
    kept = list(auto.user_keys if user_keys is None else user_keys)
    raw = config.to_dict()
    for item in auto.applied:  # data keys an earlier sizing set are inputs of this one: start from unset
        if item["key"].startswith("data."):
            set_key(raw, item["key"], None)
    config = resolve_config(raw, check_rules=False)
    n, shape = _planning_inputs(config, num_examples, image_shape)
    applied = []
    for setting in scale(n, shape, auto, has_public=bool(config.data.public), delta=config.privacy.delta):
        if setting.key in kept:
            continue
        set_key(raw, setting.key, setting.value)
        applied.append({"key": setting.key, "value": setting.value, "why": setting.why})
    raw["auto"].update(num_examples=n, image_shape=list(shape), user_keys=kept, applied=applied)
    return resolve_config(raw)


def config_for_source(config: RunConfig, source: DatasetSource | None) -> RunConfig:
    """``config`` as a run on ``source`` (:class:`~dpsynth.data.source.DatasetSource`) states it: the one
    place where the data a run is handed changes its config, for ``dpsynth run`` and ``Synthesizer.fit`` alike.

    ``data.private`` names the source's dataset (``<arrays>`` for in-memory arrays) with its declared
    ``data.num_classes``; an ``auto`` preset is then sized again for that data (:func:`apply_scaling`: N and
    the shape of arrays, else the metadata of the named dataset); ``data.public`` names the public side last,
    so a public set the caller gives wins over the one the rule would pick. None changes nothing.
    """
    if source is None:
        return config
    if source.data_changes():
        config = with_changes(config, {"data": source.data_changes()})
    if config.auto is not None and source.names_private:
        num_examples, shape = source.planning_inputs(config.data)
        config = apply_scaling(config, num_examples, shape)
    if source.public_changes():
        config = with_changes(config, {"data": source.public_changes()})
    return config


def describe_scaling(config: RunConfig) -> list[str]:
    """The lines the log and ``--dry-run`` print for a config sized by the scaling rule (none otherwise)."""
    auto = config.auto
    if auto is None or auto.num_examples is None:
        return []
    shape = "x".join(str(v) for v in auto.image_shape or [])
    lines = [
        f"auto: {config.method} sized for N={auto.num_examples} train images of {shape} (C x H x W), "
        f"time budget {auto.time_budget_s:g} s on 2 CPU cores (docs/own-data.md)"
    ]
    if auto.why:
        lines.append(f"auto: method {config.method} (the default for own data): {auto.why}")
    lines += [f"auto: set {item['key']} = {item['value']}: {item['why']}" for item in auto.applied]
    lines += [f"auto: kept your {key} = {get_key(config.to_dict(), key)}" for key in auto.user_keys]
    return lines


def find_config(spec: str | Path) -> Path:
    """A config path: ``spec`` itself if it is a file, else the packaged preset ``<method>/<name>`` (dpsynth's,
    or an installed plugin method's own ``presets_dir``)."""
    if str(spec) == AUTO_PRESET and not Path(spec).is_file():
        spec = f"{DEFAULT_AUTO_METHOD}/{AUTO_PRESET}"
    method, _, name = str(spec).partition("/")
    plugin_dir = _plugin_presets_dir(method) if name and not Path(spec).is_file() else None
    if plugin_dir is not None:
        return find_packaged(name, plugin_dir, "config file", f"{method} preset", "see `dpsynth config list`")
    return find_packaged(spec, PRESETS_DIR, "config file", "packaged preset", "see `dpsynth config list`")


def _plugin_presets_dir(method: str) -> Path | None:
    """The presets directory of an installed plugin method ``method`` (None for dpsynth's own or unknown)."""
    from dpsynth.methods import all_methods

    cls = all_methods().get(method)
    return None if cls is None or cls.presets_dir is None else Path(cls.presets_dir)


def find_packaged(spec: str | Path, directory: Path, file_kind: str, packaged_kind: str, hint: str) -> Path:
    """``spec`` itself if it is a file, else ``directory/<spec>.yaml`` (a name inside the package)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = str(spec).removesuffix(".yaml")
    packaged = directory / f"{name}.yaml"
    if name and ".." not in Path(name).parts and packaged.is_file():
        return packaged
    raise ConfigError(f"no {file_kind} {str(spec)!r} and no {packaged_kind} {name!r} ({hint})")


def list_presets() -> list[str]:
    """Every packaged preset as ``<method>/<name>`` (``demo`` at the top level), installed plugins' included."""
    from dpsynth.methods import all_methods

    names = [str(p.relative_to(PRESETS_DIR).with_suffix("")) for p in PRESETS_DIR.rglob("*.yaml")]
    for method in all_methods():
        directory = _plugin_presets_dir(method)
        if directory is not None:
            names += [f"{method}/{p.stem}" for p in Path(directory).glob("*.yaml")]
    return sorted(names)


def overrides_to_tree(overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``["a.b=1"]`` or ``{"a.b": 1}`` as the nested dict ``{"a": {"b": 1}}``."""
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return _nest(overrides.items(), "override")
    return parse_overrides(list(overrides))


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    items = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        try:
            items.append((key, yaml.safe_load(raw) if raw != "" else None))
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc.__class__.__name__})") from None
    return _nest(items, "--set")


def _nest(items: Any, what: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in items:
        node = result
        *parents, leaf = str(key).split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{what} {key}: {part!r} is set twice as a value and a section")
        node[leaf] = value
    return result


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a config must be a mapping of keys, got {type(loaded).__name__}")
    return loaded


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# ------------------------------------------------------------------------ error lines
def one_line_error(
    exc: pydantic.ValidationError, schema: type[pydantic.BaseModel], prefix: tuple[str, ...] = ()
) -> ConfigError:
    """The first validation error as one line: the dotted key, the value given and what is allowed.

    Used for every YAML file dpsynth reads against a schema (run configs, benchmark suites)."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    loc = prefix + tuple(str(part) for part in error["loc"])
    dotted = ".".join(loc)
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if error["type"] == "extra_forbidden":
        known = ", ".join(_known_keys(schema, loc[len(prefix) : -1]))
        message = f"unknown config key {dotted!r} (known here: {known}){more}"
    else:
        allowed = _allowed(error)
        where = f"config key {dotted!r}" if loc else "config"
        shown = ":" if isinstance(error["input"], dict) else f" = {error['input']!r}:"
        # a rule across a section's keys names its own (deeper) key: the message is the line
        message = f"{allowed}{more}" if allowed.startswith("config key ") else f"{where}{shown} {allowed}{more}"
    is_privacy_target = len(loc) == 2 and loc[0] == "privacy" and loc[1] in ("epsilon", "delta")
    return (PrivacyError if is_privacy_target else ConfigError)(" ".join(message.split()))


def _allowed(error: dict[str, Any]) -> str:
    """Pydantic's message, phrased as what the key accepts."""
    message = str(error["msg"])
    message = re.sub(r"^(Value|Assertion) error, ", "", message)
    if message.startswith("Input should be"):
        message = "expected" + message[len("Input should be") :]
    if message == "Field required":
        message = "this key is required"
    return message[0].lower() + message[1:] if message else message


def _known_keys(schema: type[pydantic.BaseModel], loc: tuple[str, ...]) -> list[str]:
    """The keys allowed at ``loc`` inside ``schema`` (aliases where a field has one); list indices and
    dict keys in ``loc`` step into the element model of a ``list[...]`` or ``dict[..., ...]`` field."""
    node: Any = schema
    for part in loc:
        if _is_model(node):
            fields = {field.alias or name: field for name, field in node.model_fields.items()}
            if part not in fields:
                return []
            node = fields[part].annotation
        else:  # a container: ``part`` is an index or a key
            node = _element_type(node)
    return sorted(field.alias or name for name, field in node.model_fields.items()) if _is_model(node) else []


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _element_type(annotation: Any) -> Any:
    """The element (list) or value (dict) type of a container annotation, Optional unwrapped; else None."""
    arguments = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(arguments) == 1:
        return _element_type(arguments[0])
    return arguments[-1] if arguments else None


# ---------------------------------------------------------------------- documentation
def describe_keys(schema: type[pydantic.BaseModel], prefix: str = "") -> list[dict[str, Any]]:
    """Every leaf key of ``schema`` as ``{"key", "type", "default", "description"}`` (dotted keys)."""
    rows: list[dict[str, Any]] = []
    for name, field in schema.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            rows.extend(describe_keys(annotation, prefix=f"{key}."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(
            {
                "key": key,
                "type": type_name(annotation) + _bounds(field),
                "default": default,
                "description": field.description or "",
            }
        )
    return rows


def method_keys(method_name: str) -> list[dict[str, Any]]:
    """The keys of a method's section, dotted under the method name (as ``--set`` takes them)."""
    from dpsynth.methods import get_method

    return describe_keys(get_method(method_name).config_schema, prefix=f"{method_name}.")


def common_keys() -> list[dict[str, Any]]:
    """The keys every config has (method, name, seed, device, data, privacy, generate, evaluate, backbone)."""
    return describe_keys(RunConfig)


def type_name(annotation: Any) -> str:
    """A short readable type: ``int``, ``float | null``, ``'public' | 'noise'``, ``list[float]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args if a is not Ellipsis)}]"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: Any) -> str:
    """`` >= 1``, `` in (0, 1]`` and the like, from the field's constraints."""
    bounds = {}
    for item in field.metadata:
        for attr in ("gt", "ge", "lt", "le"):
            if getattr(item, attr, None) is not None:
                bounds[attr] = getattr(item, attr)
    low = f"({bounds['gt']}" if "gt" in bounds else f"[{bounds['ge']}" if "ge" in bounds else None
    high = f"{bounds['lt']})" if "lt" in bounds else f"{bounds['le']}]" if "le" in bounds else None
    if low and high:
        return f", in {low}, {high}"
    if low:
        return f", {'>' if low[0] == '(' else '>='} {low[1:]}"
    if high:
        return f", {'<' if high[-1] == ')' else '<='} {high[:-1]}"
    return ""


def reference_markdown(methods: Mapping[str, Any] | None = None) -> str:
    """docs/config-reference.md: every key of every section, generated from the schemas; one section per method
    of ``methods`` (name -> class; None: the methods dpsynth ships, :func:`dpsynth.methods.shipped_methods`)."""
    from dpsynth.methods import shipped_methods

    lines = [
        "# Config reference",
        "",
        "Generated from the config schemas by `dpsynth config reference`; do not edit by hand.",
        "Every key below is checked when a config loads, before any data is read. Set any of them in a",
        "YAML config or with `--set KEY=VALUE` (Python: `overrides={KEY: VALUE}`).",
        "",
    ]
    sections = [("Common keys", common_keys())]
    sections += [(f"`{name}`", method_keys(name)) for name in sorted(shipped_methods() if methods is None else methods)]
    for title, rows in sections:
        lines += [f"## {title}", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{r['key']}` | {_cell(r['type'])} | `{_yaml_value(r['default'])}` | {_cell(r['description'])} |"
            for r in rows
        ]
        lines.append("")
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
