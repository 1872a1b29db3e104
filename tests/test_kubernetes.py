"""deploy/kubernetes/: every manifest is valid against the Kubernetes schemas (kubernetes-validate,
which carries them, strict: an unknown field fails too), the kustomization names them all, the
Secret's items are the files `stepbus keys` makes, every command the containers run is a
stepbus command with flags it has, and the liveness probes answer as they should against a
real controller: 0 while the process they ask about is alive, non-zero otherwise.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import REPO, Cluster, wait_for
from controller_probe import status_rows
from test_readme import command_flags

from stepbus.bus import wiring

K8S = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests promise to fit


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> Iterator[dict[str, Any]]:
    for path in manifests():
        yield from (doc for doc in yaml.safe_load_all(path.read_text()) if doc)


def containers() -> Iterator[dict[str, Any]]:
    for doc in documents():
        if doc["kind"] == "Deployment":
            yield from doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_kustomization_names_every_manifest_and_the_dockerfile_exists() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifests())
    assert {c["image"] for c in containers()} == {i["name"] for i in kustomization["images"]}
    dockerfile = (K8S / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["stepbus"]' in dockerfile
    for folder in ("bus", "workers", "processor", "trainer", "stepbus"):
        assert f"COPY {folder} {folder}" in dockerfile


def test_workers_scale_as_a_deployment_behind_the_central_service() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in documents()}
    service = kinds[("Service", "stepbus")]
    central = kinds[("Deployment", "stepbus-central")]
    assert central["spec"]["replicas"] == 1 and central["spec"]["strategy"]["type"] == "Recreate"
    assert service["spec"]["selector"] == central["spec"]["template"]["metadata"]["labels"]
    assert {p["port"] for p in service["spec"]["ports"]} == {7340, 7341, 7342}
    worker = kinds[("Deployment", "stepbus-worker")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
    assert env["STEPBUS_CONTROLLER"] == "tcp://stepbus:7340"
    for spec in (central["spec"]["template"]["spec"], worker):
        for container in spec["containers"]:
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert "livenessProbe" in container


def test_the_keys_secret_holds_what_stepbus_keys_makes_and_is_never_world_readable(
        tmp_path: Path) -> None:
    wiring.make_keys(str(tmp_path / "keys"))
    made = {str(p.relative_to(tmp_path / "keys")) for p in (tmp_path / "keys").rglob("*.key*")}
    for doc in documents():
        if doc["kind"] != "Deployment":
            continue
        for volume in doc["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] == "stepbus-keys"
                assert volume["secret"]["defaultMode"] & 0o007 == 0
                paths = {item["path"] for item in volume["secret"]["items"]}
                assert paths <= made, paths - made
                assert {"client.key", "client.key_secret", "server.key"} <= paths


def stepbus_commands() -> Iterator[list[str]]:
    """Every stepbus command line a container or probe runs, split as sh would."""
    for container in containers():
        line = [*container.get("command", []), *container.get("args", [])]
        probe = container["livenessProbe"]["exec"]["command"]
        for words in (line, probe):
            if words[:2] == ["sh", "-c"]:
                words = shlex.split(words[2])
                words = words[:words.index("|")] if "|" in words else words
            elif words and words[0] != "stepbus":
                words = ["stepbus", *words]  # args of the image's ENTRYPOINT
            yield [w for w in words if w != "exec"]


def test_every_command_the_containers_run_is_a_stepbus_command_with_its_own_flags() -> None:
    flags = command_flags()
    seen = set()
    for words in stepbus_commands():
        assert words[0] == "stepbus", words
        seen.add(words[1])
        unknown = [w for w in words[2:] if w.startswith("--") and w not in flags[words[1]]]
        assert unknown == [], words
    assert seen == {"controller", "broker", "assembler", "trainer", "worker", "status"}


def probe(container: str) -> list[str]:
    found = [c["livenessProbe"]["exec"]["command"] for c in containers()
             if c["name"] == container]
    assert len(found) == 1
    return found[0]


def test_the_liveness_probes_ask_the_controller_about_their_own_process(
        cluster: Cluster) -> None:
    cluster.start("controller")
    cluster.start("worker", "--name", "stepbus-worker-abc12")
    wait_for(lambda: any(r["role"] == "worker" for r in status_rows(cluster)), 20,
             "the worker to register")
    env = cluster.env({"PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                os.environ.get("PATH", "")])})

    def run(command: list[str], **extra: str) -> int:
        return subprocess.run(command, env={**env, **extra}, cwd=cluster.dir,
                              capture_output=True, timeout=30).returncode

    assert run(probe("controller")) == 0
    assert run(probe("worker"), POD_NAME="stepbus-worker-abc12") == 0
    assert run(probe("worker"), POD_NAME="stepbus-worker-gone1") != 0
    assert run(probe("broker")) != 0, "no broker is running"
