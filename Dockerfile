# hpctrain node image: DeepSpeed + hpctrain[node]; every rank of a job runs inside it.
#
# GPU clusters (the default base is a CUDA PyTorch devel image, so DeepSpeed's ops compile here, not on the nodes):
#   docker build -t hpctrain:latest .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3 --build-arg TORCH_SPEC=base -t hpctrain .
# CPU tests (a plain Debian base made with debootstrap; no ops prebuilt: the node uses torch's AdamW and skips
# DeepSpeed's shm op on CPU, so nothing is JIT-compiled at run time):
#   containers/build.sh build --cpu          (podman build --runtime runc --network host -v /opt/wheels:/wheels ...)
# containers/README.md has the build and run commands for Apptainer, pyxis/enroot, podman and Charliecloud.

ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel

# ---- base: python3 + /opt/venv + torch (shared by the build and runtime stages) ---------------------------
FROM ${BASE_IMAGE} AS base
# torch==X pins torch into /opt/venv (a no-op when the base already has that version); "base" keeps the
# base image's own torch as it is (NGC images carry custom builds such as 2.6.0a0+...).
ARG TORCH_SPEC=torch==2.13.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY containers/install.sh /opt/hpctrain/install.sh
RUN bash /opt/hpctrain/install.sh python \
 && bash /opt/hpctrain/install.sh torch "${TORCH_SPEC}"
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1

# ---- build: DeepSpeed wheel with its ops prebuilt, and the hpctrain wheel ----------------------------------
FROM base AS build
# DeepSpeed ops compiled into the wheel (names as in DS_BUILD_<OP>); "" builds none (ops JIT on first use).
ARG DS_BUILD_OPS_SET="CPU_ADAM FUSED_ADAM FUSED_LAMB"
ARG DEEPSPEED_SPEC=deepspeed==0.19.8
# The build machine usually has no GPU: name the accelerator and the GPU architectures to compile for
# (8.0 A100, 9.0 H100/H200). The CPU test image passes DS_ACCELERATOR=cpu.
ARG DS_ACCELERATOR=cuda
ARG TORCH_CUDA_ARCH_LIST="8.0 9.0"
RUN bash /opt/hpctrain/install.sh compiler "${DS_BUILD_OPS_SET}" \
 && DS_ACCELERATOR="${DS_ACCELERATOR}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    bash /opt/hpctrain/install.sh deepspeed "${DS_BUILD_OPS_SET}" "${DEEPSPEED_SPEC}"
COPY pyproject.toml README.md /src/hpctrain/
RUN bash /opt/hpctrain/install.sh requirements /src/hpctrain/pyproject.toml
COPY toolkit /src/hpctrain/toolkit
COPY templates /src/hpctrain/templates
RUN bash /opt/hpctrain/install.sh hpctrain-wheel /src/hpctrain

# ---- runtime: no compiler added; what every rank runs ----------------------------------------------------
FROM base AS runtime
# Dependencies first (cached while pyproject.toml and DeepSpeed are unchanged), then hpctrain itself.
COPY --from=build /wheelhouse/deps /tmp/wheelhouse/deps
RUN bash /opt/hpctrain/install.sh deps /tmp/wheelhouse/deps \
 && rm -rf /tmp/wheelhouse/deps
COPY --from=build /wheelhouse/hpctrain /tmp/wheelhouse/hpctrain
RUN bash /opt/hpctrain/install.sh hpctrain /tmp/wheelhouse/hpctrain \
 && rm -rf /tmp/wheelhouse
COPY containers/entrypoint.sh /usr/local/bin/hpctrain-entrypoint
# No SLURM client in the image: submitit's `scontrol requeue` becomes a request the batch script carries out.
COPY containers/scontrol-shim.sh /usr/local/bin/scontrol
# Compute nodes are often offline: models and data come from the shared filesystem.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
LABEL org.opencontainers.image.title="hpctrain" \
      org.opencontainers.image.description="DeepSpeed + hpctrain node trainer (python -m hpctrain.node RUN_DIR)"
ENTRYPOINT ["/usr/local/bin/hpctrain-entrypoint"]
CMD ["--help"]
