# OpenAI Triton reads TRITON_INTERPRET when @triton.jit decorates (i.e. at import): run kernels
# on CPU.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
