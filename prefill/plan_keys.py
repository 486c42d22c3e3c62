"""The pipeline's side of the published plan: its prompts keyed as the prefill job keys them.

The pipeline holds the tenants' secrets and knows the model, so it alone can turn a plan's
prompts into the salted block keys serving nodes look for: :func:`published` opens the
plan's sealed entries (:mod:`store.plan_seal`), and keys each entry under the root the
prefill job writes it with (:meth:`prefill.models.LoadedModel.key_root`: the model's
identity, plain or through its chat template, the config's precision and block size, and
the tenant's salt). The tokenizer is loaded only when an entry is given as text.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from prefill.models import LoadedModel, encode, load_tokenizer, resolve
from store.config import KvwarmConfig
from store.errors import ConfigError
from store.identity.fingerprint import IdentityError, ModelIdentity, identity_from_dir
from store.identity.keys import KeyRoot
from store.plan import Plan
from store.plan_seal import config_keys, open_plan
from store.published_plan import PublishedPlan, RootFor, key_plan

log = logging.getLogger(__name__)


def roots(identities: tuple[ModelIdentity, ModelIdentity | None], config: KvwarmConfig) -> RootFor:
    """Each tenant's key root (plain, or chat-keyed where the model has a chat template), as the
    prefill job computes it; ``None`` for a tenant whose secret is not in the environment."""
    precision, block = config.kv_cache.precision(), config.kv_cache.block_size
    cache: dict[tuple[str, bool], KeyRoot | None] = {}

    def root_for(tenant: str, chat: bool) -> KeyRoot | None:
        if (tenant, chat) not in cache:
            identity = identities[1] if chat else identities[0]
            try:
                salt = config.tenant(tenant).salt
            except (ConfigError, ValueError) as exc:
                log.warning("plan entries of tenant %r are not published: %s", tenant, exc)
                salt = None
            cache[tenant, chat] = None if identity is None or salt is None else identity.key_root(precision, block, salt)
        return cache[tenant, chat]
    return root_for


def published(plan: Plan, model: str | LoadedModel, config: KvwarmConfig) -> PublishedPlan:
    """``plan`` as serving nodes read it (:func:`store.published_plan.key_plan`), keyed for ``model``
    (a loaded model, or its name: then only its identity is read, and its tokenizer if an
    entry is text).

    Raises:
        PlanError: a sealed entry whose tenant's key is not here.
    """
    opened = open_plan(plan, config_keys(config))
    if isinstance(model, LoadedModel):
        identities = (model.identity, model.chat_identity)
        tokenizer: Any = model.tokenizer
    else:
        path = resolve(model)
        try:
            chat = identity_from_dir(path, chat=True)
        except IdentityError:
            chat = None
        identities, tokenizer = (identity_from_dir(path), chat), None
    text = any(e.text is not None for e in opened.entries)
    enc: Callable[[str, bool], Sequence[int]] | None = None
    if text:
        tok = tokenizer if tokenizer is not None else load_tokenizer(str(model))
        enc = lambda t, chat: encode(tok, t, chat=chat)  # noqa: E731
    return key_plan(opened, roots(identities, config), enc)
