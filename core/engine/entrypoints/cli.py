"""The ``engine`` command: ``generate`` and ``plugins`` (every config key is also a flag)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

from engine.config import ConfigError
from engine.entrypoints.config_flags import add_config_flags, config_from_args


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    config = config_from_args(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM.from_config(config)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": output.prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        else:
            print(
                f"{output.prompt if not args.chat else ''}{completion.text}\n"
                f"[finish_reason={completion.finish_reason}, {len(completion.token_ids)} tokens]"
            )
    llm.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.entrypoints.openai.run import run_server

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
    for column, title in (
        ("mla", "MLA (multi-head latent attention: DeepSeek-V2/V3) per attention backend"),
        ("lora", "LoRA (the batched adapter product, LayerKernels.add_lora) per layer kernels"),
    ):
        listed = [row for row in rows if column in row]
        if listed:
            print(f"\n{title}:")
            width = max(len(row["name"]) for row in listed)
            for row in listed:
                print(f"  {row['name'].ljust(width)}  {row[column]}")
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


CLI_ENTRY_POINT_GROUP = "engine.cli"  # installed distributions add subcommands: engine-bench adds `bench`


def add_installed_commands(sub) -> None:
    """Subcommands of installed distributions: each ``engine.cli`` entry point is a function that adds its
    parser to ``sub`` (``engine bench`` comes from the engine-bench distribution)."""
    import importlib.metadata

    for entry in sorted(importlib.metadata.entry_points(group=CLI_ENTRY_POINT_GROUP), key=lambda e: e.name):
        entry.load()(sub)


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

    from engine.entrypoints.check import add_check_command
    from engine.entrypoints.replay import add_replay_command

    add_replay_command(sub)
    add_check_command(sub)
    add_installed_commands(sub)

    docs = sub.add_parser("config-docs", help="print the configuration reference (Markdown)")
    docs.add_argument("--output", help="write to this file instead of stdout")
    docs.set_defaults(func=cmd_config_docs)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """The ``engine`` command: its process ends when the command does (``freeze_everything_at_exit``; a command
    may build several engines in turn, so each one's shutdown still releases its heap)."""
    from engine.lifetime import freeze_everything_at_exit

    freeze_everything_at_exit()
    args = build_parser().parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"engine: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
