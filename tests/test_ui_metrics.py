"""Every process's Prometheus metrics are reachable from what ``lanes up`` prints, each process
exports its own (no other role's gauges as a flat 0), and the Grafana dashboard in
``deploy/grafana/`` is import-ready and asks only for metrics that exist."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import REPO_ROOT, scaled
from test_up import Up, up_runs, wait_for  # noqa: F401 - the fixture is used by name

from e2e_support import Client
from lanes.queue.embedded import free_port
from lanes.telemetry import metrics

GRAFANA = REPO_ROOT / "deploy" / "grafana" / "lanes.json"


def families(registry) -> set[str]:  # noqa: ANN001
    return {family.name for family in registry.collect()}


def test_each_role_registers_only_its_own_metrics() -> None:
    edge, worker, scheduler = families(metrics.EDGE), families(metrics.WORKER), families(metrics.SCHEDULER)
    assert not (edge & worker) and not (edge & scheduler) and not (worker & scheduler)
    assert {"lanes_ttft_seconds", "lanes_rejections"} <= edge
    assert {"lanes_kv_cache_usage", "lanes_spec_acceptance_rate", "lanes_generated_tokens"} <= worker
    assert {"lanes_lane_depth", "lanes_lane_oldest_wait_seconds", "lanes_desired_workers"} <= scheduler
    text = metrics.exposition(metrics.EDGE).decode()
    assert "lanes_kv_cache_usage" not in text and "lanes_lane_depth" not in text
    assert "process_cpu_seconds_total" in text or "python_info" in text, "the default registry comes along"


def test_a_forgotten_pools_gauges_are_dropped() -> None:
    """A pool the scheduler forgets (no worker, no request for 10 minutes) stops being exported:
    its gauges kept their last values (desired 1) for good."""
    from lanes.telemetry import metrics

    metrics.LANE_DEPTH.labels("gone", "short").set(3)
    metrics.DESIRED_WORKERS.labels("gone").set(1)
    metrics.POOL_WORKERS.labels("kept").set(2)
    metrics.forget_pool("gone")
    text = metrics.exposition(metrics.SCHEDULER).decode()
    assert 'pool="gone"' not in text and 'lanes_pool_workers{pool="kept"} 2.0' in text


def test_grafana_dashboard_is_import_ready() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    known = families(metrics.EDGE) | families(metrics.WORKER) | families(metrics.SCHEDULER)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    asked: set[str] = set()
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            for name in re.findall(r"\blanes_[a-z0-9_]+", target["expr"]):
                asked.add(re.sub(r"_(bucket|count|sum|total)$", "", name))
    assert asked <= known, f"the dashboard asks for metrics nobody exports: {asked - known}"
    wanted = {"lanes_lane_depth", "lanes_lane_oldest_wait_seconds", "lanes_ttft_seconds", "lanes_rejections",
              "lanes_generated_tokens", "lanes_worker_running", "lanes_kv_cache_usage", "lanes_spec_acceptance_rate"}
    assert wanted <= asked, wanted - asked


def test_grafana_rates_only_counters_and_reads_worker_throughput_from_the_counter() -> None:
    """``rate()`` of a gauge is meaningless, and ``lanes_worker_tokens_per_second`` is one 0.5 s
    heartbeat's value (a scrape samples noise): the per-worker tokens/s panel is the rate of
    ``lanes_generated_tokens_total`` per instance, over a minute."""
    kinds = {f.name: f.type for r in (metrics.EDGE, metrics.WORKER, metrics.SCHEDULER) for f in r.collect()}
    exprs = [t["expr"] for p in json.loads(GRAFANA.read_text())["panels"] for t in p.get("targets", [])]
    rated = {name for expr in exprs for name in re.findall(r"\brate\((lanes_[a-z0-9_]+)", expr)}
    assert rated, "the dashboard rates counters"
    for name in rated:
        base = re.sub(r"_(bucket|total)$", "", name)
        assert kinds.get(base) in ("counter", "histogram"), f"rate() of {name}, a {kinds.get(base)}"
    assert not any("lanes_worker_tokens_per_second" in expr for expr in exprs)
    (panel,) = [p for p in json.loads(GRAFANA.read_text())["panels"] if p["title"].startswith("Tokens per second per worker")]
    assert panel["targets"][0]["expr"] == 'sum by (instance) (rate(lanes_generated_tokens_total{job=~"$job"}[$__rate_interval]))'


def test_grafana_error_rate_is_the_readmes() -> None:
    """The dashboard's error rate divides by ``lanes_requests_total`` (refused input included),
    with the README's list of outcomes that are not errors; ``lanes_errors_total`` counts error
    answers that are no request's and is never its numerator."""
    readme = (REPO_ROOT / "README.md").read_text()
    not_errors = re.search(r'lanes_requests_total\{outcome!~"([^"]+)"\}\[5m\]', readme).group(1)  # type: ignore[union-attr]
    panel = next(p for p in json.loads(GRAFANA.read_text())["panels"] if p["title"].startswith("Error rate"))
    numerator, denominator = panel["targets"][0]["expr"].split(" / ")
    assert f'outcome!~"{not_errors}"' in numerator and "lanes_requests_total" in numerator
    for target in panel["targets"]:
        assert target["expr"].split(" / ")[1] == denominator
        assert "lanes_errors_total" not in target["expr"]
    assert re.fullmatch(r"sum\(rate\(lanes_requests_total\{[^}]*\}\[\$__rate_interval\]\)\)", denominator)


def scrape(url: str) -> dict[str, float]:
    """``sample{labels}`` -> value of every ``lanes_`` sample at ``url``."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("lanes_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.mark.e2e
def test_lanes_up_prints_a_metrics_url_for_every_process(redis_url: str, tmp_path: Path,
                                                        up_runs: list[Up]) -> None:  # noqa: F811
    port = free_port()
    up = Up(tmp_path, "--port", str(port), "--engine", "sim", "--workers", "2",
            LANES_REDIS_URL=redis_url, LANES_KEY_PREFIX=f"m{uuid.uuid4().hex[:6]}")
    up_runs.append(up)
    wait_for(lambda: "\nmetrics: " in up.output, scaled(120), "the metrics line")
    line = next(line for line in up.output.splitlines() if line.startswith("metrics: "))
    urls = dict(re.findall(r"(\S+) (http://\S+/metrics)", line))
    assert set(urls) == {"edge", "scheduler", "worker-0", "worker-1"}, line
    assert urls["edge"] == f"http://127.0.0.1:{port}/metrics"

    async def chat() -> None:
        client = await Client.connect(f"ws://127.0.0.1:{port}/v1/chat")
        await client.chat("m1", "hello", max_tokens=8)
        assert (await client.wait("m1", scaled(30)))["type"] == "done"
        await client.close()

    asyncio.run(chat())
    wait_for(lambda: any(k.startswith("lanes_generated_tokens_total") and v > 0
                         for url in (urls["worker-0"], urls["worker-1"]) for k, v in scrape(url).items()),
             scaled(10), "a worker's token counter")
    edge, scheduler = scrape(urls["edge"]), scrape(urls["scheduler"])
    assert sum(v for k, v in edge.items() if k.startswith("lanes_requests_total")) == 1, edge
    assert not any(k.startswith(("lanes_worker_", "lanes_lane_", "lanes_kv_")) for k in edge), "edge: its own only"
    for lane in ("short", "medium", "long"):
        assert f'lanes_lane_depth{{lane="{lane}",pool="default"}}' in scheduler
        assert f'lanes_lane_oldest_wait_seconds{{lane="{lane}",pool="default"}}' in scheduler
    # ``ready`` needs one warm worker; the second registers when it is warm too.
    wait_for(lambda: scrape(urls["scheduler"]).get("lanes_live_workers") == 2, scaled(30), "both workers counted")
    for name in ("worker-0", "worker-1"):
        worker = scrape(urls[name])
        assert "lanes_worker_tokens_per_second" in worker and not any(k.startswith("lanes_edge_") for k in worker)
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(scaled(60)) == 0
