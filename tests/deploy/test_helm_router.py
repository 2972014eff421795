"""The chart's optional router (router.enabled): vllm-router in front of the
Folio pods, finding them by their labels. Every object validates strictly; the
container's command line is one the router's own parser (the pinned wheel's)
takes, and its discovery selects Folio's pods and not its own."""

import pytest

from tests.deploy.manifests import CHART, helm, needs_helm, render, validate

pytestmark = needs_helm

ROUTER_KINDS = {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}


def router_objects(*sets: str) -> tuple[dict, dict]:
    """({kind: the router's object}, the Folio Deployment)."""
    objects = render("router.enabled=true", *sets)
    for o in objects:
        validate(o)
    mine = {o["kind"]: o for o in objects if o["metadata"]["name"].endswith("-router")}
    folio = next(o for o in objects if o["kind"] == "Deployment" and o not in mine.values())
    return mine, folio


def router_args(deployment: dict):
    pytest.importorskip("vllm_router", reason="the vllm-router wheel (dev extras) parses the "
                                               "command line")
    from vllm_router.launch_router import parse_router_args
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm-router"]
    return container, parse_router_args(container["args"])


def test_no_router_unless_asked():
    assert not [o for o in render() if o["metadata"]["name"].endswith("-router")]


def test_the_router_finds_the_folio_pods_and_not_its_own():
    mine, folio = router_objects()
    assert set(mine) == ROUTER_KINDS
    container, args = router_args(mine["Deployment"])
    assert args.policy == "cache_aware" and args.service_discovery
    assert args.service_discovery_namespace == "ml"
    folio_pod = folio["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery_port == \
        folio["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    selector = args.selector          # the launcher parses key=value pairs
    router_pod = mine["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= folio_pod.items()
    assert not selector.items() <= router_pod.items()
    # the router's Service reaches the router's pods, and the plain Service not them
    assert mine["Service"]["spec"]["selector"].items() <= router_pod.items()
    assert mine["Service"]["spec"]["ports"][0]["targetPort"] in {
        p["name"] for p in container["ports"]}
    # it may watch pods in its namespace, nothing more
    rules = mine["Role"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"],
                      "verbs": ["get", "list", "watch"]}]
    binding = mine["RoleBinding"]
    assert binding["roleRef"]["name"] == mine["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == \
        mine["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
    probes = {container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
    assert probes == {"/liveness", "/readiness"}


def test_policy_ports_key_and_extra_args_reach_the_router():
    mine, _ = router_objects("router.policy=round_robin", "router.port=9000",
                             "router.metricsPort=9100", "apiKey.existingSecret=folio-keys",
                             "router.extraArgs={--cache-threshold,0.5}")
    container, args = router_args(mine["Deployment"])
    assert (args.policy, args.port, args.prometheus_port, args.cache_threshold) == (
        "round_robin", 9000, 9100, 0.5)
    # the replicas' key, from the Secret, which the router sends them
    assert args.api_key == "$(FOLIO_API_KEY)"
    key = next(e for e in container["env"] if e["name"] == "FOLIO_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "folio-keys", "key": "api-key"}


@pytest.mark.parametrize("setting, message", [
    ("router.policy=fastest", 'router.policy must be cache_aware, round_robin, power_of_two, '
                              'consistent_hash or random, not "fastest"'),
    ("router.replicaCount=0", "router.replicaCount must be at least 1"),
    ("router.metricsPort=8080", "router.port and router.metricsPort must differ"),
])
def test_impossible_router_values_fail_the_render_saying_why(setting, message):
    out = helm("template", "x", str(CHART), "--set", "router.enabled=true", "--set", setting,
               check=False)
    assert out.returncode != 0 and message in out.stderr


def test_the_chart_lints_with_the_router():
    out = helm("lint", "--strict", str(CHART), "--set", "router.enabled=true", check=False)
    assert out.returncode == 0, out.stdout + out.stderr
