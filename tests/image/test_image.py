"""The built image runs what the chart and the operator deploy, as they deploy it.

Every container runs under runc with the security context the chart or the operator renders
for it (user, read-only root filesystem, capabilities, no privilege escalation) and its
volumes bind-mounted from the host, as kubelet would run it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.operator import api, render
from tests.chart.conftest import ALL_TOGGLES_ON, CHART, NAMESPACE, RELEASE, Rendered

from .conftest import BuiltImage
from .pod import Bundle, Container, Manifest, oci_config, run

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
AGENT_UID = 65532
CAP_IPC_LOCK = 14
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "ld")


def _pool(**tiers: Any) -> api.KVCachePool:
    return api.parse_pool({
        "apiVersion": api.API_VERSION, "kind": "KVCachePool",
        "metadata": {"name": "image-test", "namespace": "inference", "uid": "0123456789"},
        "spec": {"tiers": {"dram": {"size": "64Mi", "locked": True}, **tiers}},
    })


def _pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = workload["spec"]["template"]["spec"]
    return spec


def _containers(pod: Manifest) -> list[Manifest]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.fixture(scope="module")
def chart_render() -> Rendered:
    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render(ALL_TOGGLES_ON, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return Rendered(files)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "container.log"


def _resolve(rootfs: Path, path: str) -> Path:
    """`path` inside the image, symbolic links followed inside the image (bounded)."""
    current = path
    for _ in range(40):
        host = rootfs / current.lstrip("/")
        if not host.is_symlink():
            return host
        target = os.readlink(host)
        current = target if target.startswith("/") else str(Path(current).parent / target)
    raise AssertionError(f"{path}: too many symbolic links in the image")


def _which(image: BuiltImage, name: str) -> Path | None:
    """Where the image's PATH finds `name` (None: nowhere), like the runtime's exec."""
    candidates = [name] if name.startswith("/") else [f"{d}/{name}" for d in image.config.path]
    for candidate in candidates:
        host = _resolve(image.rootfs, candidate)
        if host.is_file() and host.stat().st_mode & stat.S_IXUSR:
            return host
    return None


def _help_argv(argv: list[str]) -> list[str]:
    """The command up to its first `--` option, asking for help: `kvpool agent --help`,
    `python3 -m kvpool.operator.hostdirs --help`."""
    head: list[str] = []
    for arg in argv:
        if arg.startswith("--"):
            break
        head.append(arg)
    return [*head, "--help"]


# ----------------------------------------------------------------------- the image itself


def test_image_runs_kvpool_as_the_chart_user_by_default(image: BuiltImage) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert image.config.entrypoint == ("kvpool",)
    assert image.config.user == f"{AGENT_UID}:{AGENT_UID}"
    assert values["operator"]["podSecurityContext"]["runAsUser"] == AGENT_UID
    assert _pool().spec.agent.run_as_user == AGENT_UID


def test_oci_labels_name_source_version_and_licence(image: BuiltImage) -> None:
    labels = image.config.labels
    assert labels["org.opencontainers.image.version"] == PROJECT["version"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]["text"]
    assert labels["org.opencontainers.image.source"].startswith("https://github.com/")


def test_final_image_holds_no_compiler_pip_or_cache(image: BuiltImage) -> None:
    assert [c for c in COMPILERS if _which(image, c)] == []
    venv = image.rootfs / "opt" / "kvpool"
    assert (venv / "bin" / "kvpool").is_file()
    assert not list((venv / "lib").glob("python3*/site-packages/pip"))
    caches = [p for p in ("root/.cache", "tmp/.cache", "wheels", "src")
              if (image.rootfs / p).exists()]
    assert caches == []


def test_entry_point_prints_the_package_version(
    image: BuiltImage, chart_render: Rendered, log: Path
) -> None:
    pod = _pod_spec(chart_render.one("Deployment"))
    container = {**pod["containers"][0], "volumeMounts": []}
    config = oci_config(image.rootfs, image.config, pod["securityContext"], container,
                        Bundle([*image.config.entrypoint, "--version"]))
    code, out = run(config, log)
    assert code == 0, out
    assert PROJECT["version"] in out


# ----------------------------------------------------------------------- the operator


def test_operator_entry_point_starts_and_prints_its_help(
    image: BuiltImage, chart_render: Rendered, tmp_path: Path, log: Path
) -> None:
    deployment = chart_render.one("Deployment")
    pod = _pod_spec(deployment)
    container = pod["containers"][0]
    volumes = {m["name"]: Path(tempfile.mkdtemp(dir=tmp_path)) for m in container["volumeMounts"]}
    argv = [*container["command"], *container["args"]]
    config = oci_config(image.rootfs, image.config, pod["securityContext"], container,
                        Bundle(_help_argv(argv), volumes))
    assert config["root"]["readonly"] is True
    code, out = run(config, log)
    assert code == 0, out
    for flag in (a.split("=")[0] for a in container["args"] if a.startswith("--")):
        assert flag in out, f"the chart passes {flag}, which `kvpool operator` does not take"


# ----------------------------------------------------------------------- every command


def _all_containers(chart_render: Rendered) -> list[tuple[str, Manifest, Manifest]]:
    """(where, pod spec, container) of everything the chart and the operator run."""
    found = []
    for obj in chart_render.objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            pod = _pod_spec(obj)
            found += [(f"chart {obj['kind']}", pod, c) for c in _containers(pod)]
    pool = _pool(nvme={"hostPath": "/mnt/nvme", "size": "1Gi"},
                 shared={"url": "s3://bucket/prefix", "reclaimPolicy": "Delete"})
    for obj in [*render.render(pool, None), render.render_gc_job(pool)]:
        if obj["kind"] in ("DaemonSet", "Job"):
            pod = _pod_spec(obj)
            found += [(f"operator {obj['kind']}", pod, c) for c in _containers(pod)]
    return found


def test_every_command_the_chart_and_operator_run_exists_in_the_image(
    image: BuiltImage, chart_render: Rendered, tmp_path: Path
) -> None:
    containers = _all_containers(chart_render)
    names = {c["name"] for _, _, c in containers}
    assert {"operator", "agent", "host-dirs"} <= names, names
    for where, pod, container in containers:
        argv = [*container.get("command", image.config.entrypoint), *container.get("args", [])]
        assert _which(image, argv[0]), f"{where} {container['name']}: {argv[0]} not in the image"
        volumes = {m["name"]: Path(tempfile.mkdtemp(dir=tmp_path))
                   for m in container.get("volumeMounts", [])}
        config = oci_config(image.rootfs, image.config, pod.get("securityContext", {}),
                            container, Bundle(_help_argv(argv), volumes))
        code, out = run(config, tmp_path / f"{container['name']}.log")
        assert code == 0, f"{where} {container['name']}: {_help_argv(argv)} failed:\n{out}"


# ----------------------------------------------------------------------- the agent


@pytest.fixture
def agent_pod(tmp_path: Path) -> Iterator[tuple[Manifest, dict[str, Path]]]:
    """The operator's DaemonSet pod for a pool, and its volumes on this host: the arena
    directory on /dev/shm (a tmpfs, like the node's), the socket and state directories
    owned by root (as kubelet creates a hostPath), the ConfigMap's files."""
    pool = _pool()
    objects = render.render(pool, None)
    daemon_set = next(o for o in objects if o["kind"] == "DaemonSet")
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for name, text in config_map["data"].items():
        (config_dir / name).write_text(text)
    dram = Path(tempfile.mkdtemp(prefix="kvpool-image-test-", dir="/dev/shm"))
    volumes = {"config": config_dir, "socket": tmp_path / "socket", "dram": dram,
               "tmp": tmp_path / "tmp", "state": tmp_path / "state"}
    volumes["socket"].mkdir(mode=0o755)
    volumes["state"].mkdir(mode=0o755)
    volumes["tmp"].mkdir(mode=0o1777)
    try:
        yield _pod_spec(daemon_set), volumes
    finally:
        subprocess.run(["rm", "-rf", str(dram)], check=False)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _runc_pid(container_id: str) -> int:
    out = subprocess.run(["runc", "state", container_id], check=True, capture_output=True,
                         text=True).stdout
    return int(json.loads(out)["pid"])


def test_agent_serves_a_host_client_as_non_root_under_the_chart_security_context(
    image: BuiltImage, agent_pod: tuple[Manifest, dict[str, Path]], tmp_path: Path
) -> None:
    pod, volumes = agent_pod
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    security = pod["securityContext"]

    # The init container hands the root-owned host directories to the agent's UID.
    code, out = run(oci_config(image.rootfs, image.config, security, init,
                               Bundle(init["command"], volumes)), tmp_path / "init.log")
    assert code == 0, out
    assert volumes["socket"].stat().st_uid == AGENT_UID
    assert volumes["state"].stat().st_uid == AGENT_UID

    config = oci_config(image.rootfs, image.config, security, agent,
                        Bundle(agent["command"], volumes))
    assert config["root"]["readonly"] is True
    assert config["process"]["capabilities"]["bounding"] == ["CAP_IPC_LOCK"]
    socket_mount = next(m["mountPath"] for m in agent["volumeMounts"] if m["name"] == "socket")
    host_socket = volumes["socket"] / "agent.sock"
    assert str(render.socket_path(_pool())) == f"{socket_mount}/agent.sock"

    container = Container(config, tmp_path / "agent.log")
    try:
        deadline = time.monotonic() + 120  # hang guard: a loaded machine starts it slowly
        while not _answers(host_socket):
            assert container.proc.poll() is None, f"agent exited:\n{container.log()}"
            assert time.monotonic() < deadline, f"agent did not start:\n{container.log()}"
            time.sleep(0.1)

        status = _status(_runc_pid(container.id))
        assert status["Uid"].split()[:2] == [str(AGENT_UID)] * 2
        assert int(status["CapBnd"], 16) == 1 << CAP_IPC_LOCK
        assert status["NoNewPrivs"] == "1"
        assert host_socket.stat().st_uid == AGENT_UID
        arena = volumes["dram"] / "arena"
        assert arena.stat().st_uid == AGENT_UID

        key, chunk = os.urandom(16), os.urandom(256 << 10)
        with KVPoolClient(host_socket, reconnect_timeout=0) as client:
            assert client.put(key, chunk) is True
            assert client.get(key) == chunk
            assert client.stats()["pool"] == api.pool_id("inference", "image-test")
    finally:
        container.stop()
    assert "Read-only file system" not in container.log()
