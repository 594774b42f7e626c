"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash, its token ids and extra keys (LoRA name, cache salt), so
equal hashes mean equal whole prefixes. sha256 keeps collisions out of reach across tenants.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None, token_ids: list[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    digest = hashlib.sha256(parent or b"root")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        digest.update(b"\x00" + key.encode())
    return digest.digest()
