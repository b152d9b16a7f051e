# Scheduler image: CPU only, no torch. Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t pagedserve-scheduler .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scheduler_svc ./scheduler_svc
COPY clients ./clients
COPY kernels/__init__.py ./kernels/__init__.py
COPY executor_svc/__init__.py ./executor_svc/__init__.py
RUN pip install . && groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --no-create-home pagedserve
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["python", "-m", "scheduler_svc.server.main"]
