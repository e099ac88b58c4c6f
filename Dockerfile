# esi-sidecar daemon image: `esi-sidecar serve` with the [server] extra only. No image is
# published (no registry holds one): build it here and push it to your own registry.
#
#   docker build -t esi-sidecar:0.1.0 .
#   docker build --build-arg UPLOAD=1 -t esi-sidecar:0.1.0-upload .   # + the uploader
#   docker run -d --name esi-sidecar --network host \
#     --env-file /etc/esi-sidecar/esi-sidecar.env -e ESI_SIDECAR_LISTEN=127.0.0.1:8791 \
#     esi-sidecar:0.1.0
#
# With podman: `podman build --format docker ...` (the OCI format has no HEALTHCHECK).
# tests/e2e/test_image.py builds both variants with podman and runs the entrypoint.
# See docs/deploy.md. The host service (install.sh + systemd) is the first choice; this
# image is for hosts that run everything in containers, and for Kubernetes
# (deploy/kubernetes/daemonset.yaml).
ARG PYTHON_IMAGE=python:3.11-slim
# The image's version label: sidecar/__init__.py's __version__, which the build installs
# (tests/e2e/test_release.py fails when this default, or a tag above, names another).
ARG VERSION=0.1.0
# Set (e.g. UPLOAD=1): also the [upload] extra (boto3) for the checkpoint uploader.
ARG UPLOAD=

# ---- builder: the venv, made by the same command as a host install --------------------
FROM ${PYTHON_IMAGE} AS builder
ARG UPLOAD
WORKDIR /src
COPY pyproject.toml README.md install.sh ./
COPY sidecar ./sidecar
COPY deploy ./deploy
# install.sh --venv-only: `python3 -m venv /opt/esi-sidecar` then
# `pip install '.[server]'` (with --upload: '.[server,upload]'), exactly as on a host and
# in tests/e2e/test_deploy.py.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ./install.sh --venv-only --prefix /opt/esi-sidecar ${UPLOAD:+--upload}

# ---- final: the venv on the same Python base, a non-root user, nothing else ----------
# (The venv's bin/python links to the base image's python3: both stages share the base.)
FROM ${PYTHON_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="esi-sidecar" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Serves the time left before this Volcengine ESI machine is released" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /opt/esi-sidecar /opt/esi-sidecar
COPY deploy/healthcheck.py /opt/esi-sidecar/healthcheck.py
# ESI_SIDECAR_LISTEN=0.0.0.0:8791: in the container's own network namespace 127.0.0.1
# is the container alone, so a published port (-p 127.0.0.1:8791:8791) or another
# container could never reach it. Being beyond loopback, it needs ESI_SIDECAR_TOKEN (the
# daemon refuses to start without it; peers send it as a bearer token), unless
# ESI_SIDECAR_LISTEN=127.0.0.1:8791 is set with --network host (docs/deploy.md).
ENV PATH=/opt/esi-sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ESI_SIDECAR_LISTEN=0.0.0.0:8791 \
    ESI_SIDECAR_STATE_FILE=/var/lib/esi-sidecar/state.json
RUN install -d -m 0700 -o 10001 -g 10001 /var/lib/esi-sidecar
VOLUME ["/var/lib/esi-sidecar"]
USER 10001:10001
EXPOSE 8791
# The daemon stops on SIGTERM within a few seconds and flushes its state file.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=90s --retries=3 \
    CMD ["python", "/opt/esi-sidecar/healthcheck.py"]
ENTRYPOINT ["esi-sidecar", "serve"]
