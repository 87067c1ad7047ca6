# One image, two entry points: the operator (`preemptible-operator`) and the training runtime
# (`trainer-runtime`, `python -m trainer_runtime.toy`, or any user script that imports
# trainer_runtime). The default command runs the operator; TrainingJob pods set their own command.
#
# Build arguments:
#   BASE_IMAGE       image with Python >= 3.11 (default: the official slim Python image). For CUDA,
#                    use a CUDA runtime base; python3 and venv are installed when missing.
#   TORCH_SPEC       pip requirement for torch (default "torch").
#   TORCH_INDEX_URL  extra package index for torch wheels, empty by default. Point it at a CPU-only
#                    wheel index to get a small CPU image; leave it empty on a CUDA base, where
#                    the default wheels carry the CUDA libraries.
ARG BASE_IMAGE=python:3.12-slim-bookworm

# ------------------------------------------------------------------------------- build stage
FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=
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
# torch first, in its own layer: it is by far the largest dependency and changes least often.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else \
      pip install "$TORCH_SPEC"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer_runtime/ trainer_runtime/
COPY operator/ operator/
# A regular (not editable) install, so the final stage needs no source tree.
RUN pip install . && \
    find /opt/preemptible -name '__pycache__' -type d -prune -exec rm -rf {} + && \
    preemptible-operator --help >/dev/null && \
    trainer-runtime --help >/dev/null

# ----------------------------------------------------------------------------- runtime stage
FROM ${BASE_IMAGE} AS runtime
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
COPY --from=build /opt/preemptible /opt/preemptible
ENV PATH=/opt/preemptible/bin:$PATH \
    HOME=/home/preemptible \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/preemptible
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
LABEL org.opencontainers.image.title="preemptible" \
      org.opencontainers.image.description="Operator and trainer runtime for preemptible PyTorch training" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["preemptible-operator", "run", "--all-namespaces"]
