"""The built image under test: its root filesystem (a buildah working container) and config.

The image comes from `tests/image/run`, which builds it (`scripts/build-image`) and names it
in KVPOOL_IMAGE; .ci/run runs that script. Without KVPOOL_IMAGE these tests are skipped
with that reason: building an image takes minutes and root, so the plain suite does not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .pod import ImageConfig


@dataclass(frozen=True)
class BuiltImage:
    ref: str
    rootfs: Path
    config: ImageConfig


def _buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="session")
def image() -> Iterator[BuiltImage]:
    ref = os.environ.get("KVPOOL_IMAGE")
    if not ref:
        pytest.skip("needs the built image: tests/image/run builds it and runs these tests")
    for tool in ("buildah", "runc"):
        assert shutil.which(tool), f"{tool} is missing (tests/image/run installs it)"
    inspect = json.loads(_buildah("inspect", "--type", "image", ref))
    oci = inspect["OCIv1"]["config"]
    config = ImageConfig(
        env=tuple(oci.get("Env", [])),
        user=oci.get("User", ""),
        workdir=oci.get("WorkingDir", ""),
        entrypoint=tuple(oci.get("Entrypoint", [])),
        labels=oci.get("Labels", {}),
    )
    container = _buildah("from", "--pull-never", "--quiet", ref)
    try:
        yield BuiltImage(ref, Path(_buildah("mount", container)), config)
    finally:
        subprocess.run(["buildah", "rm", container], check=False, capture_output=True)
