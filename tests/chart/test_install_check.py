"""docs/install.md's "Check that the install worked": the commands it gives find what the
chart installs, and the output it shows is what those objects look like (names, ready
counts, ports, webhooks), checked against the chart rendered with its defaults."""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from .conftest import CHART, NAMESPACE, REPO, Rendered

INSTALL_MD = REPO / "docs" / "install.md"


def check_section() -> tuple[list[list[str]], list[str]]:
    """The section's commands (as argv lists) and its expected output's lines."""
    text = INSTALL_MD.read_text()
    section = text.split("### Check that the install worked", 1)[1].split("\n#", 1)[0]
    fences = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    commands = next(body for lang, body in fences if lang == "sh")
    output = next(body for lang, body in fences if lang == "text")
    return ([shlex.split(line) for line in commands.splitlines() if line.strip()],
            output.splitlines())


def rows(output: list[str], prefix: str) -> list[list[str]]:
    return [line.split() for line in output if line.startswith(prefix)]


def selects(selector: str, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (p.split("=", 1) for p in selector.split(",")))


def test_the_install_check_matches_what_the_chart_installs(defaults: Rendered) -> None:
    commands, output = check_section()
    crd_names = sorted(yaml.safe_load(p.read_text())["metadata"]["name"]
                       for p in (CHART / "crds").glob("*.yaml"))
    # kubectl get crd NAME NAME: the chart's CRDs, and the output lists them.
    assert commands[0][:3] == ["kubectl", "get", "crd"] and sorted(commands[0][3:]) == crd_names
    assert sorted(r[0] for r in rows(output, "kvcachepools.") + rows(output, "kvtierpolicies.")
                  ) == crd_names

    # kubectl -n NS get deployments,pods,services -l SELECTOR
    get = commands[1]
    assert get[get.index("-n") + 1] == NAMESPACE
    selector = get[get.index("-l") + 1]
    deployment = defaults.one("Deployment")
    services = defaults.of_kind("Service")
    assert selects(selector, deployment["metadata"]["labels"])
    assert selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert all(selects(selector, s["metadata"]["labels"]) for s in services)

    name, replicas = deployment["metadata"]["name"], deployment["spec"]["replicas"]
    [dep_row] = rows(output, "deployment.apps/")
    assert dep_row[:4] == [f"deployment.apps/{name}", f"{replicas}/{replicas}", str(replicas),
                           str(replicas)]
    pod_rows = rows(output, "pod/")
    containers = len(deployment["spec"]["template"]["spec"]["containers"])
    assert len(pod_rows) == replicas
    for row in pod_rows:
        assert re.fullmatch(rf"pod/{name}-[a-z0-9]+-[a-z0-9]{{5}}", row[0]), row
        assert row[1:3] == [f"{containers}/{containers}", "Running"]
    shown = {(r[0], r[1], r[4]) for r in rows(output, "service/")}
    assert shown == {(f"service/{s['metadata']['name']}", s["spec"].get("type", "ClusterIP"),
                      ",".join(f"{p['port']}/{p.get('protocol', 'TCP')}"
                               for p in s["spec"]["ports"])) for s in services}

    # kubectl get mutatingwebhookconfigurations,validatingwebhookconfigurations NAME
    hooks: dict[str, Any] = {
        "mutatingwebhookconfiguration": defaults.one("MutatingWebhookConfiguration"),
        "validatingwebhookconfiguration": defaults.one("ValidatingWebhookConfiguration")}
    assert commands[2][:3] == ["kubectl", "get", ",".join(f"{k}s" for k in hooks)]
    assert {commands[2][3]} == {h["metadata"]["name"] for h in hooks.values()}
    for kind, hook in hooks.items():
        [row] = rows(output, f"{kind}.admissionregistration.k8s.io/")
        assert row[:2] == [f"{kind}.admissionregistration.k8s.io/{hook['metadata']['name']}",
                           str(len(hook["webhooks"]))]


def test_the_notes_say_the_default_image_is_not_published_and_how_to_check(
        defaults: Rendered, render: Any) -> None:
    assert "ghcr.io/kvpool/kvpool:" in defaults.notes and "ErrImagePull" in defaults.notes
    assert "set image.repository" in defaults.notes
    assert "get deployments,pods,services -l app.kubernetes.io/instance=kvpool" \
        in defaults.notes
    own = render({"image": {"repository": "registry.example.com/ml/kvpool"}})
    assert "ErrImagePull" not in own.notes and "get deployments,pods" in own.notes
