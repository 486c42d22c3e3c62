"""What the prefill job is asked to warm: texts, token ids, files and plans → requests.

Every source ends as :class:`prefill.runner.PrefixRequest` (tenant, token ids, TTL,
whether the chat template was applied, priority order). Input errors name the entry
and what is wrong; nothing here touches the store.

``--file`` formats: ``*.json`` / ``*.jsonl`` / ``*.parquet`` hold plan entries
(``store.plan``: ``{"text": ...}`` or ``{"token_ids": [...]}``, optionally ``tenant``,
``chat``, ``ttl_s``); any other file is plain text with one prefix per non-empty line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from prefill.models import LoadedModel
from prefill.runner import PrefillError, PrefixRequest
from store.config import KvwarmConfig
from store.errors import BadInputError
from store.plan import Plan, PlanEntry, PlanError, parse_plan, read_plan


class InputError(PrefillError, BadInputError):
    """The prefixes given to the prefill job are missing or malformed."""


def requests_from_plan(plan: Plan | Sequence[PlanEntry], loaded: LoadedModel, config: KvwarmConfig,
                       *, default_tenant: str | None = None) -> list[PrefixRequest]:
    """Tokenise (through the chat template where asked) and resolve tenants, keeping order."""
    entries = plan.entries if isinstance(plan, Plan) else tuple(plan)
    if not entries:
        raise InputError("no prefixes given: the input is empty")
    tenants: dict[str, object] = {}
    out: list[PrefixRequest] = []
    for i, e in enumerate(entries):
        name = e.tenant or default_tenant
        if name not in tenants:
            tenants[name] = config.tenant(name)
        if e.sealed is not None or e.hash_ids is not None:
            raise InputError(f"entry {i} names its prefix {'sealed' if e.sealed else 'by hash ids'}: give the prefill "
                             f"job token ids or text (a run directory's plan with --plan, which opens sealed entries "
                             f"with the tenant's key)")
        if e.token_ids is not None:
            ids = tuple(e.token_ids)
            vocab = int(getattr(loaded.config, "vocab_size", 0) or 0)
            if vocab and max(ids) >= vocab:
                raise InputError(f"entry {i}: token id {max(ids)} is outside the model's vocabulary of {vocab}")
        else:
            ids = tuple(loaded.encode(e.text or "", chat=e.chat))
        out.append(PrefixRequest(tenant=tenants[name], token_ids=ids, ttl_s=config.kv_cache.clamp_ttl(e.ttl_s),  # type: ignore[arg-type]
                                 chat=e.chat, order=i))
    return out


def entries_from_texts(texts: Iterable[str], tenant: str, *, chat: bool = False) -> list[PlanEntry]:
    out = []
    for i, t in enumerate(texts):
        if not t or not t.strip():
            raise InputError(f"prefix {i} is empty")
        out.append(PlanEntry(tenant=tenant, text=t, chat=chat))
    return out


def entries_from_file(path: str | Path, tenant: str, *, chat: bool = False) -> list[PlanEntry]:
    """Plan entries from ``--file`` (see the module doc for the formats)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"input file {str(p)!r} does not exist")
    try:
        if p.suffix in (".json", ".parquet"):
            entries = list(read_plan(p).entries)
        elif p.suffix == ".jsonl":
            docs = []
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
                if isinstance(d, dict):
                    d.setdefault("tenant", tenant)
                    if chat:
                        d.setdefault("chat", True)
                docs.append(d)
            entries = list(parse_plan({"entries": docs}, str(p)).entries)
        else:
            lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
            entries = entries_from_texts(lines, tenant, chat=chat)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"input file {str(p)!r} is not UTF-8 text: {exc}") from None
    if not entries:
        raise InputError(f"input file {str(p)!r} holds no prefixes")
    return entries


def parse_deadline(text: str, now: float) -> float:
    """``--until``: ISO 8601 (UTC unless an offset is given), ``+90m`` / ``+2h`` / ``+30s``
    from now, ``HH:MM`` (the next such time, UTC), or Unix seconds."""
    import datetime as dt

    t = text.strip()
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if t.startswith("+") and t[-1:] in units:
            return now + float(t[1:-1]) * units[t[-1]]
        if len(t) == 5 and t[2] == ":":
            hh, mm = int(t[:2]), int(t[3:])
            base = dt.datetime.fromtimestamp(now, dt.timezone.utc)
            at = base.replace(hour=hh, minute=mm, second=0, microsecond=0)
            if at.timestamp() <= now:
                at += dt.timedelta(days=1)
            return at.timestamp()
        if t.replace(".", "", 1).isdigit():
            return float(t)
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        return when.timestamp()
    except ValueError:
        raise InputError(f"--until {text!r} is not a time: use ISO 8601 (2026-11-30T06:00Z), +90m / +2h, "
                         f"HH:MM (UTC) or Unix seconds") from None
