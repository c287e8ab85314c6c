"""The operator's state (config, client, locks, bookkeeping) and the loops it runs beside kopf's handlers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
import kopf

from kvfleet_operator import reconcile, router_reconcile
from kvfleet_operator.autoscaling import loop
from kvfleet_operator.autoscaling.memory import Memory
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import ApiError, KubeClient
from kvfleet_operator.peering import Leadership, new_identity
from kvfleet_operator.plan import ReconcileError

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name)
Sleep = Callable[[float], Awaitable[None]]
RESYNC_CONCURRENCY = 8  # reconciles in flight at once in a resync round
_MEMO_KEY = "state"


@dataclass(frozen=True)
class Tracked:
    """An InferenceDeployment a handler saw: which object of that name, and whether its autoscaling is builtin."""

    uid: str
    builtin: bool


@dataclass(frozen=True)
class TrackedRouter:
    """An InferenceRouter a handler saw: which object of that name, and the namespaces it serves (a change of an
    InferenceDeployment's Deployment there refreshes its status)."""

    uid: str
    namespaces: tuple[str, ...]


@dataclass
class OperatorState:
    """Everything the handlers and the loops share, created once before kopf starts (__main__.py).

    kopf's handlers reconcile on events. Beside them run the loops kopf daemons used to run: one task for the
    whole operator that resyncs every object, and one autoscaling loop per builtin-mode object. Daemons were
    not an option: kopf puts a finalizer on every object that has one, which makes an InferenceDeployment
    undeletable while the operator is down or uninstalled. Handlers keep `objects` current (track() and
    forget()); a loop that finds its object gone or replaced ends by itself."""

    cfg: OperatorConfig
    kube: KubeClient
    identity: str = field(default_factory=new_identity)  # this instance's peer identity, kopf's too
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)  # one reconcile at a time per object
    reconciled: dict[str, float] = field(default_factory=dict)  # uid → event-loop time of its last reconcile
    objects: dict[Key, Tracked] = field(default_factory=dict)  # every InferenceDeployment the handlers saw
    routers: dict[Key, TrackedRouter] = field(default_factory=dict)  # every InferenceRouter the handlers saw
    memories: dict[str, Memory] = field(default_factory=dict)  # uid → its autoscaling loop's memory
    autoscalers: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # uid → its autoscaling loop
    leadership: Leadership = field(init=False)
    _resyncer: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.leadership = Leadership(self.kube, self.cfg, self.identity)

    def attach(self, memo: kopf.Memo) -> None:
        """Store this state in kopf's memo, which kopf hands (shallow-copied per object) to every handler."""
        memo[_MEMO_KEY] = self

    @staticmethod
    def of(memo: kopf.Memo) -> OperatorState:
        """The state attach() stored in a handler's memo."""
        state = memo.get(_MEMO_KEY)
        if not isinstance(state, OperatorState):
            raise RuntimeError("no operator state in kopf's memo: run the operator with kvfleet-operator")
        return state

    def start(self) -> None:
        """Start the operator-wide resync loop (from kopf's startup handler)."""
        if self._resyncer is None:
            self._resyncer = asyncio.create_task(self.run(), name="kvfleet resync")

    async def close(self) -> None:
        """Stop every loop, then close the API client (from kopf's cleanup handler)."""
        tasks = [*([self._resyncer] if self._resyncer is not None else []), *self.autoscalers.values()]
        self._resyncer = None
        self.autoscalers.clear()
        await _cancel(tasks)
        await self.kube.close()

    async def track(self, namespace: str, name: str, uid: str, *, builtin: bool) -> None:
        """Remember an InferenceDeployment a handler saw; its autoscaling loop runs exactly while it is builtin.

        Only handlers call this, which matters: the loop posts its events (ScaledUp, ...) with kopf.event, which
        needs kopf's event queue, found in a handler's context, and a task inherits the context it starts in."""
        key = (namespace, name)
        old = self.objects.get(key)
        if old is not None and old.uid != uid:
            await self.forget(namespace, name, old.uid)  # deleted and recreated under the same name
        self.objects[key] = Tracked(uid, builtin)
        if not builtin:
            # Awaited, so a round in flight cannot write the autoscaler's status after the reconcile cleared it.
            await _cancel([self.autoscalers.pop(uid)] if uid in self.autoscalers else [])
        elif uid not in self.autoscalers:
            task = asyncio.create_task(loop.run(namespace, name, uid, self), name=f"autoscaler {namespace}/{name}")
            self.autoscalers[uid] = task
            task.add_done_callback(lambda t: self._ended(uid, t))

    async def forget(self, namespace: str, name: str, uid: str) -> None:
        """Drop an InferenceDeployment that is gone or replaced: its loop, memory and bookkeeping."""
        await _cancel([self.autoscalers.pop(uid)] if uid in self.autoscalers else [])
        self.memories.pop(uid, None)
        self.reconciled.pop(uid, None)
        tracked = self.objects.get((namespace, name))
        if tracked is not None and tracked.uid == uid:
            del self.objects[namespace, name]

    def track_router(self, namespace: str, name: str, uid: str, namespaces: tuple[str, ...]) -> None:
        """Remember an InferenceRouter a handler saw, for the resync and for refreshes on its fleets' changes."""
        old = self.routers.get((namespace, name))
        if old is not None and old.uid != uid:
            self.reconciled.pop(old.uid, None)
        self.routers[namespace, name] = TrackedRouter(uid, namespaces)

    def forget_router(self, namespace: str, name: str, uid: str) -> None:
        """Drop an InferenceRouter that is gone or replaced."""
        self.reconciled.pop(uid, None)
        tracked = self.routers.get((namespace, name))
        if tracked is not None and tracked.uid == uid:
            del self.routers[namespace, name]

    def routers_serving(self, namespace: str) -> list[tuple[Key, str]]:
        """The tracked routers that serve a namespace, with their uids."""
        return [(key, t.uid) for key, t in self.routers.items() if namespace in t.namespaces]

    def _ended(self, uid: str, task: asyncio.Task[None]) -> None:
        if self.autoscalers.get(uid) is task:  # the loop ended by itself: its object is gone or replaced
            del self.autoscalers[uid]

    async def run(self, *, sleep: Sleep = asyncio.sleep) -> None:
        """The operator-wide task: a resync round every resync_seconds until cancelled."""
        while True:
            await sleep(self.cfg.resync_seconds)
            try:
                await self.resync()
            except Exception:  # nothing may end the loop that heals lost events
                log.exception("resync round failed")

    async def resync(self) -> None:
        """Reconcile every object not reconciled within the last resync_seconds / 2, so a lost or failed event
        (a Deployment event is never retried) or drift nobody was told about heals. Cheap: an unchanged object's
        applies are server-side no-ops and the status is only written when it changed. The skip is an in-memory
        idle test (kopf's `idle` would reset on every status write and never fire for an autoscaled object).
        Nothing happens while another operator instance leads: kopf pauses its handlers then, and so do we."""
        if not await self.leadership.leading():
            return
        now = asyncio.get_running_loop().time()

        def due(tracked: Mapping[Key, Tracked | TrackedRouter]) -> list[tuple[Key, str]]:
            return [(key, t.uid) for key, t in tracked.items()
                    if (last := self.reconciled.get(t.uid)) is None or now - last >= self.cfg.resync_seconds / 2]

        gate = asyncio.Semaphore(RESYNC_CONCURRENCY)
        await asyncio.gather(*(self._resync_one(ns, name, uid, gate) for (ns, name), uid in due(self.objects)),
                             *(self._resync_router(ns, name, uid, gate) for (ns, name), uid in due(self.routers)))
        try:  # grants a router deleted while the operator was down left in other namespaces
            await router_reconcile.sweep(self)
        except (ReconcileError, ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning(f"sweeping the grants of deleted InferenceRouters failed: {e}")

    async def _resync_one(self, namespace: str, name: str, uid: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                if await reconcile.reconcile_counted(namespace, name, self, "resync", uid=uid) is None:
                    await self.forget(namespace, name, uid)  # a recreated object is tracked by its handlers
            except (ReconcileError, ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning(f"resync of {namespace}/{name} failed: {e}")  # the status says why; next round retries

    async def _resync_router(self, namespace: str, name: str, uid: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                if not await router_reconcile.reconcile_router_counted(namespace, name, self, "resync", uid=uid):
                    self.forget_router(namespace, name, uid)
            except (ReconcileError, ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning(f"resync of InferenceRouter {namespace}/{name} failed: {e}")


async def _cancel(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait until they have ended."""
    pending = [t for t in tasks if t is not asyncio.current_task()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
