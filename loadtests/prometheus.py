"""Read the app's metrics where a router, an autoscaler or Prometheus reads them: Ray's
Prometheus endpoint (each node's ``MetricsExportPort``), and check them against the documented
table in docs/metrics.md.

Ray exports a metric named ``xema_x`` as ``ray_xema_x`` (counters ``ray_xema_x_total``,
histograms ``ray_xema_x_bucket`` / ``_sum`` / ``_count``); ``scrape`` gives the documented names.

Examples (a running ``make serve``; the command attaches to its cluster to find the port)::

    python -m loadtests.prometheus                    # the endpoint's URL
    python -m loadtests.prometheus --discovery        # the same from Ray's service-discovery file
    python -m loadtests.prometheus --samples 6 --every 10   # each documented metric, sampled under load
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "metrics.md"
#: the prefix Ray's metrics agent puts before every application metric's name
RAY_PREFIX = "ray_"
#: documented "exported from" values: present once the app has served images and a video and refused a request
ALWAYS_AFTER_TRAFFIC = ("start", "start (0)", "request", "batch", "video batch", "refusal")
_ROW = re.compile(r"^\|\s*`(xema_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|\s*$")


class DocumentedMetric(BaseModel):
    """One row of docs/metrics.md's table."""

    model_config = ConfigDict(frozen=True)

    name: str
    type: str
    tags: tuple[str, ...]
    exported_from: str


class Sample(BaseModel):
    """One series' value at a scrape."""

    model_config = ConfigDict(frozen=True)

    labels: dict[str, str]
    value: float


def documented_metrics(path: Path = DOCS) -> dict[str, DocumentedMetric]:
    """The table's rows: ``| `name` | type | tags | meaning | use | exported from |``."""
    out = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        name, type_, tags, _, _, when = (g.strip() for g in m.groups())
        out[name] = DocumentedMetric(name=name, type=type_, tags=tuple(re.findall(r"`([a-z_]+)`", tags)),
                                     exported_from=when.strip("` "))
    return out


#: where Ray's head node writes its Prometheus file-based service discovery (every node's metrics
#: targets; what a Prometheus server's ``file_sd_configs`` reads)
SERVICE_DISCOVERY = Path("/tmp/ray/prom_metrics_service_discovery.json")


def discovered_urls(path: Path = SERVICE_DISCOVERY) -> list[str]:
    """The endpoints Ray's service-discovery file lists (its metrics agent and export ports on each
    node); [] without the file. Read without attaching to the cluster."""
    import json

    if not path.is_file():
        return []
    return [f"http://{t}/metrics" for group in json.loads(path.read_text()) for t in group.get("targets", [])]


def metrics_urls(address: str = "auto") -> list[str]:
    """Each alive node's Prometheus endpoint, from the cluster at ``address`` (attached as a
    driver for the look-up; in a process already attached, its own cluster)."""
    import ray

    attached = ray.is_initialized()
    if not attached:
        ray.init(address=address, log_to_driver=False)
    try:
        return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n["Alive"]]
    finally:
        if not attached:
            ray.shutdown()


def scrape(urls: Iterable[str], timeout_s: float = 10.0) -> dict[str, list[Sample]]:
    """The ``xema_`` metrics of ``urls`` by documented name (histograms: their ``_count`` and
    ``_sum`` series, ``le`` buckets left out)."""
    out: dict[str, list[Sample]] = {}
    for url in urls:
        text = requests.get(url, timeout=timeout_s).text
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(RAY_PREFIX + "xema_"):
                continue
            name = family.name[len(RAY_PREFIX):]
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    continue
                labels = dict(s.labels)
                if family.type == "histogram":
                    labels["series"] = s.name.rsplit("_", 1)[-1]
                out.setdefault(name, []).append(Sample(labels=labels, value=float(s.value)))
    return out


def summary_line(samples: list[Sample]) -> str:
    """Series count and value range (histograms: their request counts)."""
    vals = [s.value for s in samples if s.labels.get("series", "count") == "count"]
    return f"{len(vals):>3} series  min {min(vals):>14,.4g}  max {max(vals):>14,.4g}  sum {sum(vals):>14,.4g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="auto", help="the Ray cluster to find the endpoint of")
    ap.add_argument("--url", action="append", help="a Prometheus endpoint (default: each node's, from the cluster)")
    ap.add_argument("--discovery", type=Path, nargs="?", const=SERVICE_DISCOVERY, default=None,
                    help=f"read the endpoints from Ray's service-discovery file (default {SERVICE_DISCOVERY}) "
                         "instead of attaching to the cluster")
    ap.add_argument("--samples", type=int, default=0, help="scrape this many times and print every documented metric")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between scrapes")
    args = ap.parse_args()
    urls = args.url or (discovered_urls(args.discovery) if args.discovery else metrics_urls(args.address))
    print("\n".join(urls))
    documented = documented_metrics()
    for i in range(args.samples):
        if i:
            time.sleep(args.every)
        got = scrape(urls)
        print(f"\n--- scrape {i + 1} at {time.strftime('%H:%M:%S')}: {len(set(got) & set(documented))} of "
              f"{len(documented)} documented metrics present")
        for name, doc in documented.items():
            line = summary_line(got[name]) if name in got else f"absent (exported from: {doc.exported_from})"
            print(f"{name:<32} {doc.type:<9} {line}")
        undocumented = sorted(set(got) - set(documented))
        if undocumented:
            print(f"exported but not documented: {undocumented}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
