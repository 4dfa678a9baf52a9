"""Fixtures of the deploy/k8s tests: copies of the tree and the example overlay, rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s.manifests import Doc, copy_tree, render


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy for the tests that only read it."""
    return copy_tree(tmp_path_factory.mktemp("k8s"))


@pytest.fixture
def own_tree(tmp_path: Path) -> Path:
    """A copy for a test that changes it."""
    return copy_tree(tmp_path)


@pytest.fixture(scope="session")
def example(tree: Path) -> list[Doc]:
    """The example overlay, rendered once (tests deep-copy before changing a document)."""
    return render(tree, "overlays/example")
