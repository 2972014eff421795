"""deploy/helm/folio: it lints, every variant renders, every rendered object
validates strictly against its schema, the container runs a `folio serve`
command line that Folio's own parser takes, and impossible values fail the
render with a message that says why."""

import re

import pytest
import yaml

from folio.cli import build_parser
from tests.deploy.manifests import CHART, by_kind, helm, needs_helm, render, validate

pytestmark = needs_helm

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())

LEDGER_SETS = ("apiKeysFile.existingSecret=folio-tenants", "usageDb.enabled=true",
               "autoscaling.mode=none", "cost.perHour=2.5", "cost.promptTokenWeight=0.5",
               "requestLimits.maxTokensDefault=512", "requestLimits.maxTokensLimit=4096",
               "requestLimits.timeoutSeconds=300")

VARIANTS = {
    "hpa on cpu (the defaults)": ((), {"PodDisruptionBudget", "ConfigMap", "Service", "Deployment",
                                       "HorizontalPodAutoscaler", "PrometheusRule",
                                       "ServiceMonitor"}),
    "keda": (("autoscaling.mode=keda",), {"PodDisruptionBudget", "ConfigMap", "Service",
                                          "Deployment", "ScaledObject", "PrometheusRule",
                                          "ServiceMonitor"}),
    "gpu, tp 2, api key, hostPath": (
        ("accelerator=gpu", "model.tensorParallelSize=2", "apiKey.existingSecret=folio-keys",
         "modelVolume.type=hostPath", "model.quantization=awq", "model.maxModelLen=8192",
         "image.tag=cuda"),
        {"PodDisruptionBudget", "ConfigMap", "Service", "Deployment", "HorizontalPodAutoscaler",
         "PrometheusRule", "ServiceMonitor"}),
    "tenants, usage ledger, cost, request limits": (
        LEDGER_SETS, {"PodDisruptionBudget", "ConfigMap", "Service", "Deployment",
                      "PersistentVolumeClaim", "PrometheusRule", "ServiceMonitor"}),
    "fixed replicas, plain Prometheus": (
        ("autoscaling.mode=none", "replicaCount=3", "metrics.serviceMonitor.enabled=false",
         "metrics.prometheusRule.enabled=false", "metrics.grafanaDashboard.enabled=false",
         "podDisruptionBudget.enabled=false"),
        {"Service", "Deployment"}),
}


def serve_args(deployment: dict):
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "serve"
    return container, build_parser().parse_args(container["args"])


def test_the_chart_lints():
    for sets in ([], ["--set", "autoscaling.mode=keda"], ["--set", "accelerator=gpu"],
                 ["--set", ",".join(LEDGER_SETS)]):
        out = helm("lint", "--strict", str(CHART), *sets, check=False)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates_strictly(variant):
    sets, kinds = VARIANTS[variant]
    objects = render(*sets)
    assert {o["kind"] for o in objects} == kinds
    for o in objects:
        validate(o)


def test_a_misspelt_field_is_caught_by_the_validation():
    objects = by_kind(render("autoscaling.mode=keda"))
    deployment = objects["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpget"] = {}
    with pytest.raises(Exception, match="httpget"):
        validate(deployment)
    scaled = objects["ScaledObject"]
    scaled["spec"]["coolDownPeriod"] = 60
    with pytest.raises(ValueError, match="coolDownPeriod"):
        validate(scaled)
    monitor = objects["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = 15          # a duration is a string
    with pytest.raises(ValueError, match="interval"):
        validate(monitor)


def test_the_container_runs_a_serve_command_that_folio_parses():
    container, args = serve_args(by_kind(render())["Deployment"])
    assert (args.model, args.dtype, args.max_num_seqs, args.port, args.host) == (
        VALUES["model"]["path"], "auto", VALUES["maxNumSeqs"], VALUES["port"], "0.0.0.0")
    assert args.drain_timeout == VALUES["drainTimeoutSeconds"] and args.device == "cpu"
    assert args.tensor_parallel_size == 1 and args.quantization is None
    assert {e["name"] for e in container["env"]} == {"HOME"}       # no API key unless asked

    container, args = serve_args(by_kind(render(*VARIANTS["gpu, tp 2, api key, hostPath"][0]))
                                 ["Deployment"])
    assert (args.tensor_parallel_size, args.quantization, args.max_model_len, args.device) == (
        2, "awq", 8192, "cuda")
    key = next(e for e in container["env"] if e["name"] == "FOLIO_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "folio-keys", "key": "api-key"}


def test_the_pod_drains_before_it_is_killed_and_starts_slowly_without_restarts():
    spec = by_kind(render())["Deployment"]["spec"]
    pod = spec["template"]["spec"]
    container, args = serve_args(by_kind(render())["Deployment"])
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    # SIGTERM comes after preStop; Folio then waits --drain-timeout for its requests
    assert pod["terminationGracePeriodSeconds"] > sleep + args.drain_timeout
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300   # minutes to load
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] is True and args.model.startswith(mount["mountPath"] + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "folio-models", "readOnly": True}


def test_gpus_are_requested_per_tensor_parallel_rank_and_not_on_cpu():
    gpu = by_kind(render("accelerator=gpu", "model.tensorParallelSize=4",
                         "resources.limits.nvidia\\.com/gpu=1"))["Deployment"]
    container = gpu["spec"]["template"]["spec"]["containers"][0]
    res = container["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 4
    assert container["image"] == "folio:cuda"                   # the tag follows the mode
    assert by_kind(render())["Deployment"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == "folio:cpu"
    cpu = by_kind(render())["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(cpu["resources"])
    assert cpu["resources"] == VALUES["resources"]


def test_hpa_and_keda_scale_on_the_same_queue_with_the_same_behaviour():
    hpa = by_kind(render())["HorizontalPodAutoscaler"]["spec"]
    keda = by_kind(render("autoscaling.mode=keda"))["ScaledObject"]["spec"]
    auto = VALUES["autoscaling"]
    target = str(auto["targetWaitingPerReplica"])
    assert hpa["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "folio_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": target}}}]
    trigger, = keda["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == target
    assert trigger["metadata"]["query"] == (
        'sum(folio:num_requests_waiting{namespace="ml",pod=~"llm-folio-[a-z0-9]+-[a-z0-9]+"})')
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (
        keda["minReplicaCount"], keda["maxReplicaCount"]) == (auto["minReplicas"],
                                                              auto["maxReplicas"])
    behaviour = keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert hpa["behavior"] == behaviour
    assert behaviour["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert behaviour["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_the_service_monitor_and_rules_carry_the_labels_prometheus_selects():
    o = by_kind(render("metrics.serviceMonitor.labels.release=kps",
                       "metrics.prometheusRule.labels.release=kps"))
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert o[kind]["metadata"]["labels"]["release"] == "kps"
        validate(o[kind])


def test_scrape_annotations_replace_the_service_monitor_when_it_is_off():
    pod = by_kind(render("metrics.serviceMonitor.enabled=false"))["Deployment"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true",
                                              "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}
    assert "annotations" not in by_kind(render())["Deployment"]["spec"]["template"]["metadata"]


def mounted(pod: dict, container: dict, name: str) -> tuple[dict, dict]:
    """(the volume, its mount in the container) of the volume `name`."""
    volume = next(v for v in pod["volumes"] if v["name"] == name)
    return volume, next(m for m in container["volumeMounts"] if m["name"] == name)


def test_tenants_the_ledger_and_cost_reach_folio_serve():
    o = by_kind(render(*LEDGER_SETS))
    pod = o["Deployment"]["spec"]["template"]["spec"]
    container, args = serve_args(o["Deployment"])
    # --api-keys-file: the Secret's key, projected read-only where the flag points
    volume, mount = mounted(pod, container, "tenants")
    assert volume["secret"] == {"secretName": "folio-tenants",
                                "items": [{"key": "keys.yaml", "path": "keys.yaml"}]}
    assert mount["readOnly"] is True
    assert args.api_keys_file == f"{mount['mountPath']}/keys.yaml"
    # --usage-db: a file on the PersistentVolumeClaim the chart makes, kept on uninstall
    volume, mount = mounted(pod, container, "usage")
    claim = o["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
    assert args.usage_db.startswith(mount["mountPath"] + "/") and not mount.get("readOnly")
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Gi"}}}
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # one pod writes the ledger: an upgrade ends the old pod before the new one opens it
    assert o["Deployment"]["spec"]["strategy"] == {"type": "Recreate"}
    assert o["Deployment"]["spec"]["replicas"] == 1
    assert (args.cost_per_hour, args.prompt_token_weight) == (2.5, 0.5)
    assert (args.max_tokens_default, args.max_tokens_limit, args.request_timeout) == (
        512, 4096, 300.0)


def test_without_those_values_none_of_their_flags_volumes_or_claim_render():
    o = by_kind(render())
    container, args = serve_args(o["Deployment"])
    assert (args.api_keys_file, args.usage_db, args.cost_per_hour) == (None, None, None)
    assert (args.max_tokens_default, args.max_tokens_limit, args.request_timeout) == (
        None, None, None)
    assert "PersistentVolumeClaim" not in o
    assert {m["name"] for m in container["volumeMounts"]} == {"models", "tmp"}
    assert o["Deployment"]["spec"]["strategy"]["type"] == "RollingUpdate"


def test_the_ledger_can_live_on_an_existing_claim():
    o = by_kind(render("usageDb.enabled=true", "autoscaling.mode=none",
                       "usageDb.existingClaim=ledger", "usageDb.storageClassName=fast"))
    assert "PersistentVolumeClaim" not in o
    pod = o["Deployment"]["spec"]["template"]["spec"]
    volume, _ = mounted(pod, pod["containers"][0], "usage")
    assert volume["persistentVolumeClaim"] == {"claimName": "ledger"}
    made = by_kind(render("usageDb.enabled=true", "autoscaling.mode=none",
                          "usageDb.storageClassName=fast", "usageDb.size=20Gi"))
    claim = made["PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    validate(claim)


@pytest.mark.parametrize("setting, message", [
    ("autoscaling.minReplicas=0", "cannot scale from zero"),
    ("autoscaling.mode=cpu", "autoscaling.mode must be hpa, keda or none"),
    ("accelerator=tpu", "accelerator must be cpu or gpu"),
    ("modelVolume.type=nfs", "modelVolume.type must be pvc or hostPath"),
    ("autoscaling.maxReplicas=0", "maxReplicas must be at least"),
    ("usageDb.enabled=true", "usageDb.enabled needs one replica (autoscaling.mode none, "
                             "replicaCount 1)"),
    ("usageDb.enabled=true,autoscaling.mode=none,replicaCount=2", "usageDb.enabled needs one "
                                                                  "replica"),
    ("cost.perHour=-1", "cost.perHour must be 0 (not set) or more"),
])
def test_impossible_values_fail_the_render_saying_why(setting, message):
    out = helm("template", "x", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0 and message in out.stderr


@pytest.mark.parametrize("variant", ["hpa on cpu (the defaults)", "keda"])
def test_the_objects_point_at_each_other(variant):
    o = by_kind(render(*VARIANTS[variant][0]))
    deployment, service = o["Deployment"], o["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert o["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = o["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= port_names
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    scaler = o.get("HorizontalPodAutoscaler") or o["ScaledObject"]
    assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # the KEDA query's pod pattern takes the Deployment's pods (NAME-<hash>-<id>), and
    # not those of a release NAME-canary (PromQL anchors a regex at both ends)
    if "ScaledObject" in o:
        pattern = re.search(r'pod=~"([^"]+)"', scaler["spec"]["triggers"][0]["metadata"]
                            ["query"])[1]
        name = deployment["metadata"]["name"]
        assert re.fullmatch(pattern, f"{name}-5d8c9b7f4-x2x9q")
        assert not re.fullmatch(pattern, f"{name}-canary-5d8c9b7f4-x2x9q")
    assert "replicas" not in deployment["spec"]         # the autoscaler owns the count
