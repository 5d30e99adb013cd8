"""Linear products chosen by measurement: each candidate product (a layer-kernels plugin's own GEMM, oneDNN's
packed product, the plain torch product, a native 16-bit product) is timed on the model's own weight shapes at
a single-row, a decode-batch and a prompt-chunk row count, and every layer uses the fastest per row bucket.

The choice is cached on disk (``$XDG_CACHE_HOME/engine/products/``, keyed by the CPU's model name and flags,
the torch version, the thread count, the dtype, the candidates and the shapes), so an engine measures once per
machine and model; ``device.kernel_cache = false`` (``--no-kernel-cache``) measures again.
``engine bench kernels`` prints the table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from engine.disk_cache import engine_cache_dir
from engine.model.layers.linear import PackedProduct, linear_layers
from engine.model.quant_formats import quantize

logger = logging.getLogger(__name__)

CHOICE_VERSION = 3  # bump when the measurement changes meaning: old cache entries are then ignored
SWITCH_MARGIN = 0.10  # another candidate must be this much faster than the first-listed one to replace it
FALLBACK_CACHE_BYTES = 32 * 2**20  # the last-level cache assumed where sysfs does not say
MAX_FLUSH_BYTES = 512 * 2**20  # the flush array's cap (a server's L3 can be hundreds of MiB)


@dataclass(frozen=True)
class RowBucket:
    """Products with at most ``max_rows`` rows use the candidate fastest at ``measured_rows``."""

    name: str
    max_rows: float
    measured_rows: int


ROW_BUCKETS = (RowBucket("single", 8, 1), RowBucket("decode", 192, 64), RowBucket("prompt", math.inf, 512))


@dataclass(frozen=True)
class ProductCandidate:
    """One way to run ``x @ weight.T + bias``: ``make(weight, bias)`` prepares it for a weight (None where it
    cannot take that weight). ``build``: what identifies the kernel's code (a compiled module's size and time),
    part of the cached measurement's key, so that a rebuilt kernel is measured again."""

    name: str
    make: Callable[
        [Any, Optional[torch.Tensor]], Optional[PackedProduct]
    ]  # (weight: a tensor or QuantizedWeight, bias)
    build: str = ""


def module_build(module: Any) -> str:
    """A compiled module's build identity for ``ProductCandidate.build``: its file's size and modification time."""
    stat = os.stat(module.__file__)
    return f"{stat.st_size}-{int(stat.st_mtime)}"


@dataclass(frozen=True)
class ProductShape:
    """A weight shape of the model: ``out_features x in_features``; the LM head runs on sampled rows only
    (never a prompt chunk), so its prompt bucket takes the decode bucket's choice."""

    out_features: int
    in_features: int
    is_head: bool = False

    @property
    def key(self) -> str:
        return f"{self.out_features}x{self.in_features}" + (" head" if self.is_head else "")


@dataclass
class ProductChoice:
    """The measurements for one shape: GFLOP/s of every candidate per bucket, and the fastest."""

    shape: ProductShape
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> candidate -> GFLOP/s
    chosen: dict[str, str] = field(default_factory=dict)  # bucket -> candidate

    def best_gflops(self, bucket: str) -> float:
        """The fastest candidate's rate in ``bucket`` (the decode bucket's for a head's prompt bucket)."""
        rates = self.gflops.get(bucket) or self.gflops[ROW_BUCKETS[1].name]
        return max(rates.values())


@dataclass
class ProductTable:
    """Every shape's choice, where it came from (measured now, or read from the cache) and what it cost."""

    choices: dict[str, ProductChoice]
    source: str  # "measured" or the cache file read
    seconds: float
    key: dict

    def rows(self) -> list[dict]:
        """One flat row per (shape, bucket), for tables and JSON."""
        out = []
        for choice in self.choices.values():
            for bucket in ROW_BUCKETS:
                if bucket.name not in choice.gflops:
                    continue
                out.append(
                    {
                        "shape": choice.shape.key,
                        "bucket": bucket.name,
                        "rows": bucket.measured_rows,
                        "chosen": choice.chosen[bucket.name],
                        **{f"{name}_gflops": round(v, 1) for name, v in choice.gflops[bucket.name].items()},
                    }
                )
        return out

    def to_json(self) -> dict:
        return {"key": self.key, "source": self.source, "seconds": round(self.seconds, 3), "table": self.rows()}


def bucket_of(rows: int) -> RowBucket:
    return next(b for b in ROW_BUCKETS if rows <= b.max_rows)


class BucketedProduct:
    """A layer's product dispatched by row count to the candidate chosen for that bucket."""

    def __init__(self, in_features: int, products: list[tuple[float, PackedProduct]]):
        self.in_features = in_features
        self.products = products  # (max_rows, product), ascending

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        for max_rows, product in self.products:
            if rows <= max_rows:
                return product(x)
        return self.products[-1][1](x)


def cpu_identity() -> dict:
    """The CPU's model name and a digest of its feature flags (two machines of one kind may differ here)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first core's
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    return {
        "cpu": name,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "flags": hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:16],
    }


def cache_dir() -> str:
    return engine_cache_dir("products")


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of the largest cache the first core reads through (its last level, usually L3), from sysfs;
    ``FALLBACK_CACHE_BYTES`` where the kernel does not say."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    largest = 0
    try:
        entries = os.listdir(sysfs)
    except OSError:
        return FALLBACK_CACHE_BYTES
    for entry in entries:
        try:
            with open(os.path.join(sysfs, entry, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
        if number.isdigit():
            largest = max(largest, int(number) * unit)
    return largest or FALLBACK_CACHE_BYTES


class CacheFlush:
    """Reads an array twice the last-level cache, so that what the caches hold afterwards is the same (clean lines
    of that array) whatever ran before: a candidate timed after one that wrote a large output (the de-quantizing
    product writes its whole float weight) otherwise pays for writing those dirty lines back."""

    def __init__(self, cache_bytes: Optional[int] = None):
        size = 2 * (cache_bytes or last_level_cache_bytes())
        self.array = torch.ones(min(size, MAX_FLUSH_BYTES) // 4)

    def __call__(self) -> None:
        self.array.sum()


def shape_fills_cache(shape: ProductShape, cache_bytes: int) -> bool:
    """Whether the candidates' data for ``shape`` (its weight in float32: the float panels, or the whole weight a
    de-quantizing product writes) is at least half the last-level cache, so that one candidate's run changes what
    the next finds there. Smaller shapes are timed without flushes (each costs milliseconds)."""
    return 4 * shape.out_features * shape.in_features >= cache_bytes // 2


def time_candidates(
    products: dict[str, PackedProduct],
    x: torch.Tensor,
    rounds: int = 3,
    budget_s: float = 0.004,
    flush: Optional[Callable[[], None]] = None,
) -> dict[str, float]:
    """Seconds per call of each product (the best of ``rounds`` interleaved rounds, so a busy neighbour or a
    frequency change hits every candidate alike and the minimum filters it out). ``flush`` (a
    :class:`CacheFlush`), where given, runs before each candidate's warm-up and each of its timed runs: every
    candidate then starts from the same caches, not from what the one before it left there."""
    best = {}
    for name, product in products.items():  # warm-up: first-call allocations and oneDNN's primitive cache
        if flush is not None:
            flush()
        start = time.perf_counter()
        product(x)
        best[name] = time.perf_counter() - start
    reps = {name: max(1, min(50, int(budget_s / max(t, 1e-6)))) for name, t in best.items()}
    for _ in range(rounds):
        for name, product in products.items():
            if flush is not None:
                flush()
            start = time.perf_counter()
            for _ in range(reps[name]):
                product(x)
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best


def pick_fastest(seconds: dict[str, float], preferred: Optional[str]) -> str:
    """The fastest candidate, unless the preferred one (the first listed: the layer kernels' own default) is
    within ``SWITCH_MARGIN`` of it: timing noise must not switch kernels, a clear win must."""
    fastest = min(seconds, key=seconds.__getitem__)
    if preferred in seconds and seconds[preferred] <= seconds[fastest] * (1 + SWITCH_MARGIN):
        return preferred
    return fastest


def measure_shape(
    shape: ProductShape,
    candidates: list[ProductCandidate],
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    generator: torch.Generator,
    weight_format: Optional[str] = None,
    flush: Optional[Callable[[], None]] = None,
) -> ProductChoice:
    """Time every candidate that takes this weight at each bucket's row count (on a weight quantized to
    ``weight_format`` when given: the candidates are then products on packed weights; ``flush``: see
    :func:`time_candidates`)."""
    weight: Any = (torch.randn(shape.out_features, shape.in_features, generator=generator) * 0.05).to(weight_dtype)
    if weight_format is not None:
        weight = quantize(weight, weight_format)
    products = {}
    for candidate in candidates:
        try:
            product = candidate.make(weight, None)
        except RuntimeError as exc:  # a library primitive missing from this build of torch
            logger.debug("product %s cannot run here: %s", candidate.name, exc)
            product = None
        if product is not None:
            products[candidate.name] = product
    choice = ProductChoice(shape)
    for bucket in ROW_BUCKETS:
        if shape.is_head and bucket.measured_rows > ROW_BUCKETS[1].measured_rows:
            continue
        x = torch.randn(bucket.measured_rows, shape.in_features, generator=generator).to(dtype)
        seconds = time_candidates(products, x, flush=flush)
        flop = 2.0 * bucket.measured_rows * shape.out_features * shape.in_features
        choice.gflops[bucket.name] = {name: flop / s / 1e9 for name, s in seconds.items()}
        choice.chosen[bucket.name] = pick_fastest(seconds, preferred=next(iter(products), None))
    if shape.is_head:  # the head's rows never reach a prompt chunk's count
        choice.chosen[ROW_BUCKETS[2].name] = choice.chosen[ROW_BUCKETS[1].name]
    return choice


def choose_products(
    shapes: list[ProductShape],
    candidates: list[ProductCandidate],
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    use_cache: bool = True,
    weight_format: Optional[str] = None,
) -> ProductTable:
    """Measure (or read from the disk cache) the fastest candidate per shape and row bucket; ``weight_format``: the
    weights are quantized in that format (``engine.model.quant_formats``) and the candidates take packed ones."""
    key = {
        "version": CHOICE_VERSION,
        **cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "weight_dtype": weight_format or str(weight_dtype),
        "candidates": [f"{c.name}@{c.build}" if c.build else c.name for c in candidates],
        "shapes": sorted({s.key for s in shapes}),
        "buckets": [b.measured_rows for b in ROW_BUCKETS],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"{digest}.json")
    if use_cache:
        cached = _read_cache(path, key, shapes)
        if cached is not None:
            return cached
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    choices = {}
    cache_bytes = last_level_cache_bytes()
    flush: Optional[CacheFlush] = None
    for shape in shapes:
        if shape.key in choices:
            continue
        fills_cache = shape_fills_cache(shape, cache_bytes)
        if fills_cache and flush is None:  # one flush array for the whole measurement
            flush = CacheFlush(cache_bytes)
        choices[shape.key] = measure_shape(
            shape, candidates, dtype, weight_dtype, generator, weight_format, flush=flush if fills_cache else None
        )
    table = ProductTable(choices, "measured", time.perf_counter() - start, key)
    _write_cache(path, table)
    return table


def _read_cache(path: str, key: dict, shapes: list[ProductShape]) -> Optional[ProductTable]:
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    if stored.get("key") != key:
        return None
    by_key = {s.key: s for s in shapes}
    try:
        choices = {k: ProductChoice(by_key[k], c["gflops"], c["chosen"]) for k, c in stored["choices"].items()}
    except (KeyError, TypeError):
        return None
    return ProductTable(choices, path, 0.0, key)


def _write_cache(path: str, table: ProductTable) -> None:
    payload = {
        "key": table.key,
        "measured_seconds": table.seconds,
        "choices": {k: {"gflops": c.gflops, "chosen": c.chosen} for k, c in table.choices.items()},
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as f:
            json.dump(payload, f, indent=1)
        os.replace(f.name, path)  # two workers measuring at once: each file is whole
    except OSError as exc:
        logger.warning("could not cache the product choice in %s: %s", path, exc)


def log_table(table: ProductTable) -> None:
    where = f"measured in {table.seconds:.2f} s" if table.source == "measured" else f"cached in {table.source}"
    summary = "; ".join(
        f"{c.shape.key}: " + ", ".join(f"{b}={n}" for b, n in c.chosen.items()) for c in table.choices.values()
    )
    logger.info(
        "linear products chosen by measurement (%s, %s threads, %s, %s weights): %s",
        where,
        table.key["threads"],
        table.key["isa"],
        table.key["weight_dtype"].replace("torch.", ""),
        summary,
    )


def model_shapes(model: torch.nn.Module, weight_format: Optional[str] = None) -> list[ProductShape]:
    """The distinct linear weight shapes of a loaded model, the LM head marked: of its float weights, or of those
    quantized in ``weight_format``."""

    def shape_of(module: Any) -> Optional[tuple[int, int]]:
        quant = getattr(module, "quant_weight", None)
        if weight_format is None:
            return None if quant is not None else tuple(module.weight.shape)
        return quant.shape if quant is not None and quant.format == weight_format else None

    shapes = {ProductShape(*shape) for shape in map(shape_of, linear_layers(model)) if shape is not None}
    head = getattr(model, "lm_head", None) if hasattr(model, "logits_gemm") else None
    ordered = sorted(shapes, key=lambda s: (s.out_features, s.in_features))
    head_shape = shape_of(head) if head is not None else None
    if head_shape is not None:
        ordered.append(ProductShape(*head_shape, is_head=True))
    return ordered


def quantized_formats(model: torch.nn.Module) -> list[str]:
    """The formats of the model's quantized linear weights (LM head included)."""
    weights = [getattr(m, "quant_weight", None) for m in model.modules()]
    return sorted({w.format for w in weights if w is not None})


def bucketed_product(
    choice: ProductChoice, candidates: dict[str, ProductCandidate], weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> Optional[PackedProduct]:
    """The product for one layer: the chosen candidate when every bucket agrees, else a row-count dispatch
    (each distinct candidate prepared once)."""
    made: dict[str, Optional[PackedProduct]] = {}
    products = []
    for bucket in ROW_BUCKETS:
        name = choice.chosen[bucket.name]
        if name not in made:
            made[name] = candidates[name].make(weight, bias)
        products.append((bucket.max_rows, made[name]))
    if len(made) == 1:
        return next(iter(made.values()))
    if any(p is None for _, p in products):  # a candidate that declines a weight declines it in every bucket
        return next((p for p in made.values() if p is not None), None)
    return BucketedProduct(weight.shape[1], [(rows, p) for rows, p in products if p is not None])
