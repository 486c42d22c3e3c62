"""Optional encryption at rest for the S3 tier: AES-256-GCM with a per-tenant key.

An encrypted object is ``MAGIC || key id (8 bytes) || nonce (12 bytes) || ciphertext+tag``.
The object's name is the associated data, so an object copied under another name fails
to authenticate. The key id (a digest of the key, not the key) lets a node holding a
different key (a rotation not yet rolled out) refuse the object instead of taking it
for tampered and quarantining it away from correctly configured nodes. The cost: a decrypted snapshot is a fresh buffer, so a read from S3
cannot be zero-copy (the NVMe copy it is written to stays plaintext and mappable;
encrypt that disk with the platform's tools if it needs it). See docs/concepts/tenants.md.
"""
from __future__ import annotations

import hashlib
import os

import pyarrow as pa
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from store.errors import SnapshotCorrupt, SnapshotError

MAGIC = b"KVWENC1\x00"
_KEY_ID = 8
_NONCE = 12


def key_id(key: bytes) -> bytes:
    """A public 8-byte fingerprint of an encryption key."""
    return hashlib.sha256(b"kvwarm/key-id/v1\x00" + key).digest()[:_KEY_ID]


def is_sealed(data: bytes | memoryview) -> bool:
    """Whether ``data`` is an encrypted object."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def seal(key: bytes, name: str, plaintext: bytes) -> bytes:
    """Encrypt ``plaintext`` stored under ``name``."""
    nonce = os.urandom(_NONCE)
    return MAGIC + key_id(key) + nonce + AESGCM(key).encrypt(nonce, plaintext, name.encode())


def unseal(key: bytes | None, name: str, blob: bytes | memoryview, *, location: str = "") -> bytes:
    """Decrypt an object read from ``name``.

    Raises:
        SnapshotError: no key is configured. Deliberately not :class:`SnapshotCorrupt`:
            the object is sound and this node is misconfigured, so it must be refused,
            never quarantined (which would take it away from correctly configured nodes).
        SnapshotError: sealed with another key than this node's (also refused, not
            quarantined: rotate the key on every node, or re-prefill).
        SnapshotCorrupt: authentication failed (tampered, truncated, or copied under
            another name).
    """
    if key is None:
        raise SnapshotError(
            "object is encrypted but this tenant has no encryption key configured on this node "
            "(tenants.<name>.encryption_key_env)",
            location=location,
        )
    blob = bytes(blob)
    start = len(MAGIC)
    stored_id, nonce = blob[start : start + _KEY_ID], blob[start + _KEY_ID : start + _KEY_ID + _NONCE]
    if len(stored_id) == _KEY_ID and stored_id != key_id(key):
        raise SnapshotError(
            f"object was encrypted with key id {stored_id.hex()}, this node holds key id {key_id(key).hex()}; "
            "roll the key out to every node or re-prefill",
            location=location,
        )
    try:
        return AESGCM(key).decrypt(nonce, blob[start + _KEY_ID + _NONCE :], name.encode())
    except InvalidTag:
        raise SnapshotCorrupt("encrypted object failed authentication", location=location) from None


def plaintext(src: pa.Buffer | pa.NativeFile, key: bytes | None, name: str, *, location: str = "") -> pa.Buffer | pa.NativeFile:
    """``src`` as read from a tier, decrypted if it is a sealed object (see :func:`unseal`)."""
    if isinstance(src, pa.Buffer) and is_sealed(memoryview(src)):
        return pa.py_buffer(unseal(key, name, memoryview(src), location=location))
    return src
