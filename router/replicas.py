"""Several drafter/verifier pairs behind one public server.

A replica is one `Router` over its own verifier and drafter (on Ray: its own placement group, so
the pair shares a node). `ReplicaSet` looks like a single Router to the servicer, the HTTP front
and the metrics: the same `submit` / `cancel` / `serving` / `num_active` / `counters` /
`running` / `waiting` / `listeners` surface. A request lives on one replica from submit to its
terminal event (its KV is there); replicas share nothing.

Routing: a new request goes to the serving replica with the fewest active (waiting + running)
requests; ties go round-robin, so an idle set spreads requests over every pair.
"""

from __future__ import annotations

from dataclasses import fields

from router.links import DuplicateRequest, EngineUnavailable
from router.loop import Router, RouterCounters, ServedRequest
from spectandem.config import SamplingParams

TERMINAL_EVENTS = ("finished", "failed", "cancelled")


class ReplicaSet:
    def __init__(self, replicas: list[Router]):
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica, got 0")
        self.replicas = list(replicas)
        self.on_serving_change = None            # callback(bool): any replica serving, e.g. gRPC health
        # One list object shared by every replica: a listener appended here (metrics, logs)
        # hears the events of all of them.
        self.listeners: list = [self._forget]
        for r in self.replicas:
            r.listeners = self.listeners
            r.on_serving_change = self._replica_serving_changed
        self._serving = self.serving
        self._next = 0                           # where the round-robin tie-break starts
        # id(request) -> (request, its replica), until the request's terminal event. The request
        # is held, so its id cannot be reused while the entry exists.
        self._owner: dict[int, tuple[ServedRequest, Router]] = {}

    # ------------------------------------------------------------------ Router surface

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    async def stop(self) -> None:
        for r in self.replicas:
            await r.stop()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> ServedRequest:
        if request_id and any(r.in_use(request_id) for r in self.replicas):
            raise DuplicateRequest(f"request_id {request_id!r} is already in use by a request that has not ended")
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        up = [r for r in order if r.serving]
        if not up:
            raise EngineUnavailable(f"no replica's verifier is available ({n} replicas)")
        replica = min(up, key=lambda r: r.num_active)    # min keeps the first of equals
        self._next = (self.replicas.index(replica) + 1) % n
        req = replica.submit(prompt_ids, params, request_id)
        self._owner[id(req)] = (req, replica)
        return req

    def cancel(self, req: ServedRequest) -> None:
        entry = self._owner.get(id(req))
        if entry is not None:
            entry[1].cancel(req)

    @property
    def serving(self) -> bool:
        return any(r.serving for r in self.replicas)

    @property
    def num_active(self) -> int:
        return sum(r.num_active for r in self.replicas)

    @property
    def running(self) -> list[ServedRequest]:
        return [q for r in self.replicas for q in r.running]

    @property
    def waiting(self) -> list[ServedRequest]:
        return [q for r in self.replicas for q in r.waiting]

    @property
    def counters(self) -> RouterCounters:
        """The replicas' counters summed (a fresh object per read)."""
        total = RouterCounters()
        for r in self.replicas:
            c = r.counters
            for f in fields(RouterCounters):
                mine, theirs = getattr(total, f.name), getattr(c, f.name)
                if isinstance(mine, list):       # per position: add element by element
                    mine.extend([0] * (len(theirs) - len(mine)))
                    for i, v in enumerate(theirs):
                        mine[i] += v
                elif isinstance(mine, dict):     # per key (pipeline mode)
                    for k, v in theirs.items():
                        mine[k] = mine.get(k, 0) + v
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    # ------------------------------------------------------------------ internals

    def _forget(self, event: str, req: ServedRequest, data) -> None:
        if event in TERMINAL_EVENTS:
            self._owner.pop(id(req), None)

    def _replica_serving_changed(self, _up: bool) -> None:
        now = self.serving
        if now != self._serving:
            self._serving = now
            if self.on_serving_change:
                self.on_serving_change(now)
