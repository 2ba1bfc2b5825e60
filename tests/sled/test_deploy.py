"""deploy/: the Kubernetes manifests against the Kubernetes schema (kubernetes-validate, strict), the settings they
carry against SLED's own config loaders, their probes and grace period against what the server does, and the Grafana
dashboard's queries against the metrics a server exports."""

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from edge_client.config import load_edge_config
from verify_server.config import load_config
from verify_server.metrics import Metrics
from verify_server.server import SERVICE

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are for (native gRPC probes are GA from 1.27)


def documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest():
    broken = find("StatefulSet", "sled-verify")
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = find("Service", "sled-verify")
    broken["spec"]["clusterIp"] = "None"  # a misspelt field: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_servers_settings_load_and_the_pods_fit_them(tmp_path):
    text = find("ConfigMap", "sled-verify-config")["data"]["server.yaml"]
    settings = yaml.safe_load(text)
    tokens = tmp_path / "devices.tokens"
    tokens.write_text("device-1:" + "0" * 64 + "\n")
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({**settings, "auth_tokens_file": str(tokens)}))
    config = load_config(path)
    pod = find("StatefulSet", "sled-verify")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    for probe in ("startupProbe", "readinessProbe"):  # ready only once warm, and not while draining
        assert container[probe]["grpc"] == {"port": config.port, "service": SERVICE}
    assert container["livenessProbe"]["grpc"]["port"] == config.port
    assert pod["terminationGracePeriodSeconds"] > config.drain_s  # the drain ends before the kubelet's SIGKILL
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1" and config.device == "cuda"
    service = find("Service", "sled-verify")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS gives devices every server
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    budget = find("PodDisruptionBudget", "sled-verify")
    assert budget["spec"]["selector"] == find("StatefulSet", "sled-verify")["spec"]["selector"]


def test_the_example_device_points_at_the_services_dns_name(tmp_path):
    settings = yaml.safe_load(find("ConfigMap", "sled-device-config")["data"]["device.yaml"])
    token = tmp_path / "token"
    token.write_text("device-secret\n")
    path = tmp_path / "device.yaml"
    path.write_text(yaml.safe_dump({**settings, "auth_token_file": str(token)}))
    config = load_edge_config(path)
    service = find("Service", "sled-verify")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert config.server == f"dns:///{service['metadata']['name']}.{service['metadata']['namespace']}" \
                            f".svc.cluster.local:{port}"


def test_the_dashboard_reads_only_metrics_a_server_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "sled-verify-fleet.json").read_text())
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {family.name + suffix for family in Metrics().registry.collect() for suffix in suffixes[family.type]}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bsled_[a-z_]+", e)}
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for subject in ("sessions", "free", "acceptance", "step time", "queue wait", "tokens"):
        assert subject in titles
