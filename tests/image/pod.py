"""Run a container of a rendered pod from the built image, as kubelet would: under runc.

kubelet hands containerd a pod's container, and containerd hands runc an OCI bundle: the
image's root filesystem, its config (env, user, working directory) and the container's
security context turned into the runtime's terms. `oci_config` does that translation for
the fields kvpool's chart and operator set; `run` and `start` are the thin shells that
write the bundle and call runc.

`buildah run` cannot stand in: it has no read-only root filesystem (it writes
/run/.containerenv into the root before starting the command, and fails on a read-only
one), and the chart runs every container with `readOnlyRootFilesystem: true`.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Manifest = dict[str, Any]

# What containerd grants a container before its securityContext drops or adds any
# (containerd's and Docker's default capability set).
DEFAULT_CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
    "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
)


FIELD_REFS = {"spec.nodeName": "node-1", "metadata.namespace": "inference",
              "metadata.name": "kvpool-test-pod"}
"""The `valueFrom.fieldRef` values kubelet would fill in for the test's pod."""


@dataclass(frozen=True)
class ImageConfig:
    """What a runtime takes from the image's config."""

    env: tuple[str, ...]
    user: str
    workdir: str
    entrypoint: tuple[str, ...]
    labels: Mapping[str, str]

    @property
    def path(self) -> list[str]:
        for item in self.env:
            if item.startswith("PATH="):
                return item[len("PATH="):].split(":")
        return []


@dataclass
class Bundle:
    """An OCI bundle's parts that differ between runs."""

    args: list[str]
    volumes: Mapping[str, Path] = field(default_factory=dict)
    """Volume name -> host directory to bind-mount where the container mounts it."""
    field_refs: Mapping[str, str] = field(default_factory=lambda: dict(FIELD_REFS))
    """`valueFrom.fieldRef.fieldPath` -> value (what kubelet fills in)."""


def capabilities(security: Manifest) -> list[str]:
    """The container's capability set: containerd's default, less `drop`, plus `add`."""
    caps = security.get("capabilities", {})
    drop = {c.upper() for c in caps.get("drop", [])}
    kept = [] if "ALL" in drop else [c for c in DEFAULT_CAPABILITIES if c not in drop]
    return [f"CAP_{c}" for c in dict.fromkeys([*kept, *(c.upper() for c in caps.get("add", []))])]


def container_env(
    image: ImageConfig, container: Manifest, field_refs: Mapping[str, str]
) -> list[str]:
    """The image's env, overridden by the container's (values and resolved field refs)."""
    env = dict(item.split("=", 1) for item in image.env)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = field_refs[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return [f"{k}={v}" for k, v in env.items()]


def oci_config(
    rootfs: Path,
    image: ImageConfig,
    pod_security: Manifest,
    container: Manifest,
    bundle: Bundle,
) -> Manifest:
    """The OCI runtime config of one container of a pod (pure)."""
    security = {**pod_security, **container.get("securityContext", {})}
    default_uid, _, default_gid = image.user.partition(":")
    uid = int(security.get("runAsUser", default_uid or 0))
    gid = int(security.get("runAsGroup", default_gid or uid))
    if security.get("runAsNonRoot") and uid == 0:
        raise ValueError(f"{container['name']}: runAsNonRoot with UID 0 (kubelet refuses it)")
    caps = capabilities(security)
    mounts: list[Manifest] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    for mount in container.get("volumeMounts", []):
        source = bundle.volumes[mount["name"]]
        options = ["rbind", "ro" if mount.get("readOnly") else "rw"]
        mounts.append({"destination": mount["mountPath"], "type": "bind",
                       "source": str(source), "options": options})
    return {
        "ociVersion": "1.0.2",
        "root": {"path": str(rootfs), "readonly": bool(security.get("readOnlyRootFilesystem"))},
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": bundle.args,
            "env": container_env(image, container, bundle.field_refs),
            "cwd": container.get("workingDir", image.workdir or "/"),
            "capabilities": {"bounding": caps, "permitted": caps, "effective": caps},
            "noNewPrivileges": security.get("allowPrivilegeEscalation") is False,
        },
        "hostname": "kvpool-image-test",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }


class Container:
    """One container started with runc (`start`), stopped and deleted on `stop`."""

    def __init__(self, config: Manifest, log: Path) -> None:
        self.id = f"kvpool-test-{uuid.uuid4().hex[:12]}"
        self._dir = tempfile.TemporaryDirectory(prefix="kvpool-bundle-")
        self.log_path = log
        Path(self._dir.name, "config.json").write_text(json.dumps(config))
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["runc", "run", "--bundle", self._dir.name, self.id],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            subprocess.run(["runc", "kill", self.id, "KILL"], check=False,
                           capture_output=True)
            self.proc.wait(timeout=60)
        subprocess.run(["runc", "delete", "--force", self.id], check=False, capture_output=True)
        self._dir.cleanup()


def run(config: Manifest, log: Path, timeout: float = 300) -> tuple[int, str]:
    """Run a container to its end: (exit status, its output)."""
    container = Container(config, log)
    try:
        code = container.wait(timeout)
    finally:
        container.stop()
    return code, container.log()
