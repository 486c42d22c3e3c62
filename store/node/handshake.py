"""What a node and its clients must agree on before they talk: kvwarm's version and the store settings.

A client's hello carries both (:class:`Handshake`); the node compares them with its own and
refuses a difference with :class:`store.errors.NodeRefused`, whose message names the version or
each setting that differs, with both values, and what to do. The settings are those that change
which files a name means or how they are laid out: the tiers (store URL and S3 endpoint), the
storage precision and the block size. Secrets never cross (tenants' salts stay in each process).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from store.config import KvwarmConfig
from store.errors import ConfigError, NodeRefused
from store.home import kvwarm_home

#: the longest socket path accepted (the kernel's limit is 107 bytes; room is kept for ``.lock`` names)
MAX_SOCKET_BYTES = 100


def kvwarm_version() -> str:
    """The installed kvwarm's version (``0+unknown`` when it is run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("kvwarm")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def store_settings(config: KvwarmConfig, store_url: str | None = None) -> dict[str, Any]:
    """The settings a node and its clients must share, by name (``store_url`` overrides ``store.url``)."""
    kv = config.kv_cache
    return {
        "store.url": store_url or config.store.url,
        "store.s3.endpoint_url": config.store.s3.endpoint_url,
        "kv_cache.precision": kv.precision().scheme_id(),
        "kv_cache.block_size": kv.block_size,
    }


@dataclass(frozen=True)
class Handshake:
    """A hello: kvwarm's version and the store settings (:func:`store_settings`)."""

    version: str
    settings: Mapping[str, Any]

    @classmethod
    def of(cls, config: KvwarmConfig, store_url: str | None = None, *, version: str | None = None) -> "Handshake":
        """This process's hello for ``config`` (``version``: kvwarm's own unless given)."""
        return cls(version or kvwarm_version(), store_settings(config, store_url))

    @property
    def fingerprint(self) -> str:
        """A short digest of the settings (16 hex digits), for logs and the node's metrics."""
        blob = json.dumps(dict(self.settings), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def encode(self) -> bytes:
        """The hello's bytes (JSON: sent once per connection, never on the hot path)."""
        return json.dumps({"version": self.version, "settings": dict(self.settings)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Handshake":
        """A hello from its bytes.

        Raises:
            ValueError: not a hello.
        """
        obj = json.loads(data.decode())
        if not (isinstance(obj, dict) and isinstance(obj.get("version"), str) and isinstance(obj.get("settings"), dict)):
            raise ValueError("not a kvwarm node hello")
        return cls(obj["version"], obj["settings"])

    def check(self, client: "Handshake", *, where: str) -> None:
        """Refuse a client whose version or settings differ from this node's (``self``).

        Raises:
            NodeRefused: naming the versions, or each setting with the client's and the node's value.
        """
        if client.version != self.version:
            raise NodeRefused(
                f"the kvwarm node at {where} runs kvwarm {self.version}, this process kvwarm {client.version}: "
                "one machine runs one kvwarm version: stop the node (a client then starts one of its own version "
                "with node.autostart) or install the node's version here")
        keys = sorted(set(self.settings) | set(client.settings))
        differ = [f"{k} = {client.settings.get(k)!r} here vs {self.settings.get(k)!r} in the node"
                  for k in keys if client.settings.get(k) != self.settings.get(k)]
        if differ:
            raise NodeRefused(
                f"the kvwarm node at {where} uses another store configuration: {'; '.join(differ)}. Give this "
                "process the node's configuration, or give it another node.socket (a node per configuration)")


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/kvwarm/node.sock`` where the variable is set, else ``node.sock`` under kvwarm's home."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "kvwarm" / "node.sock" if runtime else kvwarm_home() / "node.sock"


def socket_path(config: KvwarmConfig, given: str | os.PathLike[str] | None = None) -> Path:
    """The node's socket: ``given``, else ``node.socket``, else :func:`default_socket`.

    Raises:
        ConfigError: the path is longer than a Unix socket's name may be.
    """
    raw = given or config.node.socket
    path = Path(raw).expanduser() if raw else default_socket()
    if len(os.fsencode(path)) > MAX_SOCKET_BYTES:
        raise ConfigError(f"node.socket = {str(path)!r}: a Unix socket path holds at most {MAX_SOCKET_BYTES} bytes; "
                          "choose a shorter path (e.g. under /run or /tmp)")
    return path
