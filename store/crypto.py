"""Optional encryption at rest for the S3 tier: AES-256-GCM with a per-tenant key.

An encrypted object is ``MAGIC || nonce (12 bytes) || ciphertext+tag``. The object's
name is the associated data, so an object copied under another name fails to
authenticate. The cost: a decrypted snapshot is a fresh buffer, so a read from S3
cannot be zero-copy (the NVMe copy it is written to stays plaintext and mappable;
encrypt that disk with the platform's tools if it needs it). See docs/tenancy.md.
"""
from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from store.errors import SnapshotCorrupt

MAGIC = b"KVWENC1\x00"


def is_sealed(data: bytes | memoryview) -> bool:
    """Whether ``data`` is an encrypted object."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def seal(key: bytes, name: str, plaintext: bytes) -> bytes:
    """Encrypt ``plaintext`` stored under ``name``."""
    nonce = os.urandom(12)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, name.encode())


def unseal(key: bytes | None, name: str, blob: bytes | memoryview, *, location: str = "") -> bytes:
    """Decrypt an object read from ``name``.

    Raises:
        SnapshotCorrupt: no key is configured, or authentication failed (tampered,
            truncated, wrong key, or copied under another name).
    """
    if key is None:
        raise SnapshotCorrupt("object is encrypted but this tenant has no encryption key configured", location=location)
    blob = bytes(blob)
    nonce = blob[len(MAGIC) : len(MAGIC) + 12]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(MAGIC) + 12 :], name.encode())
    except InvalidTag:
        raise SnapshotCorrupt("encrypted object failed authentication", location=location) from None
