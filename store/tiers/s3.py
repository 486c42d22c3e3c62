"""The S3 tier: any S3-compatible endpoint through s3fs.

Every call runs under a hard deadline (``op_timeout_s``) on top of botocore's
connect/read timeouts and a small retry budget, so an unreachable endpoint fails with
:class:`store.errors.StoreUnavailable` instead of hanging the caller. Writes are a
single PUT (objects below s3fs's multipart threshold) or a completed multipart
upload: S3 never shows a partial object. The batch probe issues its HEAD requests
concurrently, so it costs one round trip of latency however long the chain is.
"""
from __future__ import annotations

import asyncio
import errno
import os
import secrets
import time
from typing import Any, Callable, Coroutine, Iterator, Sequence, TypeVar

import aiohttp
import pyarrow as pa
import s3fs
from botocore.exceptions import BotoCoreError, ClientError
from fsspec.asyn import sync

from store.config import S3Config, StoreConfig
from store.errors import ConfigError, StoreUnavailable
from store.format.encode import EncodedSnapshot, snapshot_bytes
from store.tiers.base import SUFFIX, Entry, Tier, meta_too_large
from store.tiers.urls import s3_location

T = TypeVar("T")
QUARANTINE = "_quarantine"
META = "_meta"


class S3Tier(Tier):
    """Snapshots under ``s3://bucket/prefix/``.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix`` (:func:`store.tiers.urls.s3_location`: a valid
            bucket name, no ``.``, ``..`` or empty segments in the prefix).
        options: endpoint, credentials (by env var name), timeouts, retries.
        create_bucket: create the bucket if it does not exist (tests, first deploy).
    """

    scheme = "s3"
    kind = "s3"

    def __init__(self, url: str, options: S3Config = S3Config(), *, create_bucket: bool = False) -> None:
        self.bucket, prefix = s3_location(url)
        self.base = f"{self.bucket}/{prefix}" if prefix else self.bucket
        self.url = f"s3://{self.base}"
        self.options = options
        os.environ.setdefault("AWS_DEFAULT_REGION", options.region)
        creds: dict[str, Any] = {}
        if options.access_key_env:
            creds["key"] = os.environ.get(options.access_key_env)
            creds["secret"] = os.environ.get(options.secret_key_env or "")
            if not creds["key"] or not creds["secret"]:
                raise ConfigError(
                    f"store.s3.access_key_env/secret_key_env: ${options.access_key_env} and "
                    f"${options.secret_key_env} must both be set"
                )
        self.fs = s3fs.S3FileSystem(
            **creds,
            client_kwargs={"endpoint_url": options.endpoint_url} if options.endpoint_url else {},
            config_kwargs={
                "connect_timeout": options.connect_timeout_s,
                "read_timeout": options.read_timeout_s,
                "retries": {"max_attempts": options.retries + 1, "mode": "standard"},
            },
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        self.fs.retries = options.retries + 1  # s3fs's own retry loop around botocore's
        if create_bucket:
            self._call(self._ensure_bucket(), "create bucket")

    @classmethod
    def from_url(cls, url: str, settings: StoreConfig, *, create_bucket: bool = False) -> "S3Tier":
        """``s3://bucket[/prefix]``, reached as the config's ``store.s3`` section says."""
        return cls(url, settings.s3, create_bucket=create_bucket)

    async def _ensure_bucket(self) -> None:
        if not await self.fs._exists(self.bucket):
            try:
                await self.fs._mkdir(self.bucket)
            except FileExistsError:
                pass

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        try:
            return sync(self.fs.loop, asyncio.wait_for, coro, self.options.op_timeout_s)
        except (FileNotFoundError, PermissionError):
            raise
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise StoreUnavailable(
                f"S3 tier {self.url} ({self.options.endpoint_url or 'AWS'}): {what} did not finish within "
                f"{self.options.op_timeout_s:g} s (store.s3.op_timeout_s); is the endpoint up?"
            ) from exc
        except (OSError, BotoCoreError, ClientError, aiohttp.ClientError) as exc:
            raise StoreUnavailable(f"S3 tier {self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def open_client(self) -> None:
        """Build the S3 client now (no request is made): see :meth:`Tier.open_client`."""
        self._call(self.fs.set_session(), "client set-up")

    def call_on_io_thread(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on s3fs's event-loop thread (``fsspecIO``, shared by every S3 tier of the process)."""
        self.fs.loop.call_soon_threadsafe(fn)
        return True

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def read(self, name: str, *, readahead: bool = False) -> pa.Buffer | None:
        try:
            data = self._call(self.fs._cat_file(self._path(name)), f"GET {name}")
        except FileNotFoundError:
            return None
        return pa.py_buffer(data)

    def write(self, name: str, data: EncodedSnapshot | bytes | pa.Buffer, *, expires_at: float) -> bool:
        raw = snapshot_bytes(data) if isinstance(data, EncodedSnapshot) else bytes(memoryview(data))
        self._call(self.fs._pipe_file(self._path(name), raw), f"PUT {name}")
        return True

    def exists(self, name: str) -> bool:
        return self._call(self.fs._exists(self._path(name)), f"HEAD {name}")

    def probe(self, names: Sequence[str]) -> int:
        if not names:
            return 0

        async def heads() -> list[bool]:
            return list(await asyncio.gather(*(self.fs._exists(self._path(n)) for n in names)))

        found = self._call(heads(), f"probe of {len(names)} blocks")
        n = 0
        for ok in found:
            if not ok:
                break
            n += 1
        return n

    def delete(self, name: str) -> bool:
        path = self._path(name)

        async def head_then_rm() -> bool:
            # S3 answers DELETE of a missing key with 204 like any other, so ask first:
            # the contract (and GC's count) needs to know whether it was there.
            if not await self.fs._exists(path):
                return False
            await self.fs._rm_file(path)
            return True

        try:
            return self._call(head_then_rm(), f"DELETE {name}")
        except FileNotFoundError:
            return False

    def entries(self, prefix: str = "") -> Iterator[Entry]:
        root = self._path(prefix.split("/")[0]) if prefix else self.base
        try:
            found = self._call(self.fs._find(root, detail=True), f"LIST {prefix or '/'}")
        except FileNotFoundError:
            return
        cut = len(self.base) + 1
        for path, info in sorted(found.items()):
            name = path[cut:]
            if not name.endswith(SUFFIX) or name.startswith("_") or not name.startswith(prefix):
                continue
            mtime = info.get("LastModified")
            yield Entry(name, int(info.get("size") or 0), mtime.timestamp() if mtime is not None else 0.0)

    def get_meta(self, name: str) -> bytes | None:
        try:
            return self._call(self.fs._cat_file(f"{self.base}/{META}/{name}"), f"GET meta {name}")
        except FileNotFoundError:
            return None

    def get_meta_capped(self, name: str, max_bytes: int) -> bytes | None:
        # one ranged GET of at most max_bytes + 1 bytes: an object over the cap is never read whole
        try:
            data = self._call(self._cat_head(f"{self.base}/{META}/{name}", max_bytes + 1), f"GET meta {name}")
        except FileNotFoundError:
            return None
        if len(data) > max_bytes:
            raise meta_too_large(f"{self.url}/{META}/{name}", f"over {max_bytes}", max_bytes)
        return data

    async def _cat_head(self, path: str, n: int) -> bytes:
        """The first ``n`` bytes of an object (all of a shorter one)."""
        try:
            return await self.fs._cat_file(path, start=0, end=n)
        except OSError as exc:
            # S3 answers a range on an empty object with 416, which s3fs turns into EINVAL
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""
            raise

    def put_meta(self, name: str, data: bytes) -> None:
        self._call(self.fs._pipe_file(f"{self.base}/{META}/{name}", data), f"PUT meta {name}")

    def list_meta(self, prefix: str) -> list[str]:
        root = f"{self.base}/{META}"
        head = prefix.rpartition("/")[0]
        try:
            found = self._call(self.fs._find(f"{root}/{head}" if head else root, detail=True), f"LIST meta {prefix}")
        except FileNotFoundError:
            return []
        cut = len(root) + 1
        return sorted(p[cut:] for p, info in found.items()
                      if info.get("type", "file") == "file" and p[cut:].startswith(prefix))

    def quarantine(self, name: str, reason: str) -> str | None:
        # Named like the local tier's (time and a random part), so a later quarantine of
        # the same name (a rewritten object gone bad again) never overwrites the evidence.
        dst = f"{self.base}/{QUARANTINE}/{name.replace('/', '__')}.{time.time():.6f}.{secrets.token_hex(4)}{SUFFIX}"
        try:
            self._call(self.fs._copy(self._path(name), dst), f"COPY {name} to quarantine")
        except FileNotFoundError:
            return None
        self._call(self.fs._pipe_file(dst + ".reason.txt", reason.encode()), "PUT quarantine reason")
        self.delete(name)
        return f"s3://{dst}"

    def quarantined(self) -> list[Entry]:
        try:
            found = self._call(self.fs._find(f"{self.base}/{QUARANTINE}", detail=True), "LIST quarantine")
        except FileNotFoundError:
            return []
        return [
            Entry(p.rsplit("/", 1)[-1], int(i.get("size") or 0), 0.0) for p, i in sorted(found.items()) if p.endswith(SUFFIX)
        ]
