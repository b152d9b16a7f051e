# Executor image: CUDA runtime + torch + Triton. Build from the repository root:
#   docker build -f deploy/docker/executor.Dockerfile -t pagedserve-executor .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY kernels ./kernels
COPY clients ./clients
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch \
    && pip install '.[executor]' && groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --no-create-home pagedserve
# Numeric user and group (Kubernetes' runAsNonRoot checks them). The root filesystem may be read-only:
# point HOME, TRITON_CACHE_DIR and HF_HOME at a writable volume (deploy/k8s does).
USER 10001:10001
EXPOSE 50061 9401
# One rank; a pod with N GPUs runs `python -m executor_svc.server.group --tensor-parallel-size N`
# (one rank per GPU; deploy/k8s sets that command).
ENTRYPOINT ["python", "-m", "executor_svc.server.main"]
