"""Block key identity: one pure function, shared by mining, prefill and the loader.

``key(block n) = SHA-256(key(block n-1) || tokens of block n)`` and the chain starts at
a root key that hashes everything that changes the KV (docs/architecture.md, invariant 2). The
byte encoding is fixed (length-prefixed UTF-8, little-endian integers), so keys are
identical across processes, machines and Python versions. Golden values in
``tests/store/identity/test_keys.py`` pin it: changing the encoding is a format change.
"""
from __future__ import annotations

import functools
import hashlib
import re
import struct
from dataclasses import dataclass, field
from typing import NewType, Sequence

import numpy as np

from store.errors import BadInputError

#: Version of the snapshot format *and* of this key encoding. Part of every root key.
FORMAT_VERSION = 2

BlockKey = NewType("BlockKey", str)
"""A 64-character lower-case hex SHA-256 digest naming one block of one chain."""

_ROOT_DOMAIN = b"kvwarm/root/v1\x00"
_BLOCK_DOMAIN = b"kvwarm/block/v1\x00"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class KeyRoot:
    """Everything that changes the KV of a token sequence, hashed into the chain's root.

    Attributes:
        model_fingerprint: weights digest or ``model_id@revision``.
        tokenizer_fingerprint: digest of the tokenizer's files.
        chat_template_hash: digest of the chat template used ("" when none).
        adapter_hash: digest of the LoRA adapter ("" when none).
        kv_dtype: storage dtype of the KV: ``fp8_e4m3``, ``bf16`` or ``fp16``.
        quant_scheme: canonical description of scales and per-layer overrides
            (see :meth:`store.format.precision.Precision.scheme_id`).
        block_size: tokens per block.
        tenant_salt: the tenant's secret salt (bytes); see :mod:`store.identity.tenant`.
        format_version: snapshot format version.
    """

    model_fingerprint: str
    tokenizer_fingerprint: str
    kv_dtype: str
    quant_scheme: str
    block_size: int
    tenant_salt: bytes = field(repr=False)
    chat_template_hash: str = ""
    adapter_hash: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1 << 20:
            raise ValueError(f"block_size must be an integer in [1, 1048576], got {self.block_size!r}")
        if not isinstance(self.tenant_salt, (bytes, bytearray)) or len(self.tenant_salt) < 16:
            raise ValueError("tenant_salt must be at least 16 bytes; get one from store.identity.tenant.Tenant.salt")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")

    @functools.cached_property
    def salt_id(self) -> str:
        """A public fingerprint of the salt (safe to store in headers; reveals nothing). Computed once per root:
        every read checks it."""
        return salt_id(self.tenant_salt)


def salt_id(salt: bytes) -> str:
    """Public fingerprint of a tenant salt: recorded in headers and namespace markers."""
    return hashlib.sha256(b"kvwarm/salt-id/v1\x00" + bytes(salt)).hexdigest()[:32]


def _field(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return struct.pack("<I", len(raw)) + raw


def root_key(root: KeyRoot) -> BlockKey:
    """The key a chain starts from: a digest of every field of ``root`` in a fixed order."""
    try:
        return _root_key_cached(root)
    except TypeError:  # an unhashable field (a bytearray salt): computed each time
        return _root_key(root)


@functools.lru_cache(maxsize=64)  # the serving path checks every mapped snapshot against its root
def _root_key_cached(root: KeyRoot) -> BlockKey:
    return _root_key(root)


def _root_key(root: KeyRoot) -> BlockKey:
    h = hashlib.sha256(_ROOT_DOMAIN)
    h.update(struct.pack("<II", root.format_version, root.block_size))
    for value in (
        root.model_fingerprint,
        root.tokenizer_fingerprint,
        root.chat_template_hash,
        root.adapter_hash,
        root.kv_dtype,
        root.quant_scheme,
        root.tenant_salt,
    ):
        h.update(_field(value))
    return BlockKey(h.hexdigest())


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(parent: BlockKey, block_tokens: Sequence[int] | np.ndarray) -> BlockKey:
    """Key of one block given its parent's key and the block's token ids."""
    return _chain_key(parent, _token_bytes(block_tokens))


def _chain_key(parent: BlockKey, tok: bytes) -> BlockKey:
    return BlockKey(_chain_digest(bytes.fromhex(parent), tok).hex())


#: SHA-256 with the block domain already absorbed: each block key starts from a copy.
_BLOCK_HASH = hashlib.sha256(_BLOCK_DOMAIN)


def _chain_digest(parent: bytes, tok: bytes) -> bytes:
    """The raw digest of a block key: domain, parent key (raw), token count, token bytes."""
    h = _BLOCK_HASH.copy()
    h.update(parent)
    h.update(struct.pack("<I", len(tok) // 4))
    h.update(tok)
    return h.digest()


def tokens_digest(block_tokens: Sequence[int] | np.ndarray) -> str:
    """SHA-256 of a block's token ids in the key encoding (used to verify hits)."""
    return hashlib.sha256(_token_bytes(block_tokens)).hexdigest()


@dataclass(frozen=True)
class Block:
    """One full block of a chain: what a snapshot is for, and what a hit is checked against."""

    index: int
    key: BlockKey
    parent: BlockKey
    tokens: tuple[int, ...]


def block_chain(root: KeyRoot, token_ids: Sequence[int] | np.ndarray) -> list[Block]:
    """Split ``token_ids`` into full blocks and key each one.

    The final partial block (``len % block_size`` tokens) has no key: it is never
    stored, since a serving engine recomputes at least the last token anyway.
    """
    n = root.block_size
    count = len(token_ids) // n
    if count == 0:
        _token_bytes(token_ids)  # still refuse bad ids
        return []
    # validated and encoded once for the whole prompt (the serving path keys every lookup)
    encoded = _token_bytes(token_ids)
    as_ints = np.frombuffer(encoded, dtype="<u4").tolist()
    width = 4 * n
    parent = root_key(root)
    blocks: list[Block] = []
    for i in range(count):
        key = _chain_key(parent, encoded[i * width : (i + 1) * width])
        blocks.append(Block(i, key, parent, tuple(as_ints[i * n : (i + 1) * n])))
        parent = key
    return blocks


def block_keys(root: KeyRoot, token_ids: Sequence[int] | np.ndarray) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (see :func:`block_chain`)."""
    return [b.key for b in block_chain(root, token_ids)]


def tree_keys(parent: np.ndarray, roots: Sequence[KeyRoot], root_of: np.ndarray,
              blocks: np.ndarray) -> list[BlockKey]:
    """Keys of every node of a prefix tree, each the :func:`chain_key` of its parent's (or its root's).

    Node ``i`` is the block of tokens ``blocks[i]`` under node ``parent[i]``, or, where
    ``parent[i] < 0``, directly under ``roots[root_of[i]]``. Parents must be numbered
    before their children (as :mod:`forecasting.mining.block_paths` numbers them, depth by
    depth). Equal to keying each node's prefix with :func:`block_keys`, in one pass.

    Raises:
        ValueError: a parent numbered after its child, or token ids outside [0, 2**32).
    """
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    if n and np.any(parent >= np.arange(n)):
        raise ValueError("tree_keys needs every parent numbered before its children")
    blocks = np.asarray(blocks)
    encoded = _token_bytes(blocks.reshape(-1)) if blocks.size else b""
    width = 4 * (blocks.shape[1] if blocks.ndim == 2 else 0)
    tops = [bytes.fromhex(root_key(r)) for r in roots]
    raw: list[bytes] = []
    for i, (p, r) in enumerate(zip(parent.tolist(), np.asarray(root_of).tolist())):
        raw.append(_chain_digest(raw[p] if p >= 0 else tops[r], encoded[i * width:(i + 1) * width]))
    return [BlockKey(d.hex()) for d in raw]


def check_key(key: str) -> BlockKey:
    """Validate a key given from outside (CLI, file names) and return it typed.

    Raises:
        BadInputError: (a ``ValueError``) the key is not 64 lower-case hex characters.
    """
    if not isinstance(key, str) or not _HEX64.fullmatch(key):
        raise BadInputError(f"not a block key (expected 64 lower-case hex characters): {key!r}")
    return BlockKey(key)
