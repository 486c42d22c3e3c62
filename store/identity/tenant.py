"""Tenants: names, secret salts, and the public namespace.

A tenant's salt is part of every key it computes (``KeyRoot.tenant_salt``), so a
tenant that does not hold another's secret cannot even name that tenant's snapshots.
With a secret, ``salt = scrypt(secret, salt=domain || name, n=2**14, r=8, p=1)``: slow
(about 50 ms and 16 MiB) on purpose, because the salt's public fingerprint (``salt_id``,
in every header and owner record) would otherwise let anyone test guesses of the
secret offline at the speed of SHA-256; each guess now costs one scrypt. A process pays
it once per tenant (:func:`_secret_salt` is cached). Without a secret the salt is
derived from the name alone (keys still never collide across tenants, but isolation
then rests on the store's access checks only; see docs/concepts/tenants.md). The
``public`` namespace holds prefixes shared on purpose (a common system prompt); its
salt is well known.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field

from store.errors import BadInputError
from store.identity.keys import salt_id

PUBLIC = "public"
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_DOMAIN = b"kvwarm/tenant-salt/v1\x00"  # the salt of tenants without a secret (and of public)
#: the secret tenants' derivation: scrypt, with ``_SECRET_DOMAIN || name`` as its salt
_SECRET_DOMAIN = b"kvwarm/tenant-salt/v2-scrypt\x00"
#: scrypt's cost: 2**14 x 8 x 128 bytes = 16 MiB of memory and ~40-60 ms of one core per derivation
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
_SCRYPT_MAXMEM = 64 << 20


@functools.lru_cache(maxsize=256)  # the slow part, paid once per (tenant, secret) in a process
def _secret_salt(name: str, secret: bytes) -> bytes:
    return hashlib.scrypt(secret, salt=_SECRET_DOMAIN + name.encode(), n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          maxmem=_SCRYPT_MAXMEM, dklen=32)


def check_tenant_name(name: str) -> str:
    """Validate a tenant name (it becomes a directory and an S3 prefix).

    Raises:
        BadInputError: (a ``ValueError``) not 1-63 characters of ``[a-z0-9_.-]`` starting with a letter or digit.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise BadInputError(
            f"tenant name {name!r} is not allowed: use 1-63 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Tenant:
    """A tenant's credentials as held by one process.

    Attributes:
        name: namespace name.
        salt: secret salt mixed into every key root.
        encryption_key: optional 32-byte AES-GCM key for the S3 tier.
        writer_key: ``public`` only: the operator's public-writer credential
            (``tenants.public.writer_secret_env``), which a tier's owner record may require.
    """

    name: str
    salt: bytes = field(repr=False)
    encryption_key: bytes | None = field(default=None, repr=False)
    writer_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        if self.writer_key is not None and (self.name != PUBLIC or not self.writer_key):
            raise ValueError(f"tenant {self.name!r}: only 'public' has a writer credential, and it must not be empty")
        if self.encryption_key is not None and len(self.encryption_key) != 32:
            raise ValueError(f"tenant {self.name!r}: encryption key must be 32 bytes (AES-256-GCM)")

    @staticmethod
    def derive(name: str, secret: bytes | str | None = None, encryption_key: bytes | None = None) -> "Tenant":
        """Credentials for ``name``, salted with ``secret`` when given.

        With a secret the salt is scrypt's (slow, cached per process; see the module's docstring);
        without one, ``SHA-256(domain || name)``. The configuration refuses secrets under 16
        characters (:meth:`store.config.KvwarmConfig.tenant`); this function takes any.
        """
        check_tenant_name(name)
        if name == PUBLIC and secret:
            raise ValueError("the public namespace has a well-known salt; do not give it a secret")
        if secret:
            salt = _secret_salt(name, secret.encode() if isinstance(secret, str) else bytes(secret))
        else:
            salt = hashlib.sha256(_DOMAIN + name.encode()).digest()
        return Tenant(name, salt, encryption_key)

    @property
    def salt_id(self) -> str:
        return salt_id(self.salt)


PUBLIC_TENANT = Tenant.derive(PUBLIC)
