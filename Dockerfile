# Two images from one Dockerfile:
#   --target operator  the operator alone (`preemptible-operator`): kopf, the Kubernetes client,
#                      pydantic and the torch-free runtime modules it shares (the grace rule, the
#                      checkpoint layout). No torch. What the Helm chart runs.
#   --target runtime   (the default, last stage) the training runtime with torch (`trainer-runtime`,
#                      `python -m trainer_runtime.toy`, or any user script that imports
#                      trainer_runtime): what TrainingJob pods run (spec.image). It carries the
#                      full package, so it can run the operator too, and its default command does.
#
# Build arguments:
#   BASE_IMAGE       image with Python >= 3.11 (default: the official slim Python image). For CUDA,
#                    use a CUDA runtime base; python3 and venv are installed when missing.
#   TORCH_SPEC       pip requirement for torch (default "torch"). Runtime image only.
#   TORCH_INDEX_URL  extra package index for torch wheels, empty by default. Point it at a CPU-only
#                    wheel index to get a small CPU image; leave it empty on a CUDA base, where
#                    the default wheels carry the CUDA libraries.
ARG BASE_IMAGE=python:3.12-slim-bookworm

# ----------------------------------------------------------- a virtual environment to build in
FROM ${BASE_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# CUDA bases ship without Python: install it from the distribution when it is missing.
RUN if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then \
      apt-get update && \
      apt-get install -y --no-install-recommends python3 python3-venv python3-pip && \
      rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/preemptible
ENV PATH=/opt/preemptible/bin:$PATH
WORKDIR /src

# ------------------------------------------------------------------------- operator build stage
FROM venv AS operator-build
COPY pyproject.toml README.md ./
COPY trainer_runtime/ trainer_runtime/
COPY operator/ operator/
# Only the `operator` extra of pyproject.toml (the operator's own dependencies) and the `s3` extra
# (the operator reads checkpoints on s3:// too), then the package without its dependencies: the
# base dependencies include torch, which the operator never imports.
# The build fails when an operator module does not import or when torch came in anyway.
RUN python3 -P -c 'import tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print("\n".join(extras["operator"] + extras["s3"]))' \
      > /tmp/operator-requirements.txt && \
    pip install -r /tmp/operator-requirements.txt && \
    pip install --no-deps . && \
    find /opt/preemptible -name '__pycache__' -type d -prune -exec rm -rf {} + && \
    python3 -P -c 'import importlib, pkgutil, sys, preemptible_operator as p; [importlib.import_module(f"preemptible_operator.{m.name}") for m in pkgutil.iter_modules(p.__path__)]; assert "torch" not in sys.modules, "an operator module imported torch"' && \
    python3 -P -c 'import fsspec; fsspec.filesystem("s3", anon=True)' && \
    if python3 -P -c 'import torch' >/dev/null 2>&1; then echo "torch is installed in the operator image" >&2; exit 1; fi && \
    preemptible-operator --help >/dev/null && \
    find /opt/preemptible -name '__pycache__' -type d -prune -exec rm -rf {} +

# ----------------------------------------------- what both final images share: Python, a user
FROM ${BASE_IMAGE} AS base
# A non-root user; pods may run as another non-root uid (runAsUser), so HOME and /checkpoints
# stay writable for any user (sticky, like /tmp).
RUN if ! command -v python3 >/dev/null 2>&1; then \
      apt-get update && \
      apt-get install -y --no-install-recommends python3 && \
      rm -rf /var/lib/apt/lists/*; \
    fi && \
    groupadd --gid 10001 preemptible && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /home/preemptible \
      --shell /usr/sbin/nologin preemptible && \
    mkdir -p /home/preemptible /checkpoints && \
    chown 10001:10001 /home/preemptible /checkpoints && \
    chmod 1777 /home/preemptible /checkpoints
ENV PATH=/opt/preemptible/bin:$PATH \
    HOME=/home/preemptible \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/preemptible

# ------------------------------------------------------------------------------ operator image
# Before the torch stage: Docker's classic builder runs every stage up to --target in file order.
FROM base AS operator
COPY --from=operator-build /opt/preemptible /opt/preemptible
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
LABEL org.opencontainers.image.title="preemptible-operator" \
      org.opencontainers.image.description="Operator for preemptible PyTorch training (no torch)" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["preemptible-operator", "run", "--all-namespaces"]

# -------------------------------------------------------------------------- runtime build stage
FROM venv AS build
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=
# torch first, in its own layer: it is by far the largest dependency and changes least often.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else \
      pip install "$TORCH_SPEC"; \
    fi
COPY pyproject.toml README.md ./
COPY trainer_runtime/ trainer_runtime/
COPY operator/ operator/
# A regular (not editable) install, so the final stage needs no source tree; with the `s3` extra
# (s3:// checkpoint dirs).
RUN pip install ".[s3]" && \
    find /opt/preemptible -name '__pycache__' -type d -prune -exec rm -rf {} + && \
    preemptible-operator --help >/dev/null && \
    trainer-runtime --help >/dev/null && \
    python3 -P -c 'import fsspec; fsspec.filesystem("s3", anon=True)'

# ------------------------------------------------------------------------------- runtime image
FROM base AS runtime
COPY --from=build /opt/preemptible /opt/preemptible
USER 10001:10001
LABEL org.opencontainers.image.title="preemptible" \
      org.opencontainers.image.description="Trainer runtime (and operator) for preemptible PyTorch training" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["preemptible-operator", "run", "--all-namespaces"]
