"""The grammar of store URLs: ``file:///absolute/dir`` (or ``file://~/dir``) and ``s3://bucket[/prefix]``.

One place parses them, so the config file, ``--store``, ``KVLoader(store_url)`` and the engine's
settings agree on what a URL names. A URL that could name more than one thing is refused, with
what to write instead: a relative directory (relative to whichever directory a process happens
to start in), or an S3 key prefix with ``.``, ``..`` or empty segments (a path to some tools, a
name to S3) or control characters.
"""
from __future__ import annotations

import re

from store.errors import ConfigError

__all__ = ["check_store_url", "file_root", "s3_location"]

FILE = "file://"
S3 = "s3://"
#: S3's rules for a bucket name: 3-63 characters of a-z 0-9 . -, a letter or digit at each end
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP = re.compile(r"\d{1,3}(\.\d{1,3}){3}")
#: names S3 reserves for its own features (access points, Express One Zone, table buckets...)
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(url: str) -> None:
    found = _CONTROL.search(url)
    if found:
        raise ConfigError(f"store.url: {url!r} holds a control character ({found.group()!r}); a store URL is "
                          "printable text: remove it")


def file_root(url: str) -> str:
    """The directory a ``file://`` URL names, as written (``~`` not yet expanded).

    Raises:
        ConfigError: not a ``file://`` URL, a relative directory (``file://relative``,
            ``file://./dir``), or control characters.
    """
    if not url.startswith(FILE):
        raise ConfigError(f"store.url: {url!r} is not a file:// URL (expected file:///absolute/path)")
    _no_control(url)
    path = url[len(FILE):]
    if not path.startswith(("/", "~")):
        raise ConfigError(f"store.url: {url!r} names {'no directory' if not path else f'the relative path {path!r}'};"
                          " a store's directory must be absolute (a relative one depends on where each process "
                          "starts): write file:///absolute/path (three slashes) or file://~/path")
    return path


def check_bucket(bucket: str, url: str) -> str:
    """``bucket`` when it is a valid S3 bucket name (AWS's rules, which S3-compatible stores follow).

    Raises:
        ConfigError: naming the rule ``bucket`` breaks.
    """
    rules = "use 3-63 characters of a-z 0-9 . -, starting and ending with a letter or digit (e.g. s3://my-bucket/kv)"
    if not 3 <= len(bucket) <= 63:
        raise ConfigError(f"store.url: bucket name {bucket!r} in {url!r} must have at least 3 characters and at "
                          f"most 63: {rules}")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"store.url: bucket name {bucket!r} in {url!r} is not a valid S3 bucket name: {rules}, "
                          "with no two dots in a row")
    if _IP.fullmatch(bucket):
        raise ConfigError(f"store.url: bucket name {bucket!r} in {url!r} looks like an IP address, which S3 does not "
                          "allow: name the bucket, and give the endpoint in store.s3.endpoint_url")
    if bucket.startswith(_RESERVED_PREFIXES) or bucket.endswith(_RESERVED_SUFFIXES):
        raise ConfigError(f"store.url: bucket name {bucket!r} in {url!r} uses a prefix or suffix S3 reserves "
                          f"({', '.join(_RESERVED_PREFIXES + _RESERVED_SUFFIXES)}): choose another name")
    return bucket


def s3_location(url: str) -> tuple[str, str]:
    """The bucket and key prefix (``""`` for none) an ``s3://bucket[/prefix]`` URL names.

    Trailing slashes are ignored (``s3://bucket/kv/`` is ``s3://bucket/kv``).

    Raises:
        ConfigError: not an ``s3://`` URL, a bucket name S3 does not allow, a key prefix with
            ``.``, ``..`` or empty segments, or control characters.
    """
    if not url.startswith(S3) or len(url) <= len(S3):
        raise ConfigError(f"store.url: {url!r} is not an S3 URL (expected s3://bucket[/prefix])")
    _no_control(url)
    bucket, _, prefix = url[len(S3):].rstrip("/").partition("/")
    check_bucket(bucket, url)
    for seg in prefix.split("/") if prefix else ():
        if seg in ("", ".", ".."):
            shown = "an empty segment ('//')" if not seg else f"a {seg!r} segment"
            clean = "/".join(s for s in prefix.split("/") if s not in ("", ".", ".."))
            raise ConfigError(f"store.url: {url!r} has {shown} in its key prefix; S3 keys are names, not paths, "
                              f"and tools disagree on what such a prefix names: write the prefix without '', '.' "
                              f"or '..' segments, e.g. s3://{bucket}/{clean or 'kv'}")
    return bucket, prefix


def check_store_url(url: str) -> str:
    """``url`` when each of its comma-separated ``file://`` and ``s3://`` tiers is well formed.

    Other schemes are left to the tier registry (:func:`store.tiers.registry.tier_class`), which
    knows which are served.

    Raises:
        ConfigError: as :func:`file_root` and :func:`s3_location` do.
    """
    for part in (p.strip() for p in url.split(",")):
        if part.startswith(FILE):
            file_root(part)
        elif part.startswith(S3):
            s3_location(part)
    return url
