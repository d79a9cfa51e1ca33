# caliban-drain: one image for the daemon (`drainctl daemon`), the orchestrator worker
# (`drainctl worker`), the operator (`drainctl operator`), Flower (`drainctl flower`) and
# the compose dev stack's embedded Kubernetes API and stand-in Sandbox controller
# (`drainctl dev cluster`, `drainctl dev controller`). This is the image the operator puts
# in each Sandbox it provisions (DRAIN_DAEMON_IMAGE, default
# ghcr.io/caliban-ai/caliban-drain:latest). docs/compose.md says how to build and run it.
#
#   docker build -t ghcr.io/caliban-ai/caliban-drain:latest .
#       the builder stage makes the wheels of the project and its dependencies (needs the
#       package index)
#   pip wheel --wheel-dir wheels '.[dev,flower]'
#   docker build --build-arg WHEELHOUSE=wheels -t ghcr.io/caliban-ai/caliban-drain:latest .
#       offline: the wheels made on the host, in the build context, are all it installs
#
# BASE_IMAGE: any Debian-like image with python3 (3.11+) and its venv module; the
# default is the official slim one.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
# Extras installed with the project: dev (the embedded API and the stand-in controller,
# for the compose stack) and flower. A cluster-only image can take EXTRAS=flower.
ARG EXTRAS=dev,flower
# A folder of wheels in the build context (the project's and every dependency's); empty:
# build them here from the package index.
ARG WHEELHOUSE=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY . /src
RUN set -eu; \
    python3 -m venv /opt/caliban-drain; \
    if [ -n "${WHEELHOUSE}" ]; then \
        wheels="/src/${WHEELHOUSE}"; \
    else \
        wheels=/tmp/wheels; \
        /opt/caliban-drain/bin/pip wheel --wheel-dir "${wheels}" "/src[${EXTRAS}]"; \
    fi; \
    /opt/caliban-drain/bin/pip install --no-index --find-links "${wheels}" \
        "caliban-drain[${EXTRAS}]"; \
    /opt/caliban-drain/bin/drainctl --version

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.description="caliban-drain: daemon, orchestrator worker, operator, Flower and the dev stack" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 10001: no clash with a host user's, so a bind-mounted folder is written as no
# one else on the host; /var/lib/caliban-drain is where state goes (the compose stack's
# volumes mount there), writable by any uid the stack is told to run as (DRAIN_UID).
# git: `drainctl sources`, the init container that clones a Workspace's sources into a
# task's workspace volume; installed when the base image lacks it.
RUN set -eu; \
    if ! command -v git >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends git ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 drain; \
    useradd --system --uid 10001 --gid drain --home-dir /home/drain --create-home \
        --shell /usr/sbin/nologin drain; \
    mkdir -p /var/lib/caliban-drain /kube; \
    chown drain:drain /kube; \
    chmod 1777 /var/lib/caliban-drain
COPY --from=builder /opt/caliban-drain /opt/caliban-drain
ENV PATH=/opt/caliban-drain/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/drain
ENTRYPOINT ["drainctl"]
CMD ["--help"]
