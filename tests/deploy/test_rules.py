"""The rules and queries shipped in deploy/: the recording and alerting rules
pass `promtool check rules` and their unit tests (`promtool test rules`); every
query in the Grafana dashboard and the prometheus-adapter rule compiles in
promtool, and names only series that Folio's /metrics serves; the chart's
PrometheusRule is that same rule file."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from folio.server.metrics import ServerMetrics
from tests.deploy.manifests import ADAPTER, CHART, ROOT, adapter_query, by_kind, needs_helm, render

PROMTOOL = ROOT / "build" / "prometheus" / "promtool"
FILES = CHART / "files"

needs_promtool = pytest.mark.skipif(
    not PROMTOOL.exists(), reason=f"no promtool at {PROMTOOL}: scripts/install_prometheus.sh "
                                  "(run by make test) could not fetch Debian's prometheus package")


def promtool(*args: str, cwd: Path = FILES) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def served_series() -> set[str]:
    """The sample names Folio's /metrics text has (counters' _total, histograms' _bucket)."""
    metrics = ServerMetrics("m")
    metrics.success.labels("m", "stop")     # a labelled counter shows once it has a child
    text = metrics.render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def dashboard_queries() -> list[str]:
    dash = json.loads((FILES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0]
              for v in dash["templating"]["list"] if v["type"] == "query"]
    # Grafana's own variables, as Grafana substitutes them
    return [e.replace("$__rate_interval", "1m").replace("$namespace", ".*")
            .replace("$pod", ".*") for e in exprs]


def compile_in_promtool(exprs: list[str], tmp_path: Path) -> None:
    rules = {"groups": [{"name": "compiled", "rules": [
        {"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def folio_series(expr: str) -> set[str]:
    return set(re.findall(r"folio:[a-z0-9_]+", expr))


@needs_promtool
def test_the_rules_pass_promtool_check_and_their_unit_tests():
    out = promtool("check", "rules", "rules.yaml")
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr
    out = promtool("test", "rules", "rules_test.yaml")
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@needs_promtool
def test_a_wrong_expectation_fails_the_rule_tests(tmp_path):
    broken = (FILES / "rules_test.yaml").read_text().replace("value: 15", "value: 16")
    (tmp_path / "rules.yaml").write_text((FILES / "rules.yaml").read_text())
    (tmp_path / "rules_test.yaml").write_text(broken)
    out = promtool("test", "rules", "rules_test.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr


@needs_promtool
def test_the_dashboard_and_adapter_queries_compile(tmp_path):
    queries = dashboard_queries() + [adapter_query('namespace="ml",pod=~"a|b"', "pod")]
    assert len(queries) == 18
    compile_in_promtool(queries, tmp_path)


def test_every_query_names_only_series_folio_serves():
    served = served_series()
    rules = yaml.safe_load((FILES / "rules.yaml").read_text())["groups"]
    exprs = dashboard_queries() + [r["expr"] for g in rules for r in g["rules"]]
    exprs.append(yaml.safe_load(ADAPTER.read_text())["rules"]["custom"][0]["seriesQuery"])
    named = set().union(*map(folio_series, exprs))
    assert named - served == set()
    # the dashboard covers what the issue asks of it
    dash = set().union(*map(folio_series, dashboard_queries()))
    for series in ("folio:num_requests_waiting", "folio:num_requests_running",
                   "folio:kv_cache_usage_perc", "folio:kv_cache_waste_perc",
                   "folio:time_to_first_token_seconds_bucket",
                   "folio:inter_token_latency_seconds_bucket", "folio:generation_tokens_total",
                   "folio:num_preemptions_total"):
        assert series in dash


@needs_helm
def test_the_chart_ships_the_same_rules_and_dashboard():
    objects = by_kind(render())
    rules = yaml.safe_load((FILES / "rules.yaml").read_text())
    assert objects["PrometheusRule"]["spec"]["groups"] == rules["groups"]
    config_map = objects["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["folio.json"]) == json.loads(
        (FILES / "grafana-dashboard.json").read_text())
