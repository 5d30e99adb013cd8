"""What a single stream's layer products can read, against the bandwidth probe, round by round.

A batch-1 decode step of a GGUF model reads each layer weight once, in 120 short streams (SmolLM2: 4 products a layer,
207 KB to 1.1 MB each), one spin-pool job a product. `engine bench` takes its bound from a long read (256 MiB in huge
pages), whose rate on some virtual machines swings between two phases within seconds. This script times, in C++ on
the engine's own threads and on the model's own packed weights:

- ``products``: the 120 products through ``engine_quant::linear`` (the kernel the captured step calls, one row of x);
- ``read_per_product``: the same bytes read (a 512-bit OR a line) by the same kind of job, ``parallel_stream``'s
  pieces, one job a weight: what the products could reach if their arithmetic cost nothing;
- ``read_one_job``: the same bytes, each thread its half of every weight, in a single job (no synchronisation
  between the weights): what the streams could reach without a job a product.

with the probe's reading before and after each round, and prints each round, then the medians by phase.

    python scripts/bench_weight_streams.py [--rounds 40] [--model PATH] [--json out.json]

Compiles a small extension against the plugin's sources on first use (about a minute). The CPU needs AVX-512 VNNI
(the products' ``avx512vnni`` variant reads the paired layout that such a CPU's engine builds).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

# engine before torch: it sets OMP_WAIT_POLICY=PASSIVE before OpenMP starts. Imported after torch, OpenMP's policy
# stays unset: libgomp's worker then spins after the bandwidth probe's sum (an OpenMP region) and takes a core from the
# spin pool's worker, which missed 15-70% of the products' jobs in such a run.
from engine import LLM
from engine.testing import inspect
from engine_bench.bandwidth import measure_bandwidth

# isort: split
import torch
from torch.utils.cpp_extension import load_inline

CSRC = pathlib.Path(__file__).resolve().parent.parent / "plugins/attention_cpu/engine_attention_cpu/csrc"

SOURCE = r"""
#define ENGINE_KERNELS_NO_MODULE 1
#include "quant_gemm.cpp"
#include <chrono>

namespace {
using Clock = std::chrono::steady_clock;

void read_range(const uint8_t* from, const uint8_t* to, std::atomic<uint64_t>& sink) {
  __m512i acc = _mm512_setzero_si512();
  for (const uint8_t* p = from; p < to; p += 64) acc = _mm512_or_si512(acc, _mm512_loadu_si512(p));
  sink.fetch_add(_mm512_reduce_or_epi64(acc), std::memory_order_relaxed);
}
}  // namespace

// milliseconds for one pass over every weight (the median of `reps` passes); mode 0 products, 1 a job a weight
// reading its bytes, 2 one job reading every weight's halves
double pass_ms(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& formats,
               const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& outs, int64_t mode,
               int64_t reps) {
  std::vector<double> seconds;
  std::atomic<uint64_t> sink{0};
  for (int64_t r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    if (mode == 2) {
      std::atomic<int> next{0};
      engine_pool::run_shared(2, [&] {
        for (int half = next.fetch_add(1); half < 2; half = next.fetch_add(1))
          for (const torch::Tensor& w : weights) {
            const uint8_t* base = w.data_ptr<uint8_t>();
            const int64_t bytes = w.numel();
            read_range(base + bytes * half / 2 / 64 * 64, base + bytes * (half + 1) / 2 / 64 * 64, sink);
          }
      });
    } else {
      for (size_t i = 0; i < weights.size(); ++i) {
        if (mode == 0) {
          engine_quant::linear(outs[i], xs[i], weights[i], c10::nullopt, formats[i], engine_quant::kAvx512Vnni,
                               c10::nullopt);
          continue;
        }
        const uint8_t* base = weights[i].data_ptr<uint8_t>();
        const int64_t unit = weights[i].size(1) * weights[i].size(2);
        engine_pool::parallel_stream(weights[i].size(0), 4, [&](int64_t begin, int64_t end, int64_t, bool) {
          read_range(base + begin * unit, base + end * unit, sink);
        });
      }
    }
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2] * 1e3;
}
"""

MODES = ("products", "read_per_product", "read_one_job")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the engine's default model)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=7, help="passes a mode a round (its median is kept)")
    parser.add_argument("--fast-above", type=float, default=48.0, help="GB/s: 'fast' rounds read above it twice")
    parser.add_argument("--slow-below", type=float, default=40.0, help="GB/s: 'slow' rounds read below it twice")
    parser.add_argument("--json", default=None, help="write the rounds and the medians here")
    args = parser.parse_args()

    probe = load_inline(
        "engine_weight_streams",
        cpp_sources=[SOURCE],
        functions=["pass_ms"],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, **kwargs)  # the engine's defaults otherwise
    weights, formats, xs, outs = [], [], [], []
    for layer in inspect(llm).model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            product = linear.packed
            product = product.products[0][1] if hasattr(product, "products") else product  # the one-row product
            if getattr(product, "data", None) is None or product.data.dim() != 3 or product.variant_id != 2:
                raise SystemExit("needs avx512vnni products on the paired layout: a GGUF model, an AVX-512 VNNI CPU")
            weights.append(product.data)
            formats.append(product.format_id)
            xs.append(torch.randn(1, product.in_features))
            outs.append(torch.empty(1, product.out_features))
    total_mb = sum(w.numel() for w in weights) / 1e6

    def bandwidth() -> float:
        return measure_bandwidth()["read_gb_s"]

    rounds = []
    print(f"{len(weights)} weights, {total_mb:.1f} MB; ms a pass; GB/s before and after")
    for r in range(args.rounds):
        before = bandwidth()
        order = MODES if r % 2 == 0 else MODES[::-1]
        got = {mode: probe.pass_ms(weights, formats, xs, outs, MODES.index(mode), args.reps) for mode in order}
        after = bandwidth()
        rounds.append({"bandwidth_before": before, "bandwidth_after": after, **got})
        print(f"{before:5.1f} {after:5.1f} | " + " ".join(f"{m} {got[m]:.3f}" for m in MODES), flush=True)
    summary = {}
    for phase, keep in (
        ("fast", lambda x: min(x["bandwidth_before"], x["bandwidth_after"]) > args.fast_above),
        ("slow", lambda x: max(x["bandwidth_before"], x["bandwidth_after"]) < args.slow_below),
        ("all", lambda x: True),
    ):
        chosen = [x for x in rounds if keep(x)]
        if not chosen:
            continue
        medians = {m: statistics.median(x[m] for x in chosen) for m in MODES}
        summary[phase] = {
            "rounds": len(chosen),
            "probe_gb_s": statistics.median(x["bandwidth_before"] for x in chosen),
            **{f"{m}_ms": round(v, 3) for m, v in medians.items()},
            **{f"{m}_gb_s": round(total_mb / v, 1) for m, v in medians.items()},
        }
        print(phase, json.dumps(summary[phase]))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"isa": torch.backends.cpu.get_cpu_capability(), "rounds": rounds, "summary": summary}, indent=1)
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
