"""The metrics contract without Ray: docs/metrics.md's table and the code name the same metrics,
with the same types; the Grafana dashboard is a Grafana JSON model on a Prometheus datasource
variable whose every query uses documented metrics only. (That a live app exports them:
tests/serving/test_app.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from loadtests.prometheus import ALWAYS_AFTER_TRAFFIC, RAY_PREFIX, documented_metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deployments" / "grafana" / "xema-dashboard.json"
_DEFINED = re.compile(r'\b(Counter|Gauge|KeptGauge|Histogram|gauge)\(\s*"(xema_[a-z0-9_]+)"')
#: what "exported from" may say (docs/metrics.md)
EVENTS = {*ALWAYS_AFTER_TRAFFIC, "slo miss", "failure", "retry", "rebuild", "out of memory", "preemption",
          "residency", "layout", "wake"}
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                 "offset", "le", "sum", "min", "max", "avg", "count", "rate", "increase", "irate", "histogram_quantile",
                 "label_values", "topk", "bottomk", "abs", "clamp_min", "clamp_max"}


def defined_in_code() -> dict[str, str]:
    out = {}
    for path in (ROOT / "xema_ray").rglob("*.py"):
        for kind, name in _DEFINED.findall(path.read_text()):
            if name == "xema_doc_example":  # KeptGauge's docstring
                continue
            out[name] = "gauge" if kind in ("KeptGauge", "gauge") else kind.lower()
    return out


def test_the_table_and_the_code_name_the_same_metrics_with_their_types() -> None:
    documented = documented_metrics()
    code = defined_in_code()
    assert len(documented) >= 35 and set(documented) == set(code), (sorted(set(code) - set(documented)),
                                                                   sorted(set(documented) - set(code)))
    assert {n: d.type for n, d in documented.items()} == code
    for d in documented.values():
        assert d.exported_from in EVENTS, d
        # low cardinality by construction (quality: the tiers, at most lossless, balanced, fast)
        assert set(d.tags) <= {"model", "template", "worker", "reason", "quality"}, d


def _series_names(expr: str) -> set[str]:
    """The identifiers of a PromQL expression that are not functions, keywords or label names."""
    without_labels = re.sub(r"\{[^}]*\}", "", re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr))
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_labels)
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_ranges)
            if w not in _PROMQL_WORDS and not re.fullmatch(r"e|Inf|NaN", w)}


def _documented_name(series: str) -> str:
    assert series.startswith(RAY_PREFIX + "xema_"), series
    name = series[len(RAY_PREFIX):]
    return re.sub(r"_(total|bucket|sum|count)$", "", name) if name not in documented_metrics() else name


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_variable_using_documented_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    documented = documented_metrics()
    used: set[str] = set()
    ids, queries = set(), 0
    for panel in dash["panels"]:
        assert panel["id"] not in ids and {"h", "w", "x", "y"} <= set(panel["gridPos"])
        ids.add(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            names = {_documented_name(s) for s in _series_names(target["expr"])}
            assert names and names <= set(documented), (panel["title"], target["expr"], names - set(documented))
            # a counter is read through its _total series, a histogram through _bucket / _sum / _count
            for s in _series_names(target["expr"]):
                kind = documented[_documented_name(s)].type
                assert (kind == "counter") == s.endswith("_total") or kind == "histogram", s
            used |= names
            queries += 1
    series = re.fullmatch(r"label_values\((\w+), model\)", variables["model"]["query"]["query"])
    assert series is not None and _documented_name(series.group(1)) in documented
    # the metrics a router or autoscaler reads are all on it
    assert {"xema_predicted_queue_wait_s", "xema_slo_attainment", "xema_predicted_attainment", "xema_device_headroom_bytes",
            "xema_step_seconds", "xema_video_realtime_factor", "xema_requests_refused", "xema_preemptions",
            "xema_paused_batches"} <= used
    assert queries >= 20


def test_the_endpoints_come_from_rays_service_discovery_file(tmp_path: Path) -> None:
    from loadtests.prometheus import discovered_urls

    f = tmp_path / "prom_metrics_service_discovery.json"
    f.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ["127.0.0.1:36265", "10.0.0.2:8080"]}]))
    assert discovered_urls(f) == ["http://127.0.0.1:36265/metrics", "http://10.0.0.2:8080/metrics"]
    assert discovered_urls(tmp_path / "absent.json") == []
