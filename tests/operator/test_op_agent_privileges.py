"""Least privilege of the agent pods: not root, only IPC_LOCK, read-only root filesystem.

The render is checked as data; the init container's program (`kvpool.operator.hostdirs`)
runs as a real process on real directories.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.agent.config import AgentConfig
from kvpool.operator import api, hostdirs, render
from kvpool.operator.operator_policy import OperatorPolicy

K8S_VERSION = "1.33.0"


ROOT_ALLOWED = render.Settings(policy=OperatorPolicy(allow_root=True))
"""Settings of a cluster whose admin lets pools run their agent as root."""


def _objects(
    body: dict[str, Any], settings: render.Settings | None = None
) -> dict[str, dict[str, Any]]:
    objects = render.render(api.parse_pool(body), None, settings)
    for obj in objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {o["kind"]: o for o in objects}


def _pod(body: dict[str, Any], settings: render.Settings | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = _objects(body, settings)["DaemonSet"]["spec"]["template"]["spec"]
    return pod


def _full_with_file_store(pool_full: dict[str, Any]) -> dict[str, Any]:
    """The full example (DRAM + NVMe) with a file:// shared tier: every kind of mount."""
    body = copy.deepcopy(pool_full)
    body["spec"]["tiers"]["shared"] = {"url": "file:///mnt/lustre/kv"}
    return body


def test_agent_runs_as_non_root_with_only_ipc_lock(pool_full: dict[str, Any]) -> None:
    pod = _pod(pool_full)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == api.AGENT_UID != 0
    assert pod["securityContext"]["runAsGroup"] == api.AGENT_UID
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (agent,) = pod["containers"]
    assert agent["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert key not in pod
    assert "privileged" not in agent["securityContext"]


@pytest.mark.parametrize("huge_pages", [False, True], ids=["tmpfs", "huge-pages"])
def test_every_path_the_agent_writes_is_a_writable_mount(
    pool_full: dict[str, Any], huge_pages: bool
) -> None:
    """With a read-only root filesystem, each file the agent creates must be on a mount;
    and with the arena on hugetlbfs, which takes no write(2), the files written beside it
    (journal, lock, store record) are on another mount."""
    body = _full_with_file_store(pool_full)
    body["spec"]["tiers"]["dram"]["hugePages"] = huge_pages
    objects = _objects(body)
    cfg = AgentConfig.model_validate(yaml.safe_load(objects["ConfigMap"]["data"]["agent.yaml"]))
    (agent,) = objects["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    writable = [
        PurePosixPath(m["mountPath"]) for m in agent["volumeMounts"] if not m.get("readOnly")
    ]
    assert cfg.tiers.nvme is not None and cfg.tiers.shared is not None
    assert cfg.tiers.dram.huge_pages is huge_pages
    written = {
        "socket": PurePosixPath(cfg.socket_path).parent,
        "arena": PurePosixPath(cfg.arena_path()).parent,
        "journal": PurePosixPath(cfg.journal_path()).parent,
        "lock": PurePosixPath(cfg.lock_path()).parent,
        "store record": PurePosixPath(cfg.stores_path()).parent,
        "nvme": PurePosixPath(cfg.tiers.nvme.path),
        "state": PurePosixPath(str(cfg.state_dir)),
        "shared": PurePosixPath("/mnt/lustre/kv"),
        "temporary files": PurePosixPath("/tmp"),
    }
    for what, path in written.items():
        assert any(path == m or m in path.parents for m in writable), f"{what}: {path}"
    beside_arena = {written["journal"], written["lock"], written["store record"]}
    assert (written["arena"] in beside_arena) is not huge_pages
    read_only = [m["mountPath"] for m in agent["volumeMounts"] if m.get("readOnly")]
    # The config, and the pool's peer secret (the full example runs the peer tier).
    assert read_only == ["/etc/kvpool", "/etc/kvpool-peers"]


def test_init_container_hands_the_host_dirs_to_the_agent_and_nothing_more(
    pool_full: dict[str, Any],
) -> None:
    pod = _pod(_full_with_file_store(pool_full))
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    assert init["image"] == agent["image"]
    assert init["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_READ_SEARCH"]},
    }
    by_name = {m["name"]: m for m in agent["volumeMounts"]}
    # The pool's own host directories, at the agent's paths; not the config, not the
    # shared file system (spans nodes, often squashes root: the user's to prepare).
    assert init["volumeMounts"] == [
        by_name["socket"], by_name["dram"], by_name["nvme"], by_name["state"]
    ]
    uid = api.AGENT_UID
    assert init["command"] == [
        "python3",
        "-m",
        "kvpool.operator.hostdirs",
        f"--owner={uid}:{uid}",
        *(m["mountPath"] for m in init["volumeMounts"]),
    ]


def test_run_as_user_zero_is_a_root_agent_without_init_container(
    pool_minimal: dict[str, Any],
) -> None:
    body = copy.deepcopy(pool_minimal)
    body["spec"]["agent"] = {"runAsUser": 0}
    pod = _pod(body, ROOT_ALLOWED)
    assert pod["securityContext"]["runAsNonRoot"] is False
    assert pod["securityContext"]["runAsUser"] == 0
    assert "initContainers" not in pod
    assert pod["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["IPC_LOCK"],
    }


def test_another_uid_owns_its_host_dirs(pool_minimal: dict[str, Any]) -> None:
    body = copy.deepcopy(pool_minimal)
    body["spec"]["agent"] = {"runAsUser": 1000}
    pod = _pod(body)
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 1000
    assert "--owner=1000:1000" in pod["initContainers"][0]["command"]


def test_gc_job_runs_as_non_root_without_capabilities(pool_full: dict[str, Any]) -> None:
    job = render.render_gc_job(api.parse_pool(pool_full))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    spec = job["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    (gc,) = spec["containers"]
    assert gc["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


# ----------------------------------------------------------------------------- hostdirs


@pytest.mark.parametrize(
    ("text", "owner"),
    [("65532:65532", (65532, 65532)), ("1000", (1000, 1000)), ("0:5", (0, 5))],
)
def test_owner_parses(text: str, owner: tuple[int, int]) -> None:
    assert hostdirs.parse_owner(text) == owner


@pytest.mark.parametrize("text", ["", "root", "1:x", "-1:2", "1:-2"])
def test_bad_owner_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="owner"):
        hostdirs.parse_owner(text)


def _run_hostdirs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.operator.hostdirs", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hostdirs_leaves_a_directory_the_agent_owns_alone(tmp_path: Path) -> None:
    """The steady state (every restart): the top directory is the agent's, nothing walks."""
    uid, gid = os.getuid(), os.getgid()
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "chunk").write_bytes(b"x")
    result = _run_hostdirs(f"--owner={uid}:{gid}", str(tmp_path / "nvme"), str(tmp_path / "new"))
    assert result.returncode == 0, result.stderr
    assert "nvme: owner" in result.stdout and "(0 entries changed)" in result.stdout
    assert (tmp_path / "new").is_dir()  # a missing directory is created


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root, as in the pod")
def test_hostdirs_hands_a_root_owned_tree_to_the_agent(tmp_path: Path) -> None:
    """What the init container does on a new node, or after a root agent: the whole tree
    changes owner, symbolic links themselves and not their targets."""
    top = tmp_path / "dram"
    (top / "sub").mkdir(parents=True)
    (top / "arena").write_bytes(b"a")
    (top / "sub" / "journal").write_bytes(b"j")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o")
    (top / "link").symlink_to(outside)
    for path in (top, top / "sub", top / "arena", top / "sub" / "journal", outside):
        os.chown(path, 0, 0)
    os.lchown(top / "link", 0, 0)

    result = _run_hostdirs("--owner=65532:65532", str(top))
    assert result.returncode == 0, result.stderr
    assert "(5 entries changed)" in result.stdout
    for path in (top, top / "sub", top / "arena", top / "sub" / "journal", top / "link"):
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (65532, 65532), path
    assert outside.stat().st_uid == 0  # the link's target is not handed over

    again = _run_hostdirs("--owner=65532:65532", str(top))
    assert "(0 entries changed)" in again.stdout


@pytest.mark.parametrize(("args", "what"), [
    ((), "required: DIR"), (("/tmp/x",), "--owner is required"),
    (("--owner=root", "/tmp/x"), "owner 'root' is not UID[:GID]")])
def test_a_hostdirs_usage_error_is_one_line_saying_what_is_wrong(
        args: tuple[str, ...], what: str) -> None:
    result = _run_hostdirs(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvpool hostdirs: ")
    assert what in result.stderr and "(usage: python3 -m kvpool.operator.hostdirs" in \
        result.stderr, result.stderr


def test_hostdirs_fails_with_the_directory_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    result = _run_hostdirs(f"--owner={os.getuid()}", str(blocker / "below"))
    assert result.returncode == 1
    assert str(blocker / "below") in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root, as in the pod")
def test_hostdirs_removes_a_deleted_pools_directories_with_only_its_two_capabilities(
        tmp_path: Path) -> None:
    """The reclaim DaemonSet's init container (`nodeReclaimPolicy: Delete`), run as it runs
    there: root with CHOWN and DAC_READ_SEARCH only (no DAC_OVERRIDE, so the agent-owned
    tree must be given back to root before it can be deleted). The pool's directories go,
    a symbolic link's target and the next pool's directory stay, a missing one is fine."""
    state, nvme = tmp_path / "state", tmp_path / "nvme"
    pool, other = state / "inference.llama", state / "inference.other"
    for d in (pool / "tenants" / "a", other, nvme):
        d.mkdir(parents=True)
    (pool / "shared-stores.json").write_bytes(b"{}")
    (pool / "tenants" / "a" / "shared-stores.json").write_bytes(b"{}")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o")
    (pool / "link").symlink_to(outside)
    for path in (pool, pool / "tenants", pool / "tenants" / "a", pool / "shared-stores.json",
                 pool / "tenants" / "a" / "shared-stores.json"):
        os.lchown(path, 65532, 65532)
    os.chmod(pool / "tenants" / "a", 0o500)  # not even its owner may write in it

    result = subprocess.run(
        ["setpriv", "--bounding-set=-all,+chown,+dac_read_search", "--inh-caps=-all", "--",
         sys.executable, "-m", "kvpool.operator.hostdirs", "--remove", str(pool),
         str(nvme / "inference.llama")],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "removed (6 entries)" in result.stdout
    assert not pool.exists() and not (nvme / "inference.llama").exists()
    assert other.is_dir() and outside.read_bytes() == b"o"


def test_hostdirs_refuses_to_remove_a_top_level_directory(tmp_path: Path) -> None:
    result = _run_hostdirs("--remove", "/mnt")
    assert result.returncode == 1 and "not a pool's directory" in result.stderr
