# syntax=docker/dockerfile:1
# Images of mtp-operator, one build target each:
#   docker build --target operator    -t mtp-operator:0.1.0 .
#   docker build --target runtime     -t mtp-runtime:0.1.0 .
#   docker build --target runtime-npu -t mtp-runtime-npu:0.1.0 \
#       --build-arg CANN_BASE_IMAGE=<a CANN image matching your NPU driver> .
# The runtime images run `mtp serve` (every rank) and `mtp export` (the export
# Job); the operator image runs `mtp operator` (kopf underneath).
# Every dependency of the package is pinned by hack/image-constraints.txt
# (pip -c; regenerate with hack/gen_image_constraints.py), so two builds a
# month apart install the same versions.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# Ascend CANN base for the NPU runtime: CANN toolkit + Python 3.11, aarch64 or
# x86_64. Pick the tag that matches the NPU driver on your nodes.
ARG CANN_BASE_IMAGE=ascendai/cann:8.2.rc1-910b-ubuntu22.04-py3.11
ARG TORCH_VERSION=2.13.0
ARG TORCH_NPU_VERSION=2.13.0
# Empty: torch comes from pip's default index configuration (on x86_64 that
# wheel bundles CUDA libraries and is large). For the small CPU-only wheel,
# pass PyTorch's CPU wheel index: --build-arg TORCH_CPU_INDEX=<that index URL>.
ARG TORCH_CPU_INDEX=
ARG PIP_VERSION=25.2
ARG APP_UID=10001

# ---------------------------------------------------------------- wheel
# Builds the project wheel once; every image installs it with its extras.
FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_VERSION
WORKDIR /src
RUN python -m pip install --no-cache-dir "pip==${PIP_VERSION}"
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- python-base
FROM ${PYTHON_IMAGE} AS python-base
ARG PIP_VERSION
ARG APP_UID
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m pip install "pip==${PIP_VERSION}" \
    && groupadd --gid "${APP_UID}" mtp \
    && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --shell /usr/sbin/nologin mtp
WORKDIR /home/mtp

# ---------------------------------------------------------------- operator
# Slim: pydantic, kopf, the kubernetes client; no torch.
FROM python-base AS operator
ARG APP_UID
COPY --from=wheel /wheels /wheels
COPY hack/image-constraints.txt /wheels/
RUN wheel="$(ls /wheels/mtp_operator-*.whl)" \
    && python -m pip install -c /wheels/image-constraints.txt "${wheel}[operator]" \
    && rm -rf /wheels
USER ${APP_UID}:${APP_UID}
ENTRYPOINT ["mtp"]
CMD ["operator", "--all-namespaces"]

# ---------------------------------------------------------------- runtime
# CPU runtime: torch pinned and installed first (from TORCH_CPU_INDEX when
# given), so the runtime extra installs that build and no other. That first
# install takes no constraints (the CPU index holds only some versions of
# torch's dependencies); the wheel's install then moves them to the pins.
FROM python-base AS runtime
ARG APP_UID
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
COPY --from=wheel /wheels /wheels
COPY hack/image-constraints.txt /wheels/
# g++: the packed CPU linear kernel and graph mode (torch.compile) build C++ on the machine.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m pip install ${TORCH_CPU_INDEX:+--index-url "${TORCH_CPU_INDEX}"} "torch==${TORCH_VERSION}" \
    && wheel="$(ls /wheels/mtp_operator-*.whl)" \
    && python -m pip install -c /wheels/image-constraints.txt "torch==${TORCH_VERSION}" "${wheel}[runtime]" \
    && rm -rf /wheels \
    && mtp serve --help > /dev/null && mtp export --help > /dev/null
USER ${APP_UID}:${APP_UID}
# Build the packed CPU linear once, into the image (a CPU without AVX2 skips it and uses F.linear).
RUN python -c "from mtp_runtime.kernels import cpu_gemm; print('packed CPU linear:', cpu_gemm.available())"
EXPOSE 8000
ENTRYPOINT ["mtp"]
CMD ["serve", "--help"]

# ---------------------------------------------------------------- runtime-npu
# Ascend NPU runtime on a CANN base image: torch (CPU build, as torch_npu
# expects: the default index has only that on aarch64; on x86_64 pass
# TORCH_CPU_INDEX) + torch_npu of the same version.
FROM ${CANN_BASE_IMAGE} AS runtime-npu
ARG APP_UID
ARG TORCH_VERSION
ARG TORCH_NPU_VERSION
ARG TORCH_CPU_INDEX
ARG PIP_VERSION
# NPU device nodes belong to the HwHiAiUser group on the host; the runtime
# user joins a group of that id so it can open them without being root.
ARG ASCEND_GID=1000
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
COPY hack/image-constraints.txt /wheels/
RUN python3 -m pip install "pip==${PIP_VERSION}" \
    && python3 -m pip install ${TORCH_CPU_INDEX:+--index-url "${TORCH_CPU_INDEX}"} "torch==${TORCH_VERSION}" \
    && wheel="$(ls /wheels/mtp_operator-*.whl)" \
    && python3 -m pip install -c /wheels/image-constraints.txt \
        "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" "${wheel}[runtime]" \
    && rm -rf /wheels \
    && (getent group "${ASCEND_GID}" > /dev/null || groupadd --gid "${ASCEND_GID}" HwHiAiUser) \
    && useradd --uid "${APP_UID}" --gid "${ASCEND_GID}" --create-home --shell /usr/sbin/nologin mtp
# CANN's libraries are found only after its set_env.sh has run. The
# operator's pods set `command: [mtp]`, which replaces the image's ENTRYPOINT,
# so the first `mtp` on PATH is a wrapper that sources set_env.sh (or
# $ASCEND_SET_ENV; with no arguments, so it cannot read ours) and then runs
# the package's own `mtp`.
RUN mkdir -p /opt/mtp/bin \
    && printf '%s\n' '#!/bin/bash' \
        'set_env="${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"' \
        'if [ ! -f "$set_env" ]; then echo "mtp: no CANN environment script at $set_env (set ASCEND_SET_ENV)" >&2; exit 1; fi' \
        'args=("$@"); set --' \
        'source "$set_env"' \
        'exec python3 -m mtp_runtime "${args[@]}"' > /opt/mtp/bin/mtp \
    && chmod 755 /opt/mtp/bin/mtp
ENV PATH=/opt/mtp/bin:${PATH}
WORKDIR /home/mtp
USER ${APP_UID}:${ASCEND_GID}
EXPOSE 8000
ENTRYPOINT ["mtp"]
CMD ["serve", "--help"]
