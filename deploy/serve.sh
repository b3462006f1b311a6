#!/bin/sh
# The container's command: the Dockerfile's ENTRYPOINT, which the Kubernetes Deployment runs
# (its `args` are appended) and tests/deploy/test_deploy_server.py starts. Ports and timeouts come
# from the environment, so the image, the manifests and the test pass the same arguments and
# only the values differ (the test picks free ports). Extra arguments are `slipstream serve`
# options, e.g. `--set max_num_seqs=128`. The OpenAI-compatible API listens on
# SLIPSTREAM_OPENAI_PORT (9000, Triton's OpenAI frontend's port), and the vLLM-named metric
# series are on: what inference gateways and routers read of each replica.
# SLIPSTREAM_SERVER_ARGS holds further tritonserver options, space-separated, each passed on as
# `--server-arg=OPTION`.
set -euf  # -f: the options in SLIPSTREAM_SERVER_ARGS are not file patterns
home=$(cd "$(dirname "$0")/.." && pwd)
for option in ${SLIPSTREAM_SERVER_ARGS:-}; do
    set -- "$@" "--server-arg=$option"
done
exec slipstream serve \
    --model-repository "${SLIPSTREAM_MODEL_REPOSITORY:-$home/model_repository}" \
    --host 0.0.0.0 \
    --http-port "${SLIPSTREAM_HTTP_PORT:-8000}" \
    --grpc-port "${SLIPSTREAM_GRPC_PORT:-8001}" \
    --metrics-port "${SLIPSTREAM_METRICS_PORT:-8002}" \
    --openai-port "${SLIPSTREAM_OPENAI_PORT:-9000}" \
    --startup-timeout "${SLIPSTREAM_STARTUP_TIMEOUT:-600}" \
    --exit-timeout "${SLIPSTREAM_EXIT_TIMEOUT:-60}" \
    --log-file - \
    --set metric_families=slipstream,vllm \
    "$@"
