"""Load-test report: SLO attainment, goodput, latency percentiles per template, errors, and the
achieved arrival rate counted at the server; CSV, JSON and a PNG."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from pydantic import BaseModel


class RequestRecord(BaseModel):
    index: int
    template: str
    scheduled_s: float
    sent_at: float
    latency_s: float
    status: int  # 0 = no HTTP status (transport error)
    slo_s: float
    met: bool
    error: str = ""
    first_progress_s: float | None = None  # video jobs: create to the first progress above 0
    polls: int = 0  # video jobs: GET /v1/videos/{id} calls


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(records: list[RequestRecord], sent: int, duration_s: float, target_rate: float,
              server_received: int) -> dict:
    answered = [r for r in records if r.status != 0]
    ok = [r for r in records if r.status == 200]
    per_template: dict[str, dict] = {}
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.template].append(r)
    for name, rs in sorted(groups.items()):
        lat = [r.latency_s for r in rs if r.status == 200]
        per_template[name] = {
            "sent": len(rs), "ok": len(lat), "met": sum(r.met for r in rs),
            "attainment": sum(r.met for r in rs) / len(rs),
            "p50_s": _pct(lat, 50), "p90_s": _pct(lat, 90), "p99_s": _pct(lat, 99), "slo_s": rs[0].slo_s,
            "first_progress_p50_s": _pct([r.first_progress_s for r in rs if r.first_progress_s is not None], 50),
            "first_progress_p90_s": _pct([r.first_progress_s for r in rs if r.first_progress_s is not None], 90),
            "polls_per_request": sum(r.polls for r in rs) / len(rs),
            "errors": {str(s): sum(r.status == s for r in rs) for s in sorted({r.status for r in rs}) if s != 200},
        }
    return {
        "sent": sent,
        "recorded": len(records),
        "succeeded": len(ok),
        "failed_with_status": len(answered) - len(ok),
        "lost": sent - len(answered),
        "attainment": sum(r.met for r in records) / sent if sent else 0.0,
        "goodput_rpm": sum(r.met for r in records) / duration_s * 60.0,
        "target_rate_rps": target_rate,
        "achieved_rate_client_rps": sent / duration_s,
        "achieved_rate_server_rps": server_received / duration_s,
        "server_received": server_received,
        "per_template": per_template,
    }


def write_report(records: list[RequestRecord], sent: int, duration_s: float, target_rate: float,
                 server_received: int, out: Path, mix: str, slo_scale: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, sent, duration_s, target_rate, server_received)
    summary.update(mix=mix, slo_scale=slo_scale, duration_s=duration_s)
    with (out / "requests.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RequestRecord.model_fields))
        w.writeheader()
        for r in sorted(records, key=lambda r: r.index):
            w.writerow(r.model_dump())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "arrivals.json").write_text(json.dumps(
        [{"t": r.scheduled_s, "template": r.template, "request_id": str(r.index)} for r in sorted(records, key=lambda r: r.index)]))
    _plot(records, summary, out / "latency.png")
    return summary


def _plot(records: list[RequestRecord], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name in sorted({r.template for r in records}):
        rs = sorted((r for r in records if r.template == name), key=lambda r: r.scheduled_s)
        ax.scatter([r.scheduled_s for r in rs], [r.latency_s for r in rs], s=10,
                   label=f"{name} ({summary['per_template'][name]['attainment']:.0%} met)")
        ax.axhline(rs[0].slo_s, ls=":", lw=0.8)
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"SLO attainment {summary['attainment']:.1%}, goodput {summary['goodput_rpm']:.1f}/min, "
                 f"rate {summary['achieved_rate_server_rps']:.3f}/s (target {summary['target_rate_rps']:.3f})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
