# ampd's own processes: gateway, tools workers, GPU-free workers.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ampd ampd
COPY bench bench
COPY gateway gateway
COPY perfmodel perfmodel
COPY planner planner
COPY rounds rounds
COPY surface surface
COPY tools_sandbox tools_sandbox
COPY workers workers
RUN pip install --no-cache-dir . && useradd --create-home ampd
USER ampd
CMD ["ampd", "--help"]
