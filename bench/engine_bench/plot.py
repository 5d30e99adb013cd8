"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def bar_plot(
    path: str,
    labels: list[str],
    values: list[float],
    ylabel: str,
    title: str,
    annotations: list[str] | None = None,
    bound: float | None = None,
) -> None:
    """One bar per variant; ``bound`` draws the workload's bound as a dashed line."""
    ticks = [label.replace("+", "\n") for label in labels]  # A/B crosses: one key a line
    widest = max((len(line) for tick in ticks for line in tick.splitlines()), default=0)
    per_bar = max(1.6, 0.09 * widest)  # inches: a tick line of ``widest`` characters fits under its bar
    fig, ax = plt.subplots(figsize=(max(4, per_bar * len(labels) + 2), 4))
    bars = ax.bar(range(len(labels)), values, color=plt.cm.tab10(np.arange(len(labels)) % 10))
    ax.set_xticks(range(len(labels)), ticks)
    for bar, text in zip(bars, annotations or [f"{v:.1f}" for v in values]):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    if bound:
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"bound {bound:.0f}", (0, bound), xycoords=("axes fraction", "data"), va="bottom", color="grey")
    ax.set_ylabel(ylabel)
    ax.set_xlabel("variant")
    ax.set_title(title)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cdf_plot(path: str, series: dict[str, list[float]], xlabel: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        data = np.sort(np.asarray(values))
        if data.size:
            ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def grouped_bar_plot(path: str, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    """Bars of several series side by side in each group (e.g. GFLOP/s of each product per shape)."""
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) * max(1, len(series)) / 2 + 2), 4.5))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.set_xticks(x, groups, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
