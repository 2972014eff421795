"""A real Prometheus (Debian's package, unpacked by scripts/install_prometheus.sh,
which `make test` runs) scrapes a live `folio serve`: while a burst of
requests waits (one sequence at a time), the autoscaling query returns the
waiting count, and 0 once the burst is served. The scrape target carries the
namespace and pod labels Kubernetes service discovery gives, so the query is
the one an HPA (through prometheus-adapter) or a KEDA trigger asks."""

import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, free_port, http, tiny_server_args

PROMETHEUS = Path(__file__).resolve().parents[2] / "build" / "prometheus" / "prometheus"
# per pod, as prometheus-adapter's metricsQuery and a KEDA trigger sum it
QUERY = 'sum(folio:num_requests_waiting{namespace="folio-test"}) by (pod)'

pytestmark = pytest.mark.skipif(
    not PROMETHEUS.exists(),
    reason=f"no Prometheus at {PROMETHEUS}: scripts/install_prometheus.sh (run by make test) "
           "could not fetch Debian's prometheus package here")


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
                                "labels": {"namespace": "folio-test", "pod": "folio-0"}}]}]}))
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


def query(prom: str) -> dict[str, float]:
    try:
        status, _, body = http("GET", f"{prom}/api/v1/query?query={urllib.parse.quote(QUERY)}")
    except (urllib.error.URLError, ConnectionError):      # Prometheus still starting
        return {}
    if status != 200 or body.get("status") != "success":
        return {}
    return {r["metric"]["pod"]: float(r["value"][1]) for r in body["data"]["result"]}


def wait_until(prom: str, ok, timeout: float = 60.0) -> dict[str, float]:
    end, last = time.monotonic() + timeout, {}
    while time.monotonic() < end:
        last = query(prom)
        if last and ok(last):
            return last
        time.sleep(0.25)
    raise AssertionError(f"the query never held; last answer {last}")


def test_the_waiting_queue_reaches_prometheus_and_empties(scraped):
    srv, prom = scraped
    assert wait_until(prom, lambda r: r.get("folio-0") == 0)          # up, nothing waiting
    # 20 requests of 240 tokens, one at a time: seconds of queue on the tiny model
    body = {"model": "tiny", "prompt": [1, 20, 30, 40], "max_tokens": 240, "ignore_eos": True}
    threads = [threading.Thread(target=http, args=("POST", srv.url + "/v1/completions", body))
               for _ in range(20)]
    for t in threads:
        t.start()
    seen = wait_until(prom, lambda r: r.get("folio-0", 0) >= 2)       # one runs, the rest wait
    assert 2 <= seen["folio-0"] <= 19
    for t in threads:
        t.join(120)
    assert wait_until(prom, lambda r: r.get("folio-0") == 0)["folio-0"] == 0
