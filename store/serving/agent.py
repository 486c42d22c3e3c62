"""The node agent: a serving node follows the pipeline's plan for its whole life, and a new
node warms from what the fleet was serving.

The agent is the same code wherever a node runs: the KV connector and ``KVLoader`` users
drive a real node (:class:`store.serving.loader_node.LoaderNode`), and the what-if replay
drives a simulated one (``forecasting/simulate``) on a simulated clock. It asks its node only
through :class:`NodeHands`, and its plans only through a :class:`PlanSource`:

- at :meth:`NodeAgent.start` it reads the latest plan (if any) and the fleet's memory of the
  last ``fleet_window_s`` (:mod:`store.serving.fleet`), ranks every block either names
  (:func:`store.serving.urgency.rank`: soonest needed first, sized to the node's tier and
  to what its link can copy in time), makes that the node's retention priorities and
  queues the copies;
- at each :meth:`NodeAgent.tick` at least ``poll_s`` after the last check, it asks the
  source for the plan's version (a few bytes), and only when the version changed reads
  the plan and ranks again: the new plan's priorities replace the old ones, and its copies
  replace the old queue (copies the new plan no longer wants are cancelled). On a running
  node the fleet's memory counts other nodes' records only: its own are what it holds.

A plan that cannot be used (unreadable, too large, wrong types: :class:`store.plan.PlanError`,
or a store error reading it) never stops the agent: it keeps its last good plan, counts the
error (``agent_plan_errors``), still warms from the fleet's memory at start, and does not
read that version again (only a newly published one).

The plan's cadence stays the pipeline's (a plan every 5 minutes); the agent only notices.
Its state is one plan version, one ranking and a few counters: bounded whatever runs.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, Protocol, Sequence, TypeVar

from store.errors import ConfigError, StoreError
from store.plan import Plan, read_plan
from store.published_plan import PublishedPlan, latest_plan, latest_plan_version
from store.serving.priority import lower_this_thread
from store.serving.urgency import DEFAULT_HORIZON_S, PlanChain, ReuseCurve, UseLike, Warmup, rank

log = logging.getLogger("kvwarm.agent")
K = TypeVar("K", bound=Hashable)


class PlanSource(Protocol):
    """Where the agent's plans come from: a cheap version, and the plan it names."""

    def version(self) -> str | None:
        """The current plan's version (``None``: no plan); cheap: polled every ``poll_s``."""

    def read(self) -> Plan | PublishedPlan | None:
        """The current plan (``None``: none).

        Raises:
            PlanError: the plan is not usable (the agent counts it and keeps its last good plan).
        """


class NodeHands(Protocol[K]):
    """What the agent drives on a node: a real loader's (``LoaderNode``) or the replay's."""

    def plan_chains(self, plan: Plan | PublishedPlan) -> list[PlanChain[K]]:
        """The plan's entries this node serves, as chains of its block names, in the plan's order."""

    def fleet(self, since: float, *, others_only: bool) -> Sequence[UseLike[K]]:
        """The fleet's records since ``since`` (with ``others_only``, not this node's own)."""

    def held(self) -> set[K] | dict[K, Any]:
        """The blocks the node's tier holds now."""

    def capacity(self) -> int:
        """Blocks the node's tier holds at most."""

    def copy_s(self) -> float:
        """Seconds of the node's link per block copied from the shared tier."""

    def retain(self, priority: dict[K, float]) -> None:
        """Make ``priority`` the tier's retention priorities (unnamed blocks: 0), replacing the last."""

    def prefetch(self, order: list[K]) -> None:
        """Copy ``order``'s blocks, in order, in place of the last prefetch (cancel what it superseded)."""


@dataclass(frozen=True)
class AgentSettings:
    """The node agent's knobs (the config's ``agent`` section; docs/reference/config.md).

    Attributes:
        poll_s: how often the plan's version is checked (the plan itself is read only when
            it changed).
        fleet_memory: warm from the fleet's memory (``fleet_memory.enabled`` turns the
            recording off; this turns the reading off).
        fleet_window_s: how far back the fleet's records count.
        min_value: the least expected use a copy must keep to be queued
            (:func:`store.serving.urgency.rank`).
    """

    poll_s: float = 30.0
    fleet_memory: bool = True
    fleet_window_s: float = 3600.0
    min_value: float = 0.02

    @classmethod
    def of(cls, config: Any) -> "AgentSettings":
        """The config's ``agent`` section (a :class:`store.config.KvwarmConfig`)."""
        a = config.agent
        return cls(poll_s=a.poll_s, fleet_memory=a.fleet_warmup, fleet_window_s=a.fleet_window_s,
                   min_value=a.min_value)

    def __post_init__(self) -> None:
        for name in ("poll_s", "fleet_window_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and v < float("inf")):
                raise ConfigError(f"agent.{name} must be a positive number of seconds, got {v!r}")
        if not (isinstance(self.min_value, (int, float)) and 0 <= self.min_value < 1):
            raise ConfigError(f"agent.min_value must be in [0, 1), got {self.min_value!r}")


@dataclass
class AgentFigures:
    """What the agent did since it started (``kvwarm_agent_*`` in the connector's figures)."""

    polls: int = 0
    plans_applied: int = 0
    plan_errors: int = 0
    copies_queued: int = 0
    last_version: str | None = None
    bad_version: str | None = None  # the last version that could not be used (not read again)
    last_error: str | None = None
    last: dict[str, int] = field(default_factory=dict)  # the last ranking's sources and sizes

    def as_dict(self) -> dict[str, Any]:
        return {"agent_polls": self.polls, "agent_plans_applied": self.plans_applied,
                "agent_plan_errors": self.plan_errors, "agent_copies_queued": self.copies_queued,
                **{f"agent_last_{k}": v for k, v in self.last.items()}}


class NodeAgent(Generic[K]):
    """Follows ``plans`` on ``hands``'s node (see the module docstring).

    Args:
        hands: the node.
        plans: where plans come from (``None``: the fleet's memory only).
        settings: see :class:`AgentSettings`.
        clock: seconds (the replay passes its simulated clock).
        listener: told each ranking applied (the connector counts them).
        on_plan_error: told each plan error (the connector counts ``agent_plan_errors``).
    """

    def __init__(self, hands: NodeHands[K], plans: PlanSource | None, settings: AgentSettings = AgentSettings(),
                 clock: Callable[[], float] = time.time,
                 listener: Callable[[Warmup[K]], None] | None = None,
                 on_plan_error: Callable[[str], None] | None = None) -> None:
        self.hands = hands
        self.listener = listener
        self.on_plan_error = on_plan_error
        self.plans = plans
        self.settings = settings
        self.clock = clock
        self.figures = AgentFigures()
        self.plan: Plan | PublishedPlan | None = None  # the last good plan
        self._previous: Plan | PublishedPlan | None = None  # the one before it (if the node refuses the last)
        self._version: str | None = None
        self._next_poll = -float("inf")
        self._started = False

    def start(self, now: float | None = None) -> Warmup[K]:
        """The node starts: rank the latest plan with the fleet's memory, retain and copy."""
        now = self.clock() if now is None else now
        self._started = True
        self._next_poll = now + self.settings.poll_s
        version = self._poll()
        if version is not None:
            self._read(version)
        return self._apply(now, others_only=False)

    def tick(self, now: float | None = None) -> Warmup[K] | None:
        """Check for a new plan if ``poll_s`` has passed; apply it if there is one.

        Returns the new ranking, or ``None`` when nothing changed (or it is not time yet).
        """
        now = self.clock() if now is None else now
        if not self._started:
            return self.start(now)
        if now < self._next_poll:
            return None
        self._next_poll = now + self.settings.poll_s
        version = self._poll()
        if version is None or version in (self._version, self.figures.bad_version) or not self._read(version):
            return None
        return self._apply(now, others_only=True)

    def next_poll(self) -> float:
        """When :meth:`tick` next asks for the plan's version."""
        return self._next_poll

    # -- the steps -----------------------------------------------------------
    def _poll(self) -> str | None:
        if self.plans is None:
            return None
        self.figures.polls += 1
        try:
            return self.plans.version()
        except (StoreError, OSError) as exc:
            log.warning("kvwarm agent: the plan's version could not be read (%s); the node keeps its plan", exc)
            return None

    def _read(self, version: str) -> bool:
        assert self.plans is not None
        try:
            plan = self.plans.read()
        except Exception as exc:  # noqa: BLE001 - PlanError, a store error, or worse: the node keeps its plan
            self._plan_error(version, exc)
            return False
        self._version = version
        self.figures.last_version = version
        if plan is None:
            return False
        self.plan, self._previous = plan, self.plan
        return True

    def _plan_error(self, version: str | None, exc: BaseException) -> None:
        self.figures.plan_errors += 1
        self.figures.bad_version = version  # not read again until a newer one is published
        self.figures.last_error = str(exc)[:500]
        log.error("kvwarm agent: the plan (version %s) is not usable: %s; the node keeps its last good plan",
                  version, self.figures.last_error)
        if self.on_plan_error is not None:
            self.on_plan_error(self.figures.last_error)

    def _chains(self) -> list[PlanChain[K]]:
        """The plan's chains on this node; a plan the hands cannot take is a plan error, and the
        node goes on without it (with the fleet's memory)."""
        while self.plan is not None:
            try:
                return self.hands.plan_chains(self.plan)
            except Exception as exc:  # noqa: BLE001 - a plan that passed its checks but not the node's
                self._plan_error(self._version, exc)
                self.plan, self._previous = self._previous, None  # back to the last good plan, if any
        return []

    def _apply(self, now: float, *, others_only: bool) -> Warmup[K]:
        chains = self._chains()
        plan = self.plan
        uses: Sequence[UseLike[K]] = ()
        if self.settings.fleet_memory:
            uses = self.hands.fleet(now - self.settings.fleet_window_s, others_only=others_only)
        curve = curve_of(plan)
        warm = rank(chains, uses, curve=curve, held=self.hands.held(), capacity=self.hands.capacity(),
                    copy_s=self.hands.copy_s(), min_value=self.settings.min_value,
                    horizon_s=horizon_of(plan, curve))
        self.hands.retain(warm.priority)
        self.hands.prefetch(warm.order)
        if plan is not None:
            self.figures.plans_applied += 1
        self.figures.copies_queued += len(warm.order)
        self.figures.last = {**warm.sources(), "copies": len(warm.order), "dropped": warm.dropped}
        log.info("kvwarm agent: plan %s: %d blocks wanted (%s), %d to copy, %d left out",
                 self._version or "none", len(warm.wanted), warm.sources(), len(warm.order), warm.dropped)
        if self.listener is not None:
            self.listener(warm)
        return warm


def curve_of(plan: Plan | PublishedPlan | None) -> ReuseCurve:
    """The fleet reuse curve the plan carries (``extra["fleet_reuse"]``), else the default prior."""
    doc = plan.extra.get("fleet_reuse") if plan is not None else None
    if doc is None:
        return ReuseCurve()
    try:
        return ReuseCurve.from_json(doc)
    except (ConfigError, TypeError, ValueError, AttributeError, KeyError) as exc:
        log.warning("kvwarm agent: the plan's fleet_reuse is not usable (%s); the default prior is used", exc)
        return ReuseCurve()


def horizon_of(plan: Plan | PublishedPlan | None, curve: ReuseCurve) -> float:
    """The horizon of the plan's ``expected_hits`` (``extra["horizon_s"]``), else the curve's."""
    h = plan.extra.get("horizon_s") if plan is not None else None
    return float(h) if isinstance(h, (int, float)) and not isinstance(h, bool) and 0 < h < float("inf") else (
        curve.horizon_s or DEFAULT_HORIZON_S)


class StorePlans:
    """The plan last published to a store's tiers (:func:`store.published_plan.publish_plan`): keys, no prompts."""

    def __init__(self, tiers: Sequence[Any]) -> None:
        self.tiers = list(tiers)

    def version(self) -> str | None:
        return latest_plan_version(self.tiers)

    def read(self) -> PublishedPlan | None:
        return latest_plan(self.tiers)


class FilePlan:
    """A plan file; its version is its modification time and size (a file replaced atomically
    by ``write_plan`` gets a new one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def version(self) -> str | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return f"{st.st_mtime_ns}:{st.st_size}"

    def read(self) -> Plan | None:
        return read_plan(self.path)


class AgentThread:
    """Runs agents (one per loader of an engine) on one thread of their own for a node's life:
    each :meth:`NodeAgent.start`, then :meth:`NodeAgent.tick` when its next poll is due. It
    never raises into the serving path: an error in a step is logged and the next step tried."""

    def __init__(self, agents: Sequence[NodeAgent[Any]], *, name: str = "kvwarm-agent") -> None:
        self.agents = list(agents)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "AgentThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        lower_this_thread()  # ranking and fleet reads yield the cores to the forward
        started = False
        while not self._stop.is_set():
            for agent in self.agents:
                if self._stop.is_set():
                    return
                try:
                    agent.tick() if started else agent.start()
                except Exception:  # noqa: BLE001 - the node serves on without the agent's step
                    log.exception("kvwarm agent: a step failed; the node keeps what it has")
            started = True
            due = min((a.next_poll() - a.clock() for a in self.agents), default=1.0)
            self._stop.wait(max(0.05, due))

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the current step (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
