"""Tenant secrets as the config points to them: their minimum strength, and the map of vLLM ``cache_salt`` values.

Parsing the config stays pure (:mod:`store.config`); this module reads what it names (environment
variables, salt files) when a process needs the values, and checks them there:

- every secret (a ``secret_env`` value) and every ``cache_salt`` has at least
  :data:`MIN_SECRET_CHARS` characters: whoever guesses one is that tenant;
- a tenant's ``cache_salts`` are those of the file, of ``cache_salts_env`` (comma-separated) and of
  ``cache_salts_file`` (one a line; blank lines and ``#`` comments ignored), merged;
- a ``cache_salt`` names one tenant.

Messages never show a secret or a salt, only where it came from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from store.config_sections import TenantConfig
from store.errors import ConfigError

#: the fewest characters a tenant secret or a cache_salt may have
MIN_SECRET_CHARS = 16
#: how to make one (in every refusal)
GENERATE = "generate one with `openssl rand -hex 32` (64 characters)"
#: the most bytes a cache_salts_file may hold (a list of salts, not a data file)
MAX_SALTS_FILE_BYTES = 1 << 20
#: the keys a tenant's cache salts may come from, in the order they are merged
SALT_KEYS = ("cache_salts", "cache_salts_env", "cache_salts_file")


def check_strength(value: str, key: str, what: str) -> str:
    """``value`` when it has at least :data:`MIN_SECRET_CHARS` characters.

    Args:
        value: the secret or salt.
        key: the config key it came from (``tenants.acme.secret_env``), for the message.
        what: what it is, for the message (``the value of $ACME_SALT``); never the value itself.

    Raises:
        ConfigError: it is shorter (the message says how to generate a strong one).
    """
    n = len(value)
    if n < MIN_SECRET_CHARS:
        raise ConfigError(f"{key}: {what} has {n} character{'' if n == 1 else 's'}; a tenant secret or cache_salt "
                          f"needs at least {MIN_SECRET_CHARS} (whoever guesses it acts as the tenant): {GENERATE}")
    return value


def salt_keys(name: str, tc: TenantConfig) -> list[str]:
    """The keys of tenant ``name`` that give it cache salts (``tenants.acme.cache_salts_env``...)."""
    return [f"tenants.{name}.{k}" for k in SALT_KEYS if getattr(tc, k)]


def tenant_cache_salts(name: str, tc: TenantConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """Every ``cache_salt`` of tenant ``name``: the file's, ``$cache_salts_env``'s, ``cache_salts_file``'s.

    Raises:
        ConfigError: the variable is unset or lists none, the file is missing, unreadable or
            lists none, or a salt is shorter than :data:`MIN_SECRET_CHARS` (each names the key).
    """
    found: list[tuple[str, str, str]] = []  # (salt, key, where)
    key = f"tenants.{name}.cache_salts"
    found += [(s, key, f"cache_salt #{i + 1}") for i, s in enumerate(tc.cache_salts)]
    if tc.cache_salts_env:
        key = f"tenants.{name}.cache_salts_env"
        raw = environ.get(tc.cache_salts_env)
        if not raw:
            raise ConfigError(f"{key}: environment variable ${tc.cache_salts_env} is not set; export it "
                              "(comma-separated cache_salts) or remove the key")
        salts = [s.strip() for s in raw.split(",") if s.strip()]
        if not salts:
            raise ConfigError(f"{key}: ${tc.cache_salts_env} lists no cache_salt (comma-separated salts)")
        found += [(s, key, f"cache_salt #{i + 1} of ${tc.cache_salts_env}") for i, s in enumerate(salts)]
    if tc.cache_salts_file:
        key = f"tenants.{name}.cache_salts_file"
        salts = _read_salts_file(Path(tc.cache_salts_file).expanduser(), key)
        found += [(s, key, f"the cache_salt on line {n} of {tc.cache_salts_file}") for n, s in salts]
    out: dict[str, None] = {}
    for salt, key, where in found:
        check_strength(salt, key, where)
        out[salt] = None  # the same salt from two sources of one tenant is one salt
    return tuple(out)


def _read_salts_file(path: Path, key: str) -> list[tuple[int, str]]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SALTS_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{key}: file {str(path)!r} does not exist; create it (one cache_salt a line) "
                          "or remove the key") from None
    except OSError as exc:
        raise ConfigError(f"{key}: file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_SALTS_FILE_BYTES:
        raise ConfigError(f"{key}: file {str(path)!r} is over {MAX_SALTS_FILE_BYTES} bytes; it should list "
                          "cache_salts, one a line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: file {str(path)!r} is not UTF-8 text (one cache_salt a line)") from None
    salts = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.strip().startswith("#")]
    if not salts:
        raise ConfigError(f"{key}: file {str(path)!r} lists no cache_salt (one a line; # starts a comment)")
    return salts


def salt_map(tenants: Mapping[str, TenantConfig], environ: Mapping[str, str]) -> dict[str, str]:
    """Each ``cache_salt`` of every tenant, mapped to its tenant (every source read and checked).

    Raises:
        ConfigError: as :func:`tenant_cache_salts`, or a salt listed by two tenants (both named).
    """
    owner: dict[str, str] = {}
    for name, tc in tenants.items():
        for salt in tenant_cache_salts(name, tc, environ):
            if owner.setdefault(salt, name) != name:
                raise ConfigError(f"tenants.{name}: one of its cache_salts is already tenant {owner[salt]!r}'s; "
                                  "a cache_salt names one tenant: give each its own")
    return owner
