"""The Ray executor: each worker is a Ray actor hosting one runner, anywhere on a Ray cluster.

Owns: joining a Ray cluster (``address``) or starting a local one (with Ray's node
health checks tightened), one actor per worker (:class:`RayWorker`: one GPU each when
the cluster has GPUs, else a CPU share, plus any custom resources; placed with Ray's
``SPREAD`` strategy, never pinned to a node, so a replacement lands on any live node
with room), carrying calls as actor tasks awaited on the event loop through their
futures, and noticing deaths: a call that fails because its actor is gone, or a
liveness ping that does not come back within ``ping_timeout_s``, ends the worker's life
(the base's death path: ``worker_died``, reported once).

Call order: :class:`RayWorker` is a synchronous actor whose default concurrency group
has one thread, created with ``allow_out_of_order_execution=False``; Ray runs the tasks
one caller submits to such an actor in submission order, and this executor submits
every call of a worker from the event loop's thread, in the order the engine made
them. Pings run in a concurrency group of their own (``health``), so a ping answers
while a step computes and never reorders runner calls.

Ray is imported lazily (:func:`_ray`), only when this executor starts: importing
worldserve, the server or the other executors never imports it.

Must not know: sessions, batching, routing, what the model computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from worldserve.models.base import ModelSpec
from worldserve.protocol import TickRequest
from worldserve.runtime.errors import RuntimeClosedError, WorkerDiedError, WorkerStartError
from worldserve.runtime.executor.abstract import Executor, Life, post
from worldserve.runtime.messages import WorkerConfig
from worldserve.runtime.runner import STEP
from worldserve.runtime.wire import decode_ticks, encode_ticks
from worldserve.runtime.worker import Reply, answer, build_runner, limit_threads

__all__ = ["LOCAL_SYSTEM_CONFIG", "RayExecutor", "RayWorker"]

_log = logging.getLogger(__name__)

#: Ray's system configuration when this executor starts a local Ray (for a cluster, pass the
#: same to ``ray start --head --system-config``, see docs/deploy.md):
#: node health checks every second, a node silent for 3 declared dead (Ray's defaults: ~15 s;
#: the executor's pings bound detection anyway, but until Ray declares the node dead it may
#: place a replacement there); and a step's reply (its frames) up to 4 MiB goes straight
#: back to the caller instead of through Ray's object store (Ray's default: 100 KiB).
LOCAL_SYSTEM_CONFIG: Mapping[str, int] = {
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "max_direct_call_object_size": 4 * 2**20,
}

_HEALTH_GROUP = "health"


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:  # pragma: no cover - depends on the extra
        raise WorkerStartError("executor 'ray' needs Ray: pip install 'worldserve[ray]' (or ray[default]).") from error
    return ray


def _init_keeping_signals(ray: ModuleType, kwargs: dict[str, Any]) -> None:
    """``ray.init`` (once per process, on the loop's thread, as Ray wants), keeping this process's
    SIGTERM/SIGINT handlers: Ray's own SIGTERM handler exits at once, which would cut short a
    server's graceful shutdown (closing sessions, then the workers)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        ray.init(**kwargs)
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class RayWorker:
    """The actor's body: one runner, answering calls in order (made remote by :class:`RayExecutor`)."""

    def __init__(self, config: WorkerConfig, index: int) -> None:
        if config.cpu_threads is not None:
            limit_threads(config.cpu_threads)
        self._index = index
        self._runner = build_runner(config, index)

    def ready(self) -> tuple[ModelSpec, int, str]:
        """The model's spec, this actor's pid and its Ray node id."""
        return self._runner.spec, os.getpid(), _ray().get_runtime_context().get_node_id()

    def call(self, method: str, args: tuple[Any, ...]) -> Reply:
        return answer(self._runner, method, args, self._index)

    def step(self, rows: Sequence[tuple[Any, ...]]) -> Reply:
        return answer(self._runner, STEP, (decode_ticks(rows),), self._index)

    def ping(self) -> bool:
        return True


class _PlacementLost(Exception):
    """An actor died before it was ready, not because its model failed to load (its node was lost)."""


class _Actor:
    """One life of one worker as Ray sees it."""

    __slots__ = ("handle", "life", "node", "pid")

    def __init__(self, life: Life, handle: Any) -> None:
        self.life = life
        self.handle = handle
        self.node: str | None = None
        self.pid: int | None = None


class RayExecutor(Executor):
    """Workers as Ray actors (``RuntimeConfig(executor="ray")``)."""

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int = 1,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        resources: Mapping[str, float] | None = None,
        ping_interval_s: float = 1.0,
        ping_timeout_s: float = 3.0,
        start_timeout: float = 300.0,
        retry_s: float = 1.0,
    ) -> None:
        super().__init__(config, num_workers)
        self._address = address
        self._num_cpus = num_cpus
        self._num_gpus = num_gpus
        self._resources = dict(resources or {})
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._start_timeout = start_timeout
        self._retry_s = retry_s
        self._actors: list[_Actor | None] = [None] * num_workers
        self._remote: Any = None  # the actor class made remote, with its options
        self._started_ray = False
        self._pinger: asyncio.Task[None] | None = None

    # -- starting ----------------------------------------------------------------------

    async def start(self) -> None:
        self._bind_loop()
        ray = _ray()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": self._address, "log_to_driver": True}
            if self._address is None:  # a local Ray of our own
                kwargs.update(include_dashboard=False, _system_config=dict(LOCAL_SYSTEM_CONFIG))
                self._started_ray = True
            _init_keeping_signals(ray, kwargs)
        gpus = self._num_gpus
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        actor_class = ray.remote(concurrency_groups={_HEALTH_GROUP: 1})(RayWorker)
        self._remote = actor_class.options(
            num_cpus=self._num_cpus,
            num_gpus=gpus,
            resources=self._resources,
            scheduling_strategy="SPREAD",
            max_concurrency=1,
            allow_out_of_order_execution=False,
            max_restarts=0,  # a replacement is a new life, started by restart(), with an empty runner
            max_task_retries=0,
        )
        try:
            await asyncio.gather(*(self._place(index, self._start_timeout) for index in range(self.num_workers)))
        except BaseException:
            await self.shutdown()
            raise
        self._pinger = asyncio.ensure_future(self._ping_forever())

    async def restart(self, worker: int) -> None:
        """Start a replacement wherever Ray finds room; with none, wait until a node joins.

        Only a model that cannot load raises (``WorkerStartError``); see :meth:`_place`.
        """
        if self._closed:
            raise RuntimeClosedError("the executor is shut down.")
        self.kill(worker)
        await self._place(worker, None)

    async def _place(self, index: int, timeout: float | None) -> None:
        """Start worker ``index`` within ``timeout`` seconds (None: however long it takes).

        An actor lost before it was ready (Ray placed it on a node that was dying and not
        yet declared dead) is started again after ``retry_s``, at start as for a
        replacement: one dying node must not fail the whole start.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await self._launch(index, remaining)
                return
            except _PlacementLost as lost:
                _log.warning("worker %d: %s; starting another in %g s", index, lost, self._retry_s)
            if deadline is not None and loop.time() + self._retry_s >= deadline:
                raise WorkerStartError(f"worker {index} was lost before it was ready until its start timed out.")
            await asyncio.sleep(self._retry_s)
            if self._closed:
                raise RuntimeClosedError("the executor is shut down.")

    async def _launch(self, index: int, timeout: float | None) -> None:
        ray = _ray()
        actor = _Actor(self._begin_life(index), self._remote.remote(self.config, index))
        self._actors[index] = actor
        try:
            spec, actor.pid, actor.node = await asyncio.wait_for(self._await(actor.handle.ready.remote()), timeout)
        except TimeoutError:
            ray.kill(actor.handle, no_restart=True)
            raise WorkerStartError(
                f"worker {index} was not placed and ready within {timeout:g} s (does the cluster have room: "
                f"{self._num_cpus:g} CPU, {self._num_gpus} GPU, {self._resources}?)."
            ) from None
        except asyncio.CancelledError:
            ray.kill(actor.handle, no_restart=True)
            raise
        except ray.exceptions.RayActorError as error:
            ray.kill(actor.handle, no_restart=True)
            if not error.actor_init_failed:
                raise _PlacementLost(f"it was lost before it was ready ({type(error).__name__})") from None
            raise WorkerStartError(f"worker {index} could not start: {type(error).__name__}: {error}") from error
        except Exception as error:
            ray.kill(actor.handle, no_restart=True)
            raise WorkerStartError(f"worker {index} could not start: {type(error).__name__}: {error}") from error
        if actor.life.closing:
            raise RuntimeClosedError("the executor is shut down.")
        self._life_ready(actor.life, spec)
        _log.info("worker %d: Ray actor pid %s on node %s", index, actor.pid, actor.node)

    # -- calls -------------------------------------------------------------------------

    def _send(self, worker: int, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        actor = self._current(worker)
        self._track(actor, request_id, actor.handle.call.remote(method, args))

    def _send_step(self, worker: int, request_id: int, ticks: Sequence[TickRequest]) -> None:
        actor = self._current(worker)
        self._track(actor, request_id, actor.handle.step.remote(encode_ticks(ticks)))

    def _current(self, worker: int) -> _Actor:
        actor = self._actors[worker]
        assert actor is not None  # the base sends only to a live worker
        return actor

    def _track(self, actor: _Actor, request_id: int, ref: Any) -> None:
        loop = self._require_loop()
        ref.future().add_done_callback(lambda done: post(loop, self._settle, actor, request_id, done))

    def _settle(self, actor: _Actor, request_id: int, done: concurrent.futures.Future[Reply]) -> None:
        if done.cancelled():
            self._lost(actor, "a call to its Ray actor was cancelled")
            return
        error = done.exception()
        if error is None:
            self._deliver(actor.life, request_id, done.result())
        elif isinstance(error, _ray().exceptions.RayActorError):
            self._lost(actor, f"its Ray actor is gone ({type(error).__name__})")
        else:  # e.g. a reply Ray could not carry: this call fails, the worker lives on
            self._deliver(actor.life, request_id, (False, ("runtime_error", f"worker {actor.life.index}: {error}")))

    async def _await(self, ref: Any) -> Any:
        return await asyncio.wrap_future(ref.future())

    # -- liveness ----------------------------------------------------------------------

    async def _ping_forever(self) -> None:
        """Ping every live actor each ``ping_interval_s``; one silent for ``ping_timeout_s`` is dead.

        Ray notices a dead actor process at once, but a vanished node only when its health
        checks give up; the pings bound that, also for an idle worker.
        """
        while not self._closed:
            await asyncio.sleep(self._ping_interval_s)
            live = [actor for actor in self._actors if actor is not None and actor.life.alive]
            await asyncio.gather(*(self._ping(actor) for actor in live))

    async def _ping(self, actor: _Actor) -> None:
        ref = actor.handle.ping.options(concurrency_group=_HEALTH_GROUP).remote()
        try:
            await asyncio.wait_for(self._await(ref), self._ping_timeout_s)
        except TimeoutError:
            self._lost(actor, f"its Ray actor did not answer a ping within {self._ping_timeout_s:g} s")
        except Exception as error:
            self._lost(actor, f"its Ray actor is gone ({type(error).__name__})")

    def _lost(self, actor: _Actor, why: str) -> None:
        if actor.life.ended:
            return
        if not self._closed:
            _ray().kill(actor.handle, no_restart=True)  # fail closed: a silent actor never comes back
        where = f"pid {actor.pid} on node {actor.node}" if actor.node else "not placed yet"
        self._life_lost(
            actor.life,
            WorkerDiedError(
                f"worker {actor.life.index} ({where}) died: {why}; the session states it held are lost, "
                "reset the session to start over."
            ),
        )

    # -- the rest of the contract ------------------------------------------------------

    def kill(self, worker: int) -> None:
        actor = self._actors[worker]
        if actor is not None:
            self._lost(actor, "killed")

    def pid(self, worker: int) -> int | None:
        """The actor's process id on its node (which may be another machine)."""
        actor = self._actors[worker]
        return None if actor is None else actor.pid

    def node_of(self, worker: int) -> str | None:
        """The Ray node id the worker's actor runs on (None: not placed)."""
        actor = self._actors[worker]
        return None if actor is None or not actor.life.alive else actor.node

    async def _stop_workers(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        ray = _ray()
        for actor in self._actors:
            if actor is not None:
                actor.life.closing = True
                ray.kill(actor.handle, no_restart=True)
        if self._started_ray:
            await self._require_loop().run_in_executor(None, ray.shutdown)
