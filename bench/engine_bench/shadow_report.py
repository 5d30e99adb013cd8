"""`engine bench shadow-report URL`: a server's shadow A/B (``GET /v1/shadow``) as JSON and a PNG: the distribution
of |shadow - primary| log-probability against the dtype's tolerance, top-1 agreement with its interval, and shadow
TPOT / primary TPOT with its interval."""

from __future__ import annotations

from typing import Optional


def fetch_report(url: str, api_key: Optional[str] = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url.rstrip("/") + "/v1/shadow", headers=headers, timeout=30)
    if response.status_code != 200:
        raise SystemExit(f"{url}/v1/shadow answered {response.status_code}: {response.text[:300]}")
    return response.json()


def plot_report(report: dict, path: str) -> None:
    from engine_bench.plot import plt

    comparison = report.get("comparison") or {}
    figure, (hist, agree, speed) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    overrides = ",".join(f"{k}={v}" for k, v in report["overrides"].items())
    figure.suptitle(
        f"shadow {overrides}: {report['verdict']}, {report['speed_verdict']} "
        f"({comparison.get('tokens_compared', 0)} tokens, {report['requests']['completed']} requests)",
        fontsize=10,
    )
    delta = (comparison.get("logprob_delta") or {}).get("histogram")
    if delta:
        labels = [f"<={b:g}" if not isinstance(b, str) else ">1" for b in delta["le"]]
        hist.bar(range(len(labels)), delta["counts"], color="tab:blue")
        hist.set_xticks(range(len(labels)))
        hist.set_xticklabels(labels, fontsize=8)
        tolerance = comparison["tolerance"]["logprob"]
        position = next((i for i, b in enumerate(delta["le"]) if not isinstance(b, str) and b >= tolerance), 0)
        hist.axvline(position + 0.5, color="red", linestyle="--", label=f"mean bound {tolerance:g} nats")
        hist.legend(fontsize=8)
    hist.set_title("|shadow - primary| logprob of the primary's token (nats)", fontsize=9)
    hist.set_ylabel("tokens")
    top1 = comparison.get("top1_agreement") or {}
    if top1.get("rate") is not None:
        low, high = top1["ci95"]
        agree.bar([0], [top1["rate"]], yerr=[[top1["rate"] - low], [high - top1["rate"]]], capsize=6, color="tab:green")
        agree.set_ylim(min(0.9, low - 0.02), 1.005)
        agree.set_xticks([0])
        agree.set_xticklabels(
            [f"counted flips {top1['counted_disagreements']}\nnear-ties {top1['near_tie_disagreements']}"], fontsize=8
        )
    agree.set_title("top-1 agreement (95% CI)", fontsize=9)
    ratio = comparison.get("tpot_ratio") or {}
    if ratio.get("geometric_mean") is not None and ratio.get("ci95"):
        mean, (low, high) = ratio["geometric_mean"], ratio["ci95"]
        speed.bar([0], [mean], yerr=[[mean - low], [high - mean]], capsize=6, color="tab:orange")
        speed.axhline(1.0, color="grey", linestyle=":")
        speed.set_xticks([0])
        speed.set_xticklabels([f"{ratio['pairs']} pairs\n({ratio['contended_pairs']} contended, left out)"], fontsize=8)
    speed.set_title("shadow TPOT / primary TPOT (95% CI)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
