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
# [server]: the same image runs the platform's MLflow server (PostgreSQL driver, S3 client)
RUN pip install --upgrade pip && pip install ".[server]" \
    && python -c "import torch, lightning, kfp, mlflow, kubeflow.training, psycopg, boto3, psutil"
# the code version MLflow runs show (docker build --build-arg HSTU_GIT_COMMIT=$(git rev-parse HEAD) ...)
ARG HSTU_GIT_COMMIT=""
ENV HSTU_GIT_COMMIT=${HSTU_GIT_COMMIT}

# PyTorchJob pods run `torchrun -m lightning_modules.train ...`; pipeline steps run
# their lightweight component; both need only this image. They run as the non-root user
# hstu (uid and gid 1000, components.pytorchjob.USER_ID); HOME may be pointed at a
# writable volume where the root filesystem is read-only (the PyTorchJob's pods do).
ARG USER_ID=1000
RUN groupadd --gid ${USER_ID} hstu && useradd --uid ${USER_ID} --gid ${USER_ID} --create-home hstu \
    && mkdir -p /workspace && chown ${USER_ID}:${USER_ID} /workspace
ENV PYTHONDONTWRITEBYTECODE=1
USER ${USER_ID}:${USER_ID}
WORKDIR /workspace
CMD ["hstu", "--help"]
