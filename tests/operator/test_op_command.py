"""`kvpool operator` as a user runs it: a process, a kubeconfig, metrics and liveness ports."""

from __future__ import annotations

import asyncio
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_cluster import Emulator, declare_resources
from op_support import pool_body

from kvpool.bench.local import free_port
from kvpool.operator.kube import Kube

pytestmark = pytest.mark.kmock(cls=Emulator)


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "tester", "user": {}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def test_operator_command_reconciles_and_serves_metrics(kmock: Any, tmp_path: Path) -> None:
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    metrics_port, liveness_port = free_port(), free_port()
    env = {
        "KUBECONFIG": str(_kubeconfig(tmp_path / "kubeconfig", server)),
        "KVPOOL_AGENT_IMAGE": "registry.local/kvpool:dev",
        "PATH": "/usr/bin:/bin",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvpool.operator.cli",
        "operator",
        "--namespace",
        "inference",
        "--webhook-port",
        "0",
        "--metrics-port",
        str(metrics_port),
        "--liveness-port",
        str(liveness_port),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    kube = Kube.for_url(server)
    try:
        await asyncio.to_thread(kube.create, pool_body())

        async def daemon_set() -> dict[str, Any] | None:
            assert proc.returncode is None, "the operator exited"
            return await asyncio.to_thread(
                kube.get, "apps/v1", "DaemonSet", "inference", "kvpool-small"
            )

        deadline = asyncio.get_running_loop().time() + 30
        ds = None
        while ds is None and asyncio.get_running_loop().time() < deadline:
            ds = await daemon_set()
            await asyncio.sleep(0.1)
        assert ds is not None, "no DaemonSet within 30 s"
        image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.local/kvpool:dev"

        async def reconciled() -> str | None:
            text = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics")
            ok = 'kvpool_operator_reconciles_total{kind="KVCachePool",result="success"} 0.0'
            return None if ok in text else text

        text = None
        while text is None and asyncio.get_running_loop().time() < deadline:
            text = await reconciled()
            await asyncio.sleep(0.1)
        assert text is not None, "no successful reconcile counted"
        errors = (
            'kvpool_operator_reconcile_errors_total{kind="KVCachePool",reason="PolicyNotFound"}'
        )
        assert f"{errors} 0.0" in text
        health = await asyncio.to_thread(_get, f"http://127.0.0.1:{liveness_port}/healthz")
        assert health is not None
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail("the operator did not stop on SIGTERM")
    output = (await proc.stdout.read()).decode() if proc.stdout else ""
    assert proc.returncode == 0, output[-3000:]
