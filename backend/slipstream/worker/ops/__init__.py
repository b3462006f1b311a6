"""Paged-KV operators: the torch reference (CPU path) and the OpenAI Triton kernels (CUDA path)."""
