"""Plans for the sharding tests: prefixes as token ids, some under one shared system prompt."""
from __future__ import annotations

import random

from store.plan import Plan, PlanEntry

BLOCK = 16
#: the shared system prompt: two full blocks
SYSTEM = tuple(range(100, 100 + 2 * BLOCK))


def shared_prompt_plan(n: int = 40, shared: int = 30, *, blocks: tuple[int, ...] = (1, 2, 3), tenant: str = "public",
                       seed: int = 0) -> Plan:
    """``n`` prefixes in priority order; ``shared`` of them (spread over the order) begin with :data:`SYSTEM`.

    Each prefix adds a few blocks of its own (and a partial block, never stored).
    """
    rnd = random.Random(seed)
    under = set(rnd.sample(range(n), shared))
    entries = []
    for i in range(n):
        own = tuple(rnd.randrange(1000, 4000) for _ in range(rnd.choice(blocks) * BLOCK + 5))
        ids = SYSTEM + own if i in under else own + (7,) * BLOCK
        entries.append(PlanEntry(tenant=tenant, token_ids=ids, ttl_s=3600.0, score=float(n - i),
                                 expected_hits=float(n - i)))
    return Plan(entries=tuple(entries), block_size=BLOCK, model="kvwarm-tiny")


def independent_plan(n: int, n_blocks: int, *, tenant: str = "public", seed: int = 1) -> Plan:
    """``n`` prefixes of ``n_blocks`` full blocks each, sharing no block, in priority order."""
    rnd = random.Random(seed)
    entries = [PlanEntry(tenant=tenant, token_ids=tuple(rnd.randrange(1000, 4000) for _ in range(n_blocks * BLOCK)),
                         ttl_s=3600.0, score=float(n - i), expected_hits=float(n - i)) for i in range(n)]
    return Plan(entries=tuple(entries), block_size=BLOCK, model="kvwarm-tiny")


def under_system(plan: Plan) -> list[int]:
    """The entries that begin with :data:`SYSTEM`."""
    return [i for i, e in enumerate(plan.entries) if e.token_ids[:len(SYSTEM)] == SYSTEM]
