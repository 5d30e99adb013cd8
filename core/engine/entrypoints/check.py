"""``engine check numerics MODEL [config flags]``: the numerics oracle (``engine.numerics``) from the command line:
the JSON report on stdout (or ``--output``), a PNG of the error per layer (``--plot``); exit status 0 when the
config passes, 1 when it does not (the report names the guilty plugin)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.entrypoints.config_flags import add_config_flags, config_overrides_from_args


def cmd_check_numerics(args: argparse.Namespace) -> int:
    from engine.numerics.oracle import check_numerics

    overrides = config_overrides_from_args(args)
    flat = {f"{section}.{key}": value for section, values in overrides.items() for key, value in values.items()}
    flat.pop("model.model", None)
    report = check_numerics(
        args.model,
        _short_keys(flat),
        num_prompts=args.prompts,
        sampler_draws=args.sampler_draws,
        progress=lambda message: print(f"engine check numerics: {message}", file=sys.stderr, flush=True),
    )
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.plot:
        from engine.numerics.plot import plot_errors

        plot_errors(report, args.plot)
    guilty = ", ".join(f"{g['kind']}={g['plugin']}" for g in report["guilty"]) or "none"
    first = report["first_failure"]["name"] if report["first_failure"] else "none"
    print(
        f"engine check numerics: {report['verdict']} ({report['dtype']}; first op out of tolerance: {first}; "
        f"guilty: {guilty})",
        file=sys.stderr,
    )
    return 0 if report["verdict"] == "pass" else 1


def _short_keys(dotted: dict) -> dict:
    """Dotted keys as the flat names the oracle swaps (``attention``, ``layer_kernels``...), others as given."""
    from engine.hookspecs import KINDS
    from engine.numerics.oracle import REFERENCE_PLUGINS

    short = {KINDS[kind].config_key: kind for kind in REFERENCE_PLUGINS}
    return {short.get(key, key): value for key, value in dotted.items()}


def add_check_command(sub) -> None:
    check = sub.add_parser("check", help="checks of a configuration: `engine check numerics MODEL`")
    kinds = check.add_subparsers(dest="check", required=True)
    numerics = kinds.add_parser(
        "numerics",
        help="teacher-forced prompts with probes at every layer against a float64 reference of the same weights; "
        "names the plugin whose swap removes the error (JSON; exit status 1 when it fails)",
    )
    numerics.add_argument("model", help="model folder or .gguf")
    numerics.add_argument("--prompts", type=int, default=4, help="random-token prompts (24-96 tokens each)")
    numerics.add_argument("--sampler-draws", type=int, default=400_000, help="draws per sampler case")
    numerics.add_argument("--output", help="write the JSON report here instead of stdout")
    numerics.add_argument("--plot", help="PNG: relative error per probe, each bisect swap, the tolerance")
    add_config_flags(numerics)
    numerics.set_defaults(func=cmd_check_numerics)
