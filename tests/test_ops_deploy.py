"""deploy/ says what an operator needs and its numbers add up: the Kubernetes sidecar keeps the
control socket on loopback and its memory, store and cap consistent; the PodMonitor carries
the label kube-prometheus-stack selects on; the systemd unit's user and install path are
documented where the unit is installed."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvswap.daemon.cli import BYTES
from kvswap.daemon.config import Config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes" / "api-server-with-kvswapd.yaml"
PODMONITOR = ROOT / "deploy" / "kubernetes" / "podmonitor.yaml"
UNIT = ROOT / "deploy" / "systemd" / "kvswapd@.service"
DEPLOY_MD = ROOT / "docs" / "deploy.md"

#: What the interpreter, libraries and a CUDA context take beside the configured buffers.
RUNTIME_BYTES = 3 << 29  # 1.5 GiB


def quantity(value: str) -> int:
    """A Kubernetes memory quantity in bytes: ``24Gi`` -> 24 * 2**30."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(value))
    assert match, value
    return int(match.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[match.group(2)]


def pod() -> tuple[dict, dict, dict]:
    docs = {d["kind"]: d for d in yaml.safe_load_all(K8S.read_text())}
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "kvswapd")
    server = next(c for c in spec["containers"] if c["name"] == "api-server")
    return spec, sidecar, server


def test_the_sidecar_keeps_the_control_socket_on_loopback() -> None:
    _, sidecar, _ = pod()
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["KVSWAP_HOST"] == "127.0.0.1" and env["KVSWAP_METRICS_HOST"] == "0.0.0.0"
    config = Config(host=env["KVSWAP_HOST"], metrics_host=env["KVSWAP_METRICS_HOST"],
                    cache_queue_port=int(env["KVSWAP_CACHE_QUEUE_PORT"]), metrics_port=int(env["KVSWAP_METRICS_PORT"]))
    config.validate()
    assert config.metrics_bind_host == "0.0.0.0" and config.host == "127.0.0.1"


def test_memory_store_and_cap_add_up() -> None:
    spec, sidecar, server = pod()
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    size = lambda name: BYTES.convert(env[name], None, None)  # noqa: E731  (the daemon's own parser)
    buffers = size("KVSWAP_WRITE_STAGING_BYTES") + size("KVSWAP_READ_STAGING_BYTES") + size("KVSWAP_HOST_TIER_BYTES")
    for container in (sidecar, server):
        resources = container["resources"]
        assert quantity(resources["requests"]["memory"]) == quantity(resources["limits"]["memory"]), container["name"]
    assert quantity(sidecar["resources"]["limits"]["memory"]) >= buffers + RUNTIME_BYTES
    assert "cpu" not in sidecar["resources"]["limits"]  # throttling would stall the receive loop

    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = quantity(volumes["dshm"]["emptyDir"]["sizeLimit"])
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert quantity(server["resources"]["limits"]["memory"]) > shm  # tmpfs pages are the writer's memory

    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    store = volumes[mounts[env["KVSWAP_STORAGE_DIR"]]]["emptyDir"]
    assert size("KVSWAP_STORAGE_MAX_BYTES") <= 0.95 * quantity(store["sizeLimit"])
    assert size("KVSWAP_STORAGE_MIN_FREE_BYTES") > 0  # old namespaces sit outside the per-namespace cap


def test_the_example_says_first_that_a_gpu_engine_needs_the_gpu_in_the_sidecar() -> None:
    header = K8S.read_text().split("\napiVersion:", 1)[0].splitlines()[:10]
    text = " ".join(header)
    assert "GPU" in text and "CUDA IPC" in text and "kvswap launch" in text


def test_podmonitor_carries_the_release_label() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "release" in PODMONITOR.read_text().split("apiVersion:")[0]  # and says why


def test_systemd_user_and_install_path_are_documented() -> None:
    unit = UNIT.read_text()
    user = re.search(r"^User=(\S+)$", unit, re.M).group(1)
    exec_start = re.search(r"^ExecStart=(\S+)$", unit, re.M).group(1)
    doc = DEPLOY_MD.read_text()
    for text in (doc, unit):
        assert re.search(rf"useradd --system .*\b{user}$", text, re.M), "the unit's user is never created"
    assert "pip install kvswap" in doc and exec_start in doc
    assert re.search(r"^\s*ExecStart=\n\s*ExecStart=/opt/kvswap/venv/bin/kvswapd$", doc, re.M)  # a venv's drop-in
    assert "ProtectHome=read-only" in doc and "203/EXEC" in doc
