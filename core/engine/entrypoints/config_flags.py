"""Config keys as command-line flags, shared by every ``engine`` subcommand (bench included)."""

from __future__ import annotations

import argparse
import functools
import json
import typing
from typing import Any

from engine.config import FLAT_ALIASES, SECTION_ALIASES, SECTIONS, VllmConfig, _json_section

SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
}  # vLLM's short spellings


def _flag_type(annotation) -> Any:
    """The argparse type of a config field: int, float, bool, JSON dict, or str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return type(args[0])
    if origin is typing.Union and args:
        return _flag_type(args[0])
    if annotation is dict or origin is dict:
        return json.loads
    if annotation in (int, float, bool):
        return annotation
    return str


def _value_list(kind):
    """A flag type that also takes a comma-separated list (kept as text: one A/B variant per value)."""

    def convert(text: str):
        return text if "," in text else kind(text)

    convert.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its errors
    return convert


def add_config_flags(parser: argparse.ArgumentParser, value_lists: bool = False) -> None:
    """``--config FILE`` plus one flag per config key (``--block-size``...) and the short aliases.

    With ``value_lists`` (``engine bench``) a scalar key also takes ``V1,V2``: the bench runs each value."""
    parser.add_argument("--config", dest="config_file", help="YAML file with the engine config (nested sections)")
    seen = set()
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} config")
        for name, field in section_cls.model_fields.items():
            aliases = [alias for alias, target in FLAT_ALIASES.items() if target == f"{section}.{name}"]
            # a key with aliases is spelt as users know it (--attention, --sampler), not by its field name
            # (--backend, --name); each flag once
            names = aliases if aliases else ([name] if name not in seen else [])
            flags = list(dict.fromkeys(f"--{n.replace('_', '-')}" for n in names))
            if flags and name in SHORT_FLAGS:
                flags.append(SHORT_FLAGS[name])
            seen.add(name)
            if not flags:
                continue
            kind = _flag_type(field.annotation)
            choices = (
                typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
            )
            common: dict[str, Any] = dict(
                dest=f"cfg__{section}__{name}",
                default=None,
                metavar=None if kind is bool else names[0].upper(),
                help=f"{field.description} (default: {field.get_default(call_default_factory=True)})",
            )
            if typing.get_origin(field.annotation) is list:  # NAME=PATH pairs, folders: space-separated
                group.add_argument(*flags, nargs="+", **common)
            elif kind is bool:
                common.pop("metavar")
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
            elif value_lists and kind in (int, float, str):
                if choices:  # checked per value when each variant's config is built
                    common["help"] += f"; one of {', '.join(map(str, choices))}"
                group.add_argument(*flags, type=_value_list(kind), **common)
            else:
                group.add_argument(*flags, type=kind, choices=choices, **common)
    for alias, section in SECTION_ALIASES.items():
        parser.add_argument(
            f"--{alias.replace('_', '-')}",
            dest=f"cfgsection__{section}",
            default=None,
            type=functools.partial(_json_section, section),
            metavar="JSON",
            help=f"the whole '{section}' section as a JSON object (vLLM's flag); single-key flags override its keys",
        )


def _flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config flags given on the command line, as nested sections."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("cfgsection__") and value is not None:
            overrides.setdefault(key.split("__", 1)[1], {}).update(value)
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__", 2)
            overrides.setdefault(section, {})[name] = value
    return overrides


def config_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML file's sections with the flags merged over them (for building several configs)."""
    from engine.config import _yaml_file, _YamlSource

    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "config_file", None):
        token = _yaml_file.set(args.config_file)
        try:
            overrides = _YamlSource(VllmConfig)()
        finally:
            _yaml_file.reset(token)
    for section, values in _flag_overrides(args).items():
        overrides.setdefault(section, {}).update(values)
    return overrides


def config_from_args(args: argparse.Namespace) -> VllmConfig:
    return VllmConfig.load(args.config_file, **_flag_overrides(args))
