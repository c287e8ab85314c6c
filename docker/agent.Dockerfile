# kvfleet agent (GPU): docker build -f docker/agent.Dockerfile -t ghcr.io/kvfleet/kvfleet-agent:0.1.0 .
# PyPI's Linux torch wheels bring their CUDA libraries; the node's driver comes in through the NVIDIA runtime.
# For a small CPU-only image (demos, kind): --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY kernels kernels
COPY contract contract
COPY router router
COPY operator operator
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; fi \
    && pip install ".[gpu]"
# The CPU C++ ops (decode attention, fused norms, INT8), built once here: the runtime image has no C++ compiler.
ENV KVFLEET_EXT_CACHE=/opt/kvfleet/ext
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && python -m kvfleet_kernels.build_cpu

FROM python:${PYTHON_VERSION}-slim
# Triton compiles a small C launcher the first time a kernel runs, so the runtime image needs a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvfleet
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvfleet/ext /opt/kvfleet/ext
# The pod's root filesystem is read-only: every cache goes to the /tmp emptyDir.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVFLEET_HOST=0.0.0.0 \
    KVFLEET_EXT_CACHE=/opt/kvfleet/ext
USER 1000:1000
EXPOSE 8000 50051
ENTRYPOINT ["kvfleet-agent"]
CMD ["--help"]
