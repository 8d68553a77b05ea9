"""The router's links to a verifier actor and a drafter actor on a Ray cluster.

Handles are object refs: a DraftHandle's payload is the ref of the drafter's DraftTree, passed
unresolved to the verifier's `verify` (Ray resolves it there), or a TreeRoute when the trees go
actor to actor over the tree channel (spectandem/channel/trees.py); every `features` the verifier
returns is the ref of a tensor in the object store, passed on inside the drafter's items (or,
with a direct feature channel, a ChannelRef: spectandem/channel.py). The router awaits only
small results (ids, tokens, counts, refs).

Errors, mapped in one place (`_call`): the actor died, is restarting or is unreachable, a call
timed out, or the engine failed inside -> EngineUnavailable; a ValueError or KeyError raised by
the engine (StaleMessage included) -> re-raised as itself.

Calls are at most once (max_task_retries 0): verify, draft and extend change KV state, so a
blind retry would corrupt it; the router retries with epochs instead. Both actors restart when
their process dies (max_restarts -1). The drafter restarts empty and says so through `extend`.
The verifier's KV is the requests' truth: its calls in flight fail (EngineUnavailable), the
router fails its requests with UNAVAILABLE and serves again once it answers; a restarted
verifier refuses any call about a request it did not prefill itself (VerifierActor._check_held),
so no result of it is ever applied to a request whose KV was lost. It is built with the feature
layers already resolved (as the verifier service resolves them), since a restart re-runs its
constructor with the same arguments.

An actor whose constructor fails at start (a broken checkpoint, no memory for its KV) ends
`start_engines` at once with EngineStartError and the actor's own error.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from drafter.actor import DrafterActor
from router.links import RAY_CALL_TIMEOUT_S, EngineStartError, EngineUnavailable
from spectandem.config import EngineConfig, GpuPaths, SpecConfig
from spectandem.channel import NCCL_ERROR_HANDLING
from spectandem.memory import shared_gpu_configs
from spectandem.devices import DEFAULT_DTYPE
from spectandem.messages import DraftTree
from spectandem.protocol import (AheadReply, DraftHandle, DrafterPrefillItem, EngineInfo, ExtendItem, PlainItem,
                                 Tag, Verdict, VerifierPrefillItem, VerifierPrefillResult)
from verifier.actor import VerifierActor

log = logging.getLogger("spectandem.router")


def ray_init(address: str | None, num_cpus: int | None = None) -> None:
    """Joins the cluster at `address` ("auto": the one this node belongs to), or starts a local
    one when None. Does nothing when Ray is already initialized. A local cluster gets the CUDA
    GPUs this process sees, counted here rather than by Ray's own probe: serve places the engines
    by the cluster's count, and a count of 0 would put the target on the CPU."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        from spectandem.devices import cuda_gpus

        gpus = cuda_gpus() or None   # none: Ray's probe (CUDA_VISIBLE_DEVICES, NVML) decides
        # "local" explicitly: never join whatever RAY_ADDRESS the environment happens to name.
        # A GCS that never writes its port file fails ray.init (seen now and then in the test suite
        # on a 2-core machine; the cause is not known): the start is tried once more.
        for attempt in (1, 2):
            try:
                ray.init(address="local", num_cpus=num_cpus, num_gpus=gpus, include_dashboard=False,
                         log_to_driver=False)
                return
            except RuntimeError as exc:
                if attempt == 2 or "Timed out waiting for file" not in str(exc):
                    raise
                log.warning("the local Ray cluster did not come up (%s); starting it again", exc)
                ray.shutdown()


def gcs_reachable(timeout_s: float = 1.0) -> bool:
    """Whether the cluster's GCS accepts a connection. Any Ray call to a GCS that is gone waits
    for it for a minute and then ends the process: a SIGTERM to the process group (`timeout`,
    systemd) ends a local cluster's processes as well as this one, so shutdown checks first."""
    import socket

    try:
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except Exception:
        return False


async def _call(ref, role: str, timeout_s: float | None):
    """Awaits one actor call, mapping Ray's failures to the link errors."""
    try:
        return await asyncio.wait_for(_awaited(ref), timeout_s)
    except ray.exceptions.RayTaskError as exc:  # raised inside the actor's method
        cause = exc.cause
        if isinstance(cause, (ValueError, KeyError)):
            raise cause from exc  # StaleMessage stays a StaleMessage
        raise EngineUnavailable(f"{role} failed: {cause!r}") from exc
    except ray.exceptions.RayError as exc:  # died, restarting, unreachable, its objects lost
        raise EngineUnavailable(f"{role} is unavailable: {type(exc).__name__}: {exc}") from exc
    except asyncio.TimeoutError as exc:
        raise EngineUnavailable(f"{role} did not answer within {timeout_s} s") from exc


async def _awaited(ref):
    return await ref


class RayVerifierLink:
    def __init__(self, actor, call_timeout_s: float | None = RAY_CALL_TIMEOUT_S, hands_verdicts: bool = False):
        """`hands_verdicts`: the actors have a tree channel, over which the verifier sends the
        verdicts a verify's `draft_next` names to the drafter (router/links.py)."""
        self.actor, self.call_timeout_s, self.hands_verdicts = actor, call_timeout_s, hands_verdicts

    def _call(self, ref):
        return _call(ref, "verifier", self.call_timeout_s)

    async def prefill(self, items: list[VerifierPrefillItem], want_features: bool) -> list[VerifierPrefillResult]:
        return await self._call(self.actor.prefill.remote(items, want_features))

    async def verify(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                     on_launch=None, draft_next: dict[str, int] | None = None) -> list[Verdict]:
        if on_launch is not None:
            on_launch()   # the verifier is another process: nothing here to wait for
        tree_ref, tags = (draft.payload, list(draft.tags)) if draft is not None else (None, [])
        return await self._call(self.actor.verify.remote(tree_ref, tags, plain, want_features, draft_next))

    async def verify_prefill(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                             items: list[VerifierPrefillItem], prefill_features: bool,
                             on_launch=None, draft_next: dict[str, int] | None = None,
                             ) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
        if on_launch is not None:
            on_launch()
        tree_ref, tags = (draft.payload, list(draft.tags)) if draft is not None else (None, [])
        return await self._call(self.actor.verify_prefill.remote(tree_ref, tags, plain, want_features, list(items),
                                                                 prefill_features, draft_next))

    async def features(self, tag: Tag):
        return await self._call(self.actor.features.remote(tag))

    async def release(self, request_ids: list[str]) -> None:
        await self._call(self.actor.release.remote(list(request_ids)))

    async def info(self) -> EngineInfo:
        return await self._call(self.actor.info.remote())

    async def ping(self) -> bool:
        return await self._call(self.actor.ping.remote())

    async def close(self) -> None:
        return None  # the actors belong to start_engines' cleanup


class RayDrafterLink:
    def __init__(self, actor, call_timeout_s: float | None = RAY_CALL_TIMEOUT_S):
        self.actor, self.call_timeout_s = actor, call_timeout_s

    def _call(self, ref):
        return _call(ref, "drafter", self.call_timeout_s)

    async def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        return await self._call(self.actor.prefill.remote(items))

    async def draft(self, tags: list[Tag], num_steps: list[int | None] | None = None,
                    extend: list[ExtendItem] = (), post_round: int = 0) -> DraftHandle:
        tree_ref, done = self.actor.draft.remote(list(tags), num_steps, list(extend), post_round)
        known, unknown, posted = await self._call(done)  # raises as the draft failed; the tree itself stays in Ray
        return DraftHandle(list(known), tree_ref if known and not posted else None, list(unknown), posted)

    async def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem] = ()) -> AheadReply:
        return await self._call(self.actor.draft_ahead.remote(list(tags), list(extend)))

    def ready_handle(self, tree: DraftTree, tags: list[Tag]) -> DraftHandle:
        return DraftHandle(list(tags), tree)   # the verifier actor takes the tree itself as well as a ref

    async def extend(self, items: list[ExtendItem]) -> list[str]:
        return await self._call(self.actor.extend.remote(items))

    async def release(self, request_ids: list[str], keep_draft: bool = False,
                      outputs: dict[str, list[int]] | None = None) -> None:
        await self._call(self.actor.release.remote(list(request_ids), keep_draft, outputs))

    async def info(self) -> EngineInfo:
        return await self._call(self.actor.info.remote())

    async def ping(self) -> bool:
        return await self._call(self.actor.ping.remote())

    async def close(self) -> None:
        return None


def bundle_plan(gpus: int, num_actors: int, on_gpu: bool) -> tuple[list[dict], str]:
    """The placement group for `num_actors` engine actors -> (one bundle per actor, strategy).
    On the CPU: a CPU each (PACK). On GPUs (STRICT_PACK: one node, so features move over its
    shared memory or NVLink): a GPU each when the cluster has one per actor, else the actors
    share one GPU, each bundle holding an equal fraction of it."""
    if not on_gpu:
        return [{"CPU": 1} for _ in range(num_actors)], "PACK"
    if gpus < 1:
        raise ValueError("device 'cuda' needs a GPU; the cluster has none")
    share = 1 if gpus >= num_actors else 1 / num_actors
    return [{"GPU": share, "CPU": 1} for _ in range(num_actors)], "STRICT_PACK"


def _placement(num_actors: int, device: str, timeout_s: float):
    """A ready placement group of one bundle per actor (bundle_plan), and the bundles."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    bundles, strategy = bundle_plan(gpus, num_actors, device == "cuda" or (device == "auto" and gpus > 0))
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise EngineUnavailable(f"no room for {num_actors} bundles of {bundles[0]} within {timeout_s} s "
                                f"(cluster: {ray.cluster_resources()})") from None
    return pg, bundles


def actor_start_error(exc: Exception) -> str:
    """What an actor whose constructor raised said, as one line: Ray hands the error on as the
    remote traceback's text only, whose last line is the exception's; a ValueError (a flag or
    input the engine refused) is its message alone. Any other death: Ray's own text."""
    text = getattr(exc, "error_msg", None) or str(exc)
    if getattr(exc, "_actor_init_failed", False):
        for line in reversed(text.strip().splitlines()):
            m = _EXCEPTION_LINE.match(line.strip())
            if m:
                return m.group(2) if m.group(1) == "ValueError" else f"{m.group(1)}: {m.group(2)}"
    return str(exc)


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (.+)$")


def start_engines(target_dir: str | Path, draft_dir: str | Path | None, cfg: SpecConfig, max_slots: int,
                  max_len: int | None, device: str = "auto", *, dtype=DEFAULT_DTYPE,
                  force_hf_target: bool = False, call_timeout_s: float | None = RAY_CALL_TIMEOUT_S,
                  startup_timeout_s: float = 300.0, num_threads: int = 1, kv_blocks: int | None = None,
                  draft_kv_blocks: int | None = None, block_size: int = 16, gpu: GpuPaths | None = None,
                  gpu_memory_utilization: float = 0.9, cpu_kv_cache_gib: float | None = None,
                  feature_channel: str | None = None, tree_channel: bool = False, draft_on_verdict: bool = False,
                  cpu_cores: dict[str, list[int]] | None = None, drafter_threads: int | None = None,
                  one_thread_up_to: int = 0, one_thread_cores: list[int] | None = None,
                  ) -> tuple[RayVerifierLink, RayDrafterLink | None, Callable[[], None]]:
    """Places a verifier actor (and a drafter actor unless cfg.method is "none") in one
    placement group, one bundle each, and waits until they are built.

    device: "cuda" gives each actor a GPU, or with fewer GPUs than actors a share of one
    (bundle_plan); "cpu" places CPU-only bundles; "auto" picks "cuda" when the cluster has a GPU. Returns the links and a cleanup that kills both actors
    and frees the placement group. Ray must be initialized (ray_init).

    feature_channel: "auto" (a free port on the verifier's node) or tcp://HOST:PORT opens the
    direct feature channel between the two actors once both are built (None: object refs).
    tree_channel: also open the tree channel between them (a free port of the verifier's node);
    draft_on_verdict: and have the verifier send a round's verdicts to the drafter over it, where
    the router asks (drafter/next_trees.py). cpu_cores: the cores each actor's process is bound
    to ({"verifier": [...], "drafter": [...]}; serve --cpu-bind), where the actors run on this
    machine's CPU; None: left to the kernel. drafter_threads: the drafter actor's torch threads
    (default: num_threads, the verifier's). one_thread_up_to, one_thread_cores: the verifier's
    forwards of at most that many tokens on one torch thread bound to those cores
    (spectandem.devices.SmallForwards; serve gives the drafter's)."""
    if not ray.is_initialized():
        raise ValueError("Ray is not initialized: call ray_init(address) first")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    num_actors = 1 if cfg.method == "none" else 2
    pg, bundles = _placement(num_actors, device, startup_timeout_s)
    on_gpu = "GPU" in bundles[0]

    threads = [num_threads, drafter_threads or num_threads]   # the verifier's, the drafter's

    def options(index: int, max_restarts: int) -> dict:
        return dict(num_cpus=1, num_gpus=bundles[index].get("GPU", 0), max_restarts=max_restarts, max_task_retries=0,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads[index]), **NCCL_ERROR_HANDLING}},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index))

    engine_device = "cuda" if on_gpu else "cpu"
    target_dir = str(target_dir)
    actors = []

    def cleanup() -> None:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)

    try:
        # Both load at once (each holds the target); the drafter's head then decides which
        # target features the verifier returns.
        from spectandem.feature_layers import resolve_feature_layers

        layers = resolve_feature_layers(None, cfg.method, draft_dir, target_dir) if num_actors == 2 else None
        config = EngineConfig(target_dir=target_dir, draft_dir=None if draft_dir is None else str(draft_dir), spec=cfg,
                              max_slots=max_slots, max_len=max_len, dtype=str(dtype).removeprefix("torch."),
                              device=engine_device, kv_blocks=kv_blocks, draft_kv_blocks=draft_kv_blocks,
                              block_size=block_size, gpu=gpu or GpuPaths(), force_hf_target=force_hf_target,
                              gpu_memory_utilization=gpu_memory_utilization, cpu_kv_cache_gib=cpu_kv_cache_gib)
        # Both on engine_device: the drafter's share of its memory, the verifier's rest.
        verifier_config, drafter_config = shared_gpu_configs(config)
        verifier = VerifierActor.options(**options(0, -1)).remote(
            verifier_config, layers, model_name=Path(target_dir).name, num_threads=num_threads,
            cpu_cores=(cpu_cores or {}).get("verifier"), one_thread_up_to=one_thread_up_to,
            one_thread_cores=one_thread_cores)
        actors.append(verifier)
        drafter = None
        role = "drafter"
        if num_actors == 2:
            drafter = DrafterActor.options(**options(1, -1)).remote(
                drafter_config, model_name=Path(draft_dir).name if draft_dir else cfg.method, num_threads=threads[1],
                cpu_cores=(cpu_cores or {}).get("drafter"))
            actors.append(drafter)
            info = ray.get(drafter.info.remote(), timeout=startup_timeout_s)
            role = "verifier"
            ray.get(verifier.set_feature_layers.remote(info.feature_layers), timeout=startup_timeout_s)
            if feature_channel:
                # Both ends connect in background threads: neither call waits for the other.
                address = ray.get(verifier.open_feature_channel.remote(
                    None if feature_channel == "auto" else feature_channel), timeout=startup_timeout_s)
                ray.get(drafter.open_feature_channel.remote(address), timeout=startup_timeout_s)
            if tree_channel:
                address = ray.get(verifier.open_tree_channel.remote(), timeout=startup_timeout_s)
                ray.get(drafter.open_tree_channel.remote(address), timeout=startup_timeout_s)
        role = "verifier"
        ray.get(verifier.ping.remote(), timeout=startup_timeout_s)
    except ray.exceptions.RayActorError as exc:
        cleanup()
        raise EngineStartError(f"the {role} actor failed to start: {actor_start_error(exc)}") from None
    except Exception:
        cleanup()
        raise
    hands = tree_channel and draft_on_verdict and drafter is not None
    return (RayVerifierLink(verifier, call_timeout_s, hands_verdicts=hands),
            None if drafter is None else RayDrafterLink(drafter, call_timeout_s), cleanup)
