# One image for every pipeline step and every training worker.
# Base: a CUDA-enabled PyTorch; the project adds Lightning, KFP, MLflow and the SDKs.
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# malloc keeps freed memory for the next training step (components.steps.CPU_MALLOC_TUNING)
ENV GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296
WORKDIR /opt/hstu
COPY pyproject.toml README.md ./
COPY kernels kernels
COPY lightning_modules lightning_modules
COPY components components
COPY pipelines pipelines
# torch comes from the base image; pip keeps it because it satisfies torch>=2.6
RUN pip install --upgrade pip && pip install . && python -c "import torch, lightning, kfp, mlflow, kubeflow.training"

# PyTorchJob pods run `torchrun -m lightning_modules.train ...`; pipeline steps run
# their lightweight component; both need only this image.
WORKDIR /workspace
CMD ["hstu", "--help"]
