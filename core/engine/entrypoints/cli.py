"""The ``engine`` command: ``generate`` and ``plugins`` (every config key is also a flag)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from typing import Any, Optional

from engine.config import FLAT_ALIASES, SECTIONS, ConfigError, VllmConfig


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


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` plus one flag per config key (``--block-size``...) and the short aliases."""
    parser.add_argument("--config", dest="config_file", help="YAML file with the engine config (nested sections)")
    seen = set()
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} config")
        for name, field in section_cls.model_fields.items():
            flags = [f"--{name.replace('_', '-')}"] if name not in seen else []
            flags += [f"--{alias.replace('_', '-')}" for alias, target in FLAT_ALIASES.items()
                      if target == f"{section}.{name}"]
            seen.add(name)
            if not flags:
                continue
            kind = _flag_type(field.annotation)
            choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
            common = dict(dest=f"cfg__{section}__{name}", default=None,
                          help=f"{field.description} (default: {field.get_default(call_default_factory=True)})")
            if kind is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
            else:
                group.add_argument(*flags, type=kind, choices=choices, **common)


def _flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config flags given on the command line, as nested sections."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__", 2)
            overrides.setdefault(section, {})[name] = value
    return overrides


def config_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML file's sections with the flags merged over them (for building several configs)."""
    from engine.config import _YamlSource, _yaml_file

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


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.runtime.llm import LLM
    from engine.sampling_params import SamplingParams

    config = config_from_args(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM.from_config(config)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": output.prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{output.prompt if not args.chat else ''}{completion.text}\n[finish_reason={completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens]")
    llm.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.entrypoints.openai.api_server import run_server

    if args.model_tag:
        args.cfg__model__model = args.model_tag
    config = config_from_args(args)
    logging.getLogger("engine").setLevel(logging.INFO)
    return run_server(config)


def cmd_plugins(args: argparse.Namespace) -> int:
    from engine.interfaces.base import SelectionContext
    from engine.plugins import get_plugin_manager

    config = config_from_args(args)
    rows = get_plugin_manager().table(SelectionContext(config))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    headers = ["kind", "name", "source", "available", "reason"]
    widths = {h: max(len(h), *(len(r[h]) for r in rows)) for h in headers[:-1]}
    print("  ".join(h.upper().ljust(widths.get(h, 0)) for h in headers))
    for row in rows:
        print("  ".join(row[h].ljust(widths.get(h, 0)) for h in headers))
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from engine.config_docs import render_config_markdown

    text = render_config_markdown()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="LLM inference engine with pluggable parts")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", dest="seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per output")
    gen.add_argument("-v", "--verbose", action="store_true", help="log start-up (config, plugins, KV blocks)")
    add_config_flags(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (completions, chat, metrics...)")
    serve.add_argument("model_tag", nargs="?", help="model folder or .gguf (same as --model)")
    add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    plug = sub.add_parser("plugins", help="list every plugin implementation, its source and availability")
    plug.add_argument("--json", action="store_true")
    plug.add_argument("-v", "--verbose", action="store_true")
    add_config_flags(plug)
    plug.set_defaults(func=cmd_plugins)

    from engine.bench.cli import add_bench_parser

    add_bench_parser(sub, add_config_flags)

    docs = sub.add_parser("config-docs", help="print the configuration reference (Markdown)")
    docs.add_argument("--output", help="write to this file instead of stdout")
    docs.set_defaults(func=cmd_config_docs)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"engine: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
