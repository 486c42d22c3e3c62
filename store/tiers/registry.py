"""The tier registry: which tier serves each store URL scheme, and the tiers a store URL names.

A new tier is one module with a :class:`store.tiers.base.Tier` subclass and one line in
:data:`TIERS`. Modules are imported only when a URL names their scheme, so a serving
node that stores nothing in S3 never imports s3fs.
"""
from __future__ import annotations

import importlib

from store.config import StoreConfig
from store.errors import ConfigError
from store.tiers.base import Tier
from store.tiers.urls import check_store_url

#: URL scheme -> ``"module:Class"`` of the tier that serves it
TIERS: dict[str, str] = {
    "file": "store.tiers.local:LocalTier",
    "s3": "store.tiers.s3:S3Tier",
}

#: the local tier a store URL gets first when it names no local (not ``remote``) tier
DEFAULT_LOCAL = "file://~/.cache/kvwarm"


def schemes() -> str:
    """The registered schemes as a user types them (``file://, s3://``), for messages."""
    return ", ".join(f"{s}://" for s in TIERS)


def tier_class(url: str) -> type[Tier]:
    """The tier class serving ``url``'s scheme.

    Raises:
        ConfigError: no tier is registered for the scheme.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in TIERS:
        raise ConfigError(f"store.url: {url!r} has an unknown scheme; use {schemes()}")
    module, _, name = TIERS[scheme].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"the registry's {scheme!r} entry {TIERS[scheme]!r} is not a Tier")
    return cls


def tiers_from_url(url: str, settings: StoreConfig = StoreConfig(), *, create_bucket: bool = False) -> list[Tier]:
    """Build the tiers a store URL names (``file://...``, ``s3://...``, or several, comma-separated).

    Local tiers come before remote ones, each scheme at most once; a URL without a local
    tier gets :data:`DEFAULT_LOCAL` first.

    Raises:
        ConfigError: an unknown scheme, more than one tier of a scheme, a local tier
            after a remote one, or a malformed URL (:func:`store.tiers.urls.check_store_url`:
            a relative ``file://`` path, a bad bucket name, ``..`` in an S3 prefix).
    """
    check_store_url(url)  # every part before any tier is made (a local tier makes its directory)
    parts = [p.strip() for p in url.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"store.url is empty; give one of {schemes()} (e.g. file:///path, s3://bucket/prefix), "
                          "or several comma-separated")
    classes = [tier_class(p) for p in parts]
    if all(c.remote for c in classes):
        parts.insert(0, DEFAULT_LOCAL)
        classes.insert(0, tier_class(DEFAULT_LOCAL))
    seen: set[str] = set()
    for i, cls in enumerate(classes):
        if cls.scheme in seen:
            raise ConfigError(f"store.url: only one {cls.scheme}:// tier is supported, got {url!r}")
        seen.add(cls.scheme)
        if not cls.remote and any(c.remote for c in classes[:i]):
            raise ConfigError(f"store.url: the local tier must come first, before remote ones, got {url!r}")
    return [cls.from_url(part, settings, create_bucket=create_bucket) for part, cls in zip(parts, classes)]
