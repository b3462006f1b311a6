"""Prefix-cache block hashes: the engine's fast built-in hash, or vLLM's ``sha256_cbor``.

A full block is named by a hash chained over everything before it: ``hash(parent, tokens,
extra_keys)``. With ``sha256_cbor`` the bytes equal vLLM's for the same tokens, block size
and extra keys (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``NONE_HASH``,
``generate_block_hash_extra_keys``), so routers that hash prompts themselves (vllm-router's
``kv_aware``, llm-d's precise prefix-cache scorer) and the engine's KV events agree.
The built-in hash stays the default: Python's ``hash`` of a tuple costs far less per block.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Hashable, Optional

HASH_ALGOS = ("builtin", "sha256_cbor")
# vLLM's seed for the first block's parent when PYTHONHASHSEED is unset (sha256 algorithms).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

# per extra key: a tag ("lora", "cache_salt") and its values
ExtraKeys = Optional[tuple[tuple[Any, ...], ...]]


@dataclass(frozen=True)
class BlockKeySource:
    """What, besides its tokens, keys a request's blocks: vLLM's extra keys in its order
    (LoRA on every block, ``cache_salt`` on the first only)."""

    lora_name: Optional[str] = None
    lora_path: Optional[str] = None
    cache_salt: Optional[str] = None

    def extra_keys(self, block_index: int) -> ExtraKeys:
        keys: list[tuple[Any, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


def event_extra_keys(extra: ExtraKeys) -> Optional[tuple[Any, ...]]:
    """vLLM publishes extra keys untagged: the LoRA name, the salt (``to_event_extra_keys``)."""
    return None if extra is None else tuple(key[1] for key in extra)


class BlockHasher:
    """Chains block hashes; ``None`` as parent means "first block"."""

    algo = "builtin"

    def hash_block(
        self, parent: Optional[Hashable], tokens: tuple[int, ...], extra_keys: ExtraKeys
    ) -> Hashable:
        return hash((parent, tokens, extra_keys))


class Sha256CborHasher(BlockHasher):
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR of ``(parent, tokens, extra)``,
    the first block's parent being ``NONE_HASH``."""

    algo = "sha256_cbor"

    def __init__(self, seed: Optional[str] = None) -> None:
        import cbor2  # only needed for this algorithm

        self._dumps = cbor2.dumps
        self.seed = none_hash_seed() if seed is None else seed
        self.none_hash = self.digest(self.seed)

    def digest(self, value: Any) -> bytes:
        return hashlib.sha256(self._dumps(value, canonical=True)).digest()

    def hash_block(
        self, parent: Optional[Hashable], tokens: tuple[int, ...], extra_keys: ExtraKeys
    ) -> bytes:
        return self.digest((parent or self.none_hash, tokens, extra_keys))


def none_hash_seed() -> str:
    """vLLM's rule: PYTHONHASHSEED when set, else its fixed default."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def make_hasher(algo: str) -> BlockHasher:
    if algo == "sha256_cbor":
        return Sha256CborHasher()
    if algo == "builtin":
        return BlockHasher()
    raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def int_block_hash(value: bytes) -> int:
    """vLLM's 64-bit form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the low 64 bits."""
    return int.from_bytes(value, "big") & ((1 << 64) - 1)
