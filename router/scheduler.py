"""Which requests run the next round: a plan from ids and counts, no engine call.

The router (router/loop.py) asks once per turn of its loop, with each running request's
committed length and order of first admission, each waiting request's committed length and
whether it resumes, and the ids an engine still holds. The plan says:

- `admit`: waiting requests to prefill now, first come first served: the queue is taken in
  order and stops at the first request that does not fit both KV pools beside the running ones
  (router/capacity.py), whose id an engine still holds, or past `max_running`;
- `fail_waiting`: waiting requests that can never fit, even alone (they end with
  RESOURCE_EXHAUSTED), met in the queue before it stops;
- `preempt`: running requests to take out until the next round fits both pools, the most
  recently admitted first. The router frees their KV on both sides, keeps their committed
  tokens and requeues them ahead of new requests; resumed, they are admitted at their committed
  length. `fail_running`: the last running request, when it alone outgrows the pools
  (RESOURCE_EXHAUSTED).

Admission is judged against the running requests as they are: when they do not fit, nothing is
admitted (requests are preempted instead), so a plan never both admits and preempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.capacity import KvBudget


@dataclass(frozen=True)
class Running:
    request_id: str
    committed_len: int
    admit_seq: int          # order of first admission


@dataclass(frozen=True)
class Waiting:
    request_id: str
    committed_len: int      # the prompt, or a preempted request's prompt and tokens
    resuming: bool = False  # preempted: admitted at its committed length (else with its first token)


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)                      # in queue order
    fail_waiting: list[tuple[str, str]] = field(default_factory=list)   # (request id, why it can never fit)
    preempt: list[str] = field(default_factory=list)                    # the latest admitted first
    fail_running: list[tuple[str, str]] = field(default_factory=list)   # (request id, why), at most one


class Scheduler:
    def __init__(self, kv: KvBudget, max_running: int):
        self.kv, self.max_running = kv, max_running

    def plan(self, running: list[Running], waiting: list[Waiting], held: set[str] = frozenset()) -> Plan:
        """`held`: ids an engine still holds (a request using one waits until it is released)."""
        plan = Plan()
        lens = [r.committed_len for r in running]
        for w in waiting:
            if len(running) + len(plan.admit) >= self.max_running:
                break
            need = self.kv.need(w.committed_len if w.resuming else w.committed_len + 1)
            why = self.kv.never_fits(need)
            if why is not None:
                plan.fail_waiting.append((w.request_id, why))
                continue
            if w.request_id in held or not self.kv.fits(lens, need):
                break   # first come, first served: later requests wait behind this one
            plan.admit.append(w.request_id)
            lens.append(w.committed_len)
        left = sorted(running, key=lambda r: r.admit_seq)
        while left and not self.kv.fits([r.committed_len for r in left]):
            if len(left) == 1:
                why = self.kv.never_fits(self.kv.need(left[0].committed_len)) or "the KV pools cannot hold it"
                plan.fail_running.append((left[0].request_id, why))
                break
            plan.preempt.append(left.pop().request_id)
        return plan
