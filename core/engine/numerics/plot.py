"""The oracle's PNG: relative error against float64 at every probe, for the config under test and each bisect
swap, with the dtype's tolerance."""

from __future__ import annotations


def plot_errors(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or engine-bench)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["name"] for row in report["probes"]]
    figure, axes = plt.subplots(figsize=(min(16, max(8, 0.22 * len(names) + 3)), 4.8))
    floor = 1e-17
    series = [("under test: " + _label(report["plugins"]), report["probes"])]
    series += [(f"{b['kind']} {b['plugin']} -> {b['swapped_to']}", b["probes"]) for b in report["bisect"]]
    for label, rows in series:
        axes.semilogy(range(len(rows)), [max(r["relative_error"], floor) for r in rows], marker=".", label=label)
    base = report["tolerance"]["activation_base"]
    axes.plot(
        range(len(names)),
        [row["tolerance"] for row in report["probes"]],
        color="red",
        linestyle="--",
        label=f"{report['dtype']} tolerance {base:g} x sqrt(layer + 1)",
    )
    if report.get("first_failure"):
        axes.axvline(names.index(report["first_failure"]["name"]), color="grey", linestyle=":", label="first failure")
    step = max(1, len(names) // 40)
    axes.set_xticks(range(0, len(names), step))
    axes.set_xticklabels(names[::step], rotation=90, fontsize=7)
    axes.set_ylabel("relative error vs float64")
    guilty = ", ".join(f"{g['kind']}={g['plugin']}" for g in report["guilty"]) or "none"
    axes.set_title(f"engine check numerics: {report['verdict']} (guilty: {guilty})", fontsize=10)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _label(plugins: dict) -> str:
    return ", ".join(f"{k}={plugins[k]}" for k in ("attention", "layer_kernels", "quantization") if k in plugins)
