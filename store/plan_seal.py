"""A private plan's prompts, encrypted per tenant: what the pipeline's run directory holds.

The pipeline keeps the plan with its prompts (``plan.json``, ``cadence_plan.json``) in its
private run directory (:mod:`prefill.rundir`), for the prefill job. An entry of a tenant
that has an encryption key (``tenants.<name>.encryption_key_env``) is written *sealed*: its
``token_ids``, ``text`` or ``hash_ids`` are replaced by ``sealed``, the base64 of
:func:`store.tiers.crypto.seal` (AES-256-GCM, the tenant's key, the tenant's name bound
in), and everything else stays readable (score, TTL, action: what the report and the
planner read). A tenant without a key has its entries in plain text: the run directory is
private to the pipeline (docs/concepts/plan.md). Readers that need the prompts (the prefill
job, the cadence planner, publishing) open the plan with the keys first (:func:`open_plan`).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any, Callable

from store.errors import ConfigError, SnapshotError
from store.plan import Plan, PlanEntry, PlanError
from store.tiers import crypto

#: a tenant's encryption key, or ``None`` when it has none
KeyFor = Callable[[str], "bytes | None"]
_PROMPT = ("token_ids", "text", "hash_ids")


def _aad(tenant: str) -> str:
    return f"kvwarm/plan-entry/v1/{tenant}"


def config_keys(config: Any) -> KeyFor:
    """The encryption key of each tenant whose config names one (``tenants.<name>.encryption_key_env``).

    The returned function raises :class:`store.errors.ConfigError` when the variable it names is unset.
    """
    def key_for(tenant: str) -> bytes | None:
        tc = config.tenants.get(tenant)
        if tc is None or not tc.encryption_key_env:
            return None
        return config.tenant(tenant).encryption_key
    return key_for


def seal_entry(entry: PlanEntry, key: bytes) -> PlanEntry:
    """``entry`` with its prompt (token ids, text or hash ids) encrypted under ``key``."""
    if entry.sealed is not None:
        return entry
    prompt = {k: list(v) if isinstance(v, tuple) else v for k in _PROMPT if (v := getattr(entry, k)) is not None}
    blob = crypto.seal(key, _aad(entry.tenant), json.dumps(prompt).encode("utf-8"))
    return dataclasses.replace(entry, token_ids=None, text=None, hash_ids=None,
                               sealed=base64.b64encode(blob).decode("ascii"))


def open_entry(entry: PlanEntry, key: bytes | None) -> PlanEntry:
    """``entry`` with its sealed prompt decrypted (unchanged when not sealed).

    Raises:
        PlanError: the tenant has no key here, another key sealed it, or it was altered.
    """
    if entry.sealed is None:
        return entry
    where = f"plan entry for tenant {entry.tenant!r}"
    try:
        blob = base64.b64decode(entry.sealed, validate=True)
        raw = crypto.unseal(key, _aad(entry.tenant), blob, location=where)
        prompt = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise PlanError(f"{where}: its sealed prompt is not readable ({exc})") from None
    except SnapshotError as exc:
        raise PlanError(f"{where}: its sealed prompt cannot be opened: {exc}") from None
    if not isinstance(prompt, dict) or set(prompt) - set(_PROMPT):
        raise PlanError(f"{where}: its sealed prompt is not a prompt")
    return dataclasses.replace(entry, sealed=None, **prompt)


def seal_plan(plan: Plan, key_for: KeyFor) -> Plan:
    """``plan`` with the entries of every tenant that has a key sealed (others unchanged).

    Raises:
        ConfigError: a tenant's key is named by the config but its variable is unset.
    """
    keys: dict[str, bytes | None] = {}
    out = []
    for e in plan.entries:
        if e.tenant not in keys:
            keys[e.tenant] = key_for(e.tenant)
        key = keys[e.tenant]
        out.append(seal_entry(e, key) if key is not None else e)
    return dataclasses.replace(plan, entries=tuple(out))


def open_plan(plan: Plan, key_for: KeyFor) -> Plan:
    """``plan`` with every sealed entry opened with its tenant's key.

    Raises:
        PlanError: a sealed entry's tenant has no key here (its variable unset included),
            or the entry does not open with it.
    """
    if all(e.sealed is None for e in plan.entries):
        return plan
    keys: dict[str, bytes | None] = {}
    out = []
    for e in plan.entries:
        if e.sealed is not None and e.tenant not in keys:
            try:
                keys[e.tenant] = key_for(e.tenant)
            except ConfigError as exc:
                raise PlanError(f"plan entry for tenant {e.tenant!r} is sealed and its key is not here: {exc}") from None
        out.append(open_entry(e, keys.get(e.tenant)))
    return dataclasses.replace(plan, entries=tuple(out))
