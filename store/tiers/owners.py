"""Namespace owner records (``meta/tenants/<ns>.json``): who owns a namespace, and who may write ``public``.

A tier records, for each namespace, the salt id of the tenant that first wrote to it; a caller
holding another secret is refused (and counted). The ``public`` namespace's record may also hold
a ``writer_id``: a slow, keyed derivation (scrypt) of the operator's public-writer credential
(``tenants.public.writer_secret_env``). Once a tier records one, every public write or delete
there needs that credential, whatever the writing process's config says.

Records are read from a store anyone with bucket access may write, so :func:`parse_owner_record`
checks every byte before it is trusted: a damaged record raises
:class:`store.errors.StoreRecordInvalid`, which readers count as a ``bad_record`` miss and
writers are refused by (a damaged record is never claimed again: an operator repairs it, and
``prefill store verify`` names it).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import re
from dataclasses import dataclass
from typing import Sequence

from store.errors import StoreRecordInvalid, TenantAccessDenied
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant, check_tenant_name
from store.tiers.base import Tier
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.store")

#: an owner record is a few dozen bytes; anything larger is refused before it is decoded
MAX_RECORD_BYTES = 4096
#: a salt id or writer id: lower-case hex (32 characters today; longer ids are accepted)
_ID = re.compile(r"[0-9a-f]{32,128}")
_FIELDS = {"namespace", "salt_id", "writer_id"}
_WRITER_DOMAIN = b"kvwarm/public-writer-id/v1"
#: scrypt cost: about 16 MiB and tens of milliseconds per guess (once per process for the writer)
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1, "dklen": 16}


@dataclass(frozen=True)
class OwnerRecord:
    """One namespace's owner, as a tier records it.

    Attributes:
        namespace: the namespace (the record's file name).
        salt_id: public fingerprint of the owner's salt (:func:`store.identity.keys.salt_id`).
        writer_id: for ``public`` only: :func:`writer_id` of the operator's credential, or ``None``.
    """

    namespace: str
    salt_id: str
    writer_id: str | None = None

    def to_bytes(self) -> bytes:
        """The record's JSON (what :func:`parse_owner_record` reads back)."""
        out: dict[str, str] = {"namespace": self.namespace, "salt_id": self.salt_id}
        if self.writer_id is not None:
            out["writer_id"] = self.writer_id
        return json.dumps(out).encode()


def record_name(ns: str) -> str:
    """The metadata object name of namespace ``ns``'s owner record."""
    return f"tenants/{ns}.json"


def parse_owner_record(raw: bytes, ns: str, location: str) -> OwnerRecord:
    """Validate an owner record read from a store.

    Args:
        raw: the file's bytes. ``ns``: the namespace its name says it is for.
        location: where it was read (named in errors).

    Raises:
        StoreRecordInvalid: larger than :data:`MAX_RECORD_BYTES`, not a UTF-8 JSON object, another
            namespace, a missing or malformed ``salt_id``, a malformed ``writer_id`` (or one outside
            ``public``), or an unknown field.
    """
    def bad(why: str) -> StoreRecordInvalid:
        return StoreRecordInvalid(f"owner record of namespace {ns!r} {why}; restore it from a good tier or "
                                  "remove it (the namespace's next write records its owner again)",
                                  location=location)

    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise bad(f"is a {type(raw).__name__}, not bytes")
    if len(raw) > MAX_RECORD_BYTES:
        raise bad(f"is {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        data = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise bad("is not UTF-8 JSON") from None
    except RecursionError:
        raise bad("nests too deep") from None
    if not isinstance(data, dict):
        raise bad(f"holds a JSON {type(data).__name__}, not an object")
    extra = set(data) - _FIELDS
    if extra:
        raise bad(f"has unknown fields {sorted(extra)}")
    if data.get("namespace") != ns:
        raise bad(f"names namespace {_shown(data.get('namespace'))}")
    sid = data.get("salt_id")
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        raise bad(f"has salt_id {_shown(sid)}, not 32-128 lower-case hex characters")
    wid = data.get("writer_id")
    if wid is not None and (not isinstance(wid, str) or not _ID.fullmatch(wid)):
        raise bad(f"has writer_id {_shown(wid)}, not 32-128 lower-case hex characters")
    if wid is not None and ns != PUBLIC:
        raise bad("has a writer_id, which only the public namespace records")
    return OwnerRecord(ns, sid, wid)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.lru_cache(maxsize=8)
def writer_id(credential: bytes) -> str:
    """The public-writer id recorded for ``credential``: scrypt over a fixed domain (slow on purpose,
    so a record does not let anyone test guesses cheaply); computed once per process and credential."""
    return hashlib.scrypt(bytes(credential), salt=_WRITER_DOMAIN, **_SCRYPT).hex()


class Owners:
    """The owner records of a store's tiers, read once per process (good ones cached), and the
    checks built on them: who may read, list and probe a namespace, and who may write it.

    Args:
        tiers: the store's tiers (records are per tier). ``stats``: the store's counters
            (``refused``, ``bad_record``).
    """

    def __init__(self, tiers: Sequence[Tier], stats: StoreStats) -> None:
        self.tiers = tiers
        self.stats = stats
        self._cache: dict[tuple[int, str], OwnerRecord] = {}
        self._logged: set[tuple[int, str]] = set()

    def refuse(self, tenant: Tenant, what: str) -> TenantAccessDenied:
        """Count and log a refused access; the error to raise."""
        self.stats.incr("refused")
        log.warning("refused: tenant %r tried to %s", tenant.name, what)
        return TenantAccessDenied(f"tenant {tenant.name!r} may not {what}")

    def record(self, i: int, ns: str) -> OwnerRecord | None:
        """Namespace ``ns``'s owner record in tier ``i`` (``None`` when it has none).

        Raises:
            StoreRecordInvalid: the record is damaged (counted as ``bad_record``; read again next time,
                so a repair takes effect without a restart).
            StoreUnavailable: the tier cannot be reached.
        """
        found = self._cache.get((i, ns))
        if found is not None:
            return found
        check_tenant_name(ns)
        tier = self.tiers[i]
        raw = tier.get_meta(record_name(ns))
        if raw is None:
            return None
        try:
            found = parse_owner_record(raw, ns, f"{tier.url} meta/{record_name(ns)}")
        except StoreRecordInvalid as exc:
            self.stats.incr("bad_record")
            if (i, ns) not in self._logged:
                self._logged.add((i, ns))
                log.error("%s", exc)
            raise
        self._cache[(i, ns)] = found
        return found

    def guard(self, tenant: Tenant, ns: str, what: str, i: int, *, write: bool = False) -> None:
        """Refuse (counted) a caller that does not own ``ns`` in tier ``i``; with ``write``, also a
        write or delete in ``public`` by anyone but its writer (the public tenant, holding the
        credential the tier records, if it records one).

        Raises:
            TenantAccessDenied: refused. StoreRecordInvalid: the record is damaged.
        """
        if write and ns == PUBLIC and tenant.name != PUBLIC:
            raise self.refuse(tenant, f"{what} the public namespace: only the public writer (the prefill job, "
                                      "as tenant 'public') writes or deletes public snapshots; tenants read them")
        rec = self.record(i, ns)
        if rec is None:
            return
        if rec.salt_id != self.expected(tenant, ns):
            raise self.refuse(tenant, f"{what} namespace {ns!r} without its owner's secret")
        if write and rec.writer_id is not None:
            key = tenant.writer_key
            if key is None or not hmac.compare_digest(writer_id(key), rec.writer_id):
                raise self.refuse(tenant, f"{what} the public namespace of {self.tiers[i].url}: it records a "
                                          "writer credential; set the variable tenants.public.writer_secret_env "
                                          "names to that credential")

    @staticmethod
    def expected(tenant: Tenant, ns: str) -> str:
        """The salt id that owns ``ns`` for ``tenant`` (the public salt's for ``public``)."""
        return PUBLIC_TENANT.salt_id if ns == PUBLIC else tenant.salt_id

    def claim(self, tenant: Tenant, ns: str, i: int) -> None:
        """Before a write: check it (:meth:`guard`), and record the owner where the tier has none (in
        ``public``, with the writer's credential id when it holds one: from then on the tier needs it)."""
        self.guard(tenant, ns, "write to", i, write=True)
        rec = self.record(i, ns)
        key = tenant.writer_key if ns == PUBLIC else None
        wid = writer_id(key) if key is not None else None
        if rec is not None and (wid is None or rec.writer_id is not None):
            return
        new = OwnerRecord(ns, self.expected(tenant, ns), wid)
        self.tiers[i].put_meta(record_name(ns), new.to_bytes())
        self._cache[(i, ns)] = new
        if rec is not None:
            log.warning("public namespace of %s now records a writer credential: public writes there need it",
                        self.tiers[i].url)
