"""The install lines of README.md, docs/deploy.md and docs/launch.md, run as written
(issue 39, items 1 and 8).

esi-sidecar is not on a package index, so no command block may install it by name; the
README's blocks build the wheel with ``make dist`` in a copy of the checkout and install
that file: the training side into a fresh venv (it imports, ``esi-sidecar --help`` works),
and the host service under a real systemd as PID 1 of fresh namespaces, with ``python3``
under root's home where this test's Python is (pyenv), until ``/healthz`` answers 200.

No cluster runs here: each Kubernetes sequence of docs/deploy.md is played against a
record of what its commands would create (namespaces, Secrets, the applied manifest, the
chart as ``helm template`` renders it with the same flags), and every Secret a pod needs
must exist before the command that creates the pod; the objects are checked against the
Kubernetes schema.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import test_deploy
from daemon_harness import fetch_json
from deploy_support import validate_kubernetes
from test_deploy import ENV_FILE, EXPIRES_AT, SYSTEMD_PATH, BootedSystemd, clean_environ, free_port

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
DOCS = (README, DEPLOY_DOC, REPO / "docs" / "launch.md")
TRAINING_MARK = "<!-- install: the training side"
HOST_MARK = "<!-- install: the host service"
booted_systemd = test_deploy.booted_systemd  # the fixture: systemd as PID 1 of namespaces


def fenced_blocks(text: str) -> list[tuple[int, str]]:
    """Every fenced block: (the line before it, its text)."""
    blocks = []
    for match in re.finditer(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((before, match.group(1)))
    return blocks


def marked_block(path: Path, mark: str) -> str:
    found = [block for before, block in fenced_blocks(path.read_text()) if
             before.startswith(mark)]
    assert len(found) == 1, f"{path.name}: one block after {mark!r}"
    return found[0]


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blanks dropped."""
    joined = block.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            found.append(line)
    return found


# ---------------------------------------------------------------------- no package by name


def test_no_command_block_installs_the_unpublished_package_by_name() -> None:
    """`pip install esi-sidecar`, `'esi-sidecar[server]'`: pip answers No matching
    distribution. Every install in a command block names the built wheel instead."""
    by_name = re.compile(
        r"\b(pip|pipx|uv tool) install(\s+--?[\w-]+(=\S+)?)*\s+['\"]?esi-sidecar\b")
    wrong = [f"{path.name}: {line}" for path in DOCS
             for _, block in fenced_blocks(path.read_text())
             for line in block.splitlines() if by_name.search(line)]
    assert wrong == []
    for path in DOCS:
        assert "esi_sidecar-*.whl" in path.read_text(), path.name


# ---------------------------------------------------------------------- the README's blocks


def checkout_copy(destination: Path) -> Path:
    """What a fresh clone of this working tree holds: the tracked files and the new ones
    git does not ignore (no .venv, no dist/)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return destination


def local_pip() -> dict[str, str]:
    """pip's settings for this machine's local package sources alone (the loopback guard
    keeps pip off the network in tests): the file:// indexes and link folders of its
    configuration, passed as variables so they hold with another HOME too."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=True).stdout
    indexes, links = [], []
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        words = value.strip("'").split()
        if name.endswith(("index-url", "extra-index-url")):
            indexes += [word for word in words if word.startswith("file://")]
        elif name.endswith("find-links"):
            links += [word for word in words if word.startswith("/")]
    if not indexes:
        pytest.skip("pip has no local package index here (file://): make dist needs build "
                    "and setuptools from one")
    return {"PIP_INDEX_URL": indexes[0], "PIP_EXTRA_INDEX_URL": " ".join(indexes[1:]),
            "PIP_FIND_LINKS": " ".join(dict.fromkeys(links))}


def outside_checkout() -> str:
    """This process's PYTHONPATH without the checkout (the loopback guard stays)."""
    return os.pathsep.join(entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if entry and Path(entry).resolve() != REPO)


def run_lines(lines: list[str], cwd: Path, environ: dict[str, str],
              timeout: float = 600) -> subprocess.CompletedProcess[str]:
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def test_the_training_side_block_installs_the_built_wheel(tmp_path: Path) -> None:
    """The README's lines for the training side, word for word, in a copy of the checkout
    with a HOME of its own: make dist, a fresh venv, the wheel, an import, --help."""
    checkout = checkout_copy(tmp_path / "checkout")
    home = tmp_path / "home"
    home.mkdir()
    lines = commands(marked_block(README, TRAINING_MARK))
    assert shlex.split(lines[0], comments=True) == ["make", "dist"]
    environ = clean_environ(HOME=str(home), PYTHONPATH=outside_checkout(), **local_pip())
    started = time.monotonic()
    result = run_lines(lines, checkout, environ)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "usage: esi-sidecar" in result.stdout
    wheels = sorted((checkout / "dist").glob("esi_sidecar-*-py3-none-any.whl"))
    assert len(wheels) == 1 and len(list((checkout / "dist").glob("esi_sidecar-*.tar.gz"))) == 1
    installed = subprocess.run([str(home / "esi" / "bin" / "python"), "-I", "-c",
                                "import sidecar; print(sidecar.__file__)"],
                               capture_output=True, text=True, check=True, cwd=tmp_path)
    assert installed.stdout.startswith(str(home / "esi"))  # the wheel, not the checkout
    print(f"training side from a fresh copy: {time.monotonic() - started:.0f} s")


def test_the_host_block_runs_a_healthy_service_with_a_python_under_roots_home(
    booted_systemd: BootedSystemd, tmp_path: Path
) -> None:
    """The README's host lines, as root, in a copy of the checkout, under a real systemd,
    with `python3` the pyenv Python under /root this test runs on: make dist, the venv,
    the wheel with [server], `esi-sidecar install --print` and `install`, then /healthz
    200. What the test adds: make dist runs outside the namespaces (their /opt is a tmpfs,
    which hides this machine's local index); the new venv sees this test venv's packages
    (a .pth, so pip needs no index for the dependencies); the settings are written first
    (a static deadline on a free port; the README says to edit them), and curl asks that
    port."""
    base_bin = os.path.dirname(os.path.realpath(sys._base_executable))  # type: ignore[attr-defined]
    if not base_bin.startswith(("/root/", "/home/")):
        pytest.skip(f"this test's Python ({base_bin}) is not under a home folder")
    systemd = booted_systemd
    checkout = checkout_copy(tmp_path / "checkout")
    lines = commands(marked_block(README, HOST_MARK))
    assert [shlex.split(line, comments=True) for line in lines[:2]] == [
        ["make", "dist"], ["python3", "-m", "venv", "/opt/esi-sidecar"]]
    assert lines[-1] == "curl -fsS http://127.0.0.1:8791/healthz"
    started = time.monotonic()
    built = run_lines(lines[:1], checkout, clean_environ(**local_pip()))
    assert built.returncode == 0, built.stderr[-3000:]
    print(f"make dist: {time.monotonic() - started:.0f} s")
    port = free_port()
    settings = (f"ESI_SIDECAR_SOURCE=static\nESI_SIDECAR_EXPIRES_AT={EXPIRES_AT}\n"
                f"ESI_SIDECAR_LISTEN=127.0.0.1:{port}\n")
    wrote = systemd.run("sh", "-c", f"install -d -m 700 /etc/esi-sidecar && umask 077 && "
                        f"printf '{settings}' > {ENV_FILE}")
    assert wrote.returncode == 0, wrote.stderr
    environ = {**clean_environ(PYTHONPATH=outside_checkout()),
               "PATH": f"{base_bin}:{SYSTEMD_PATH}", "PIP_NO_INDEX": "1"}

    def in_checkout(*block: str) -> subprocess.CompletedProcess[str]:
        script = f"set -euo pipefail\ncd {shlex.quote(str(checkout))}\n" + "\n".join(block)
        return systemd.run("bash", "-c", script, env=environ, timeout=600)

    made = in_checkout(lines[1])
    assert made.returncode == 0, made.stderr
    shared = systemd.share_test_packages()
    reuse = in_checkout(f"printf '%s\\n' {shared} > \"$(/opt/esi-sidecar/bin/"
                        "python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
                        "/zz-test-reuse.pth\"")
    assert reuse.returncode == 0, reuse.stderr
    started = time.monotonic()
    result = in_checkout(*lines[2:-1], lines[-1].replace(":8791/", f":{port}/"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"pip install, esi-sidecar install, healthz: {time.monotonic() - started:.0f} s")
    assert '"status":"ok"' in result.stdout.replace(" ", ""), result.stdout[-2000:]
    shown = systemd.show("ActiveState", "ExecStart")
    assert shown["ActiveState"] == "active"
    assert "path=/opt/esi-sidecar/bin/esi-sidecar" in shown["ExecStart"]
    unit = systemd.run("cat", "/etc/systemd/system/esi-sidecar.service").stdout
    assert "\nProtectHome=tmpfs\n" in unit and f"\nBindReadOnlyPaths={sys.base_prefix}" in unit
    health = fetch_json(f"http://127.0.0.1:{port}/healthz")
    assert health is not None and health[0] == 200


# ---------------------------------------------------------------------- Kubernetes


@dataclass
class Cluster:
    """What a sequence of kubectl and helm commands would have created."""

    helm: str | None
    namespaces: set[str] = field(default_factory=set)
    secrets: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    objects: list[dict[str, Any]] = field(default_factory=list)

    def run(self, words: list[str]) -> None:
        if words[0] == "kubectl":
            self.kubectl(words[1:])
        elif words[0] == "helm" and words[1] == "install":
            self.helm_install(words[2:])
        else:
            raise AssertionError(f"a command this test does not know: {shlex.join(words)}")

    def kubectl(self, words: list[str]) -> None:
        namespace = ""
        if words[0] == "-n":
            namespace, words = words[1], words[2:]
        if words[:2] == ["create", "namespace"]:
            assert words[2] not in self.namespaces, f"namespace {words[2]} exists"
            self.namespaces.add(words[2])
        elif words[:3] == ["create", "secret", "generic"]:
            assert namespace in self.namespaces, f"no namespace {namespace!r} yet"
            keys = {word.split("=", 1)[1].split("=", 1)[0] for word in words[4:]
                    if word.startswith("--from-literal=")}
            self.secrets[(namespace, words[3])] = keys
        elif words[:2] == ["apply", "-f"]:
            documents = [doc for doc in yaml.safe_load_all((REPO / words[2]).read_text())
                         if doc]
            self.namespaces |= {doc["metadata"]["name"] for doc in documents
                                if doc["kind"] == "Namespace"}
            self.create(documents)
        elif words[0] in ("rollout", "get"):
            pass  # reads: checked by what was created
        else:
            raise AssertionError(f"a kubectl command this test does not know: {words}")

    def helm_install(self, words: list[str]) -> None:
        if self.helm is None:
            pytest.skip("helm is not installed (make helm)")
        release, chart, flags = words[0], words[1], words[2:]
        namespace = flags[flags.index("--namespace") + 1]
        assert namespace in self.namespaces, f"helm install: no namespace {namespace!r} yet"
        result = subprocess.run([self.helm, "template", release, str(REPO / chart), *flags],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        self.create([doc for doc in yaml.safe_load_all(result.stdout) if doc])

    def create(self, documents: list[dict[str, Any]]) -> None:
        for document in documents:
            if document["kind"] == "Secret":
                namespace = document["metadata"].get("namespace", "")
                keys = set(document.get("data", {})) | set(document.get("stringData", {}))
                self.secrets[(namespace, document["metadata"]["name"])] = keys
        for document in documents:
            if document["kind"] == "DaemonSet":
                self.check_secrets(document)
        self.objects += documents

    def check_secrets(self, workload: dict[str, Any]) -> None:
        """Every Secret a container needs (not marked optional) exists, with its key."""
        namespace = workload["metadata"]["namespace"]
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    keys = self.secrets.get((namespace, ref["name"]))
                    assert keys is not None, (
                        f"the pods need the Secret {ref['name']} and it is made only later")
                    assert ref["key"] in keys, (ref, keys)
            for source in container.get("envFrom", []):
                ref = source.get("secretRef")
                if ref and not ref.get("optional"):
                    assert (namespace, ref["name"]) in self.secrets, ref


def find_helm() -> str | None:
    """helm on PATH, else the one `make helm` caches (tools/get_helm.py)."""
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "tools" / "get_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cached = Path(module.HELM)
    return shutil.which("helm") or (str(cached) if cached.exists() else None)


def kubernetes_sequences() -> list[tuple[str, list[str]]]:
    """docs/deploy.md's blocks that end by waiting for the pods: (section, commands)."""
    text = DEPLOY_DOC.read_text()
    found = []
    for section in ("### Kubernetes", "### Helm"):
        start = text.index(f"\n{section}\n")
        end = text.index("\n### ", start + 1) if "\n### " in text[start + 1:] else len(text)
        for _, block in fenced_blocks(text[start:end]):
            lines = commands(block)
            if any("rollout status" in line for line in lines):
                found.append((section, lines))
    return found


yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifest and the chart")


@pytest.mark.parametrize("section", ["### Kubernetes", "### Helm"])
def test_each_kubernetes_sequence_makes_the_secrets_before_the_pods(section: str) -> None:
    sequences = [lines for name, lines in kubernetes_sequences() if name == section]
    assert len(sequences) == 1, f"{section}: one block that waits for the rollout"
    cluster = Cluster(find_helm())
    for line in sequences[0]:
        cluster.run(shlex.split(line))
    assert any(doc["kind"] == "DaemonSet" for doc in cluster.objects)
    secrets = [{"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "stringData": dict.fromkeys(keys, "x")}
               for (namespace, name), keys in cluster.secrets.items()]
    core = [doc for doc in cluster.objects
            if not doc["apiVersion"].startswith("monitoring.coreos.com/")]
    validate_kubernetes(core + secrets)
