"""deploy/k8s against the Kubernetes API's JSON schemas (strict: an unknown or misspelled field
fails), for every overlay and after a patch file's rendering."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import ValidationError as SchemaError

from tests.k8s.manifests import KUBE_VERSION, OVERLAYS, Doc, find, render


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_object_is_valid_for_the_kubernetes_api(tree: Path, target: str) -> None:
    docs = render(tree, target)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _misspell(doc: Doc, path: list[str | int], wrong: str) -> None:
    node: Any = doc
    for step in path[:-1]:
        node = node[step]
    node[wrong] = node.pop(path[-1])


@pytest.mark.parametrize(
    ("kind", "name", "path", "wrong"),
    [
        ("Deployment", "pdproxy",
         ["spec", "template", "spec", "containers", 0, "readinessProbe"], "readinesProbe"),
        ("Deployment", "pdproxy",
         ["spec", "template", "spec", "containers", 0, "resources", "requests"], "request"),
        ("Service", "producer", ["spec", "clusterIP"], "clusterIp"),
        ("StatefulSet", "consumer", ["spec", "serviceName"], "servicename"),
        ("PodDisruptionBudget", "pdproxy", ["spec", "minAvailable"], "minavailable"),
    ],
)  # fmt: skip
def test_a_misspelled_field_fails_validation(
    example: list[Doc], kind: str, name: str, path: list[str | int], wrong: str
) -> None:
    doc = copy.deepcopy(find(example, kind, name))
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    _misspell(doc, path, wrong)
    with pytest.raises(SchemaError, match=wrong):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_a_misspelled_field_in_a_patch_file_fails_after_rendering(own_tree: Path) -> None:
    patch = own_tree / "overlays" / "example" / "backends.yaml"
    patch.write_text(patch.read_text().replace("containers:", "containerz:", 1))
    docs = render(own_tree, "overlays/example")
    with pytest.raises(SchemaError, match="containerz"):
        kubernetes_validate.validate(find(docs, "Deployment", "pdproxy"), KUBE_VERSION, True)
