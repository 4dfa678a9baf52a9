"""deploy/k8s as the tests see it: a copy with freshly generated keys, rendered offline with
kustomize, and the objects' pods, environments and Secrets read the way Kubernetes reads them.

Rendering needs ``kubectl`` (its built-in kustomize) or ``kustomize`` on PATH; without either
the tests say so and skip.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from pydantic_settings import BaseSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBE_VERSION = "1.34"
"""The API version the manifests are checked against (schemas ship with kubernetes-validate)."""
OVERLAYS = ["base", "overlays/example"]

Doc = dict[str, Any]
S = TypeVar("S", bound=BaseSettings)


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(tree: Path, target: str) -> list[Doc]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is on PATH: cannot render deploy/k8s")
    out = subprocess.run(
        [*command, str(tree / target)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def copy_tree(folder: Path) -> Path:
    """A copy of deploy/k8s with freshly generated keys (as a user's make-secrets run)."""
    copy_of = folder / "k8s"
    shutil.copytree(K8S, copy_of, ignore=shutil.ignore_patterns("secrets"))
    subprocess.run(
        [str(copy_of / "make-secrets"), str(copy_of / "overlays" / "example")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return copy_of


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def container_env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def expand(value: str, variables: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables[m.group(1)], value)


def plain_env(container: Doc, secrets: dict[str, dict[str, str]], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it: ``envFrom`` first, then ``env`` in
    order, each ``$(VAR)`` expanded from what is defined before it."""
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(secrets[source["secretRef"]["name"]])
    for entry in container.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            out[entry["name"]] = expand(entry["value"], out)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            out[entry["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            out[entry["name"]] = pod_name
    return out


def from_env(cls: type[S], env: dict[str, str], prefix: str) -> S:
    """``cls()`` reading exactly the container's ``prefix`` variables, as the process would."""
    with pytest.MonkeyPatch.context() as patch:
        for name in os.environ:
            if name.startswith(prefix):
                patch.delenv(name)
        for name, value in env.items():
            if name.startswith(prefix):
                patch.setenv(name, value)
        return cls()


def secret_values(docs: list[Doc]) -> dict[str, dict[str, str]]:
    """Secret name → key → value."""
    return {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
        for d in docs
        if d["kind"] == "Secret"
    }


def generated(tree: Path) -> dict[str, str]:
    """The key files make-secrets wrote."""
    folder = tree / "overlays" / "example" / "secrets"
    return {path.name: path.read_text() for path in folder.iterdir()}


def pod_spec_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels
