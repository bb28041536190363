"""The Ray executor: each worker is a Ray actor hosting one runner, anywhere on a Ray cluster.

Owns: joining a Ray cluster (``address``, else ``RAY_ADDRESS``, else a ``ray start`` of this
machine; within ``connect_timeout``, off the event loop) or starting a private local one
(with Ray's node health checks tightened); in a process already connected to Ray, using that
cluster, and refusing an ``address`` that names another (Ray connects a process to one), one
actor per worker (:class:`RayWorker`: the CPUs, GPUs and custom resources it was told to
reserve; placed with Ray's ``SPREAD`` strategy, never pinned to a node, so a replacement lands
on any live node with room), carrying calls as actor tasks awaited on the event loop through their
futures, and noticing deaths: a call that fails because its actor is gone, or a
liveness ping that does not come back within ``ping_timeout_s``, ends the worker's life
(the base's death path: ``worker_died``, reported once); a head (GCS) that does not answer
within ``head_timeout`` ends every worker's life and the executor's (:attr:`Executor.lost`).

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
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
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
#: same to ``ray start --head --system-config``, see docs/deploy.md): a node health check
#: every second that gives up after one second, and a node that fails 3 in a row is dead --
#: a node that vanishes *or goes silent* (frozen, partitioned: its checks hang until their
#: timeout) is declared dead in ~3-6 s (Ray's defaults: a 10 s timeout, 5 failures, 3 s
#: apart: ~37 s for a silent node; the executor's pings fail its sessions in ~4 s anyway,
#: but until Ray declares the node dead it may place a replacement there); and a step's
#: reply (its frames) up to 4 MiB goes straight back to the caller instead of through Ray's
#: object store (Ray's default: 100 KiB).
LOCAL_SYSTEM_CONFIG: Mapping[str, int] = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
    "max_direct_call_object_size": 4 * 2**20,
}

_HEALTH_GROUP = "health"
#: How often a worker that is not placed yet says what it waits for.
_NOTICE_S = 10.0


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:  # pragma: no cover - depends on the extra
        raise WorkerStartError("executor 'ray' needs Ray: pip install 'worldserve[ray]' (or ray[default]).") from error
    return ray


def _resources(cpus: float, gpus: float, custom: Mapping[str, float]) -> str:
    extra = "".join(f", {amount:g} {name}" for name, amount in sorted(custom.items()))
    return f"{cpus:g} CPU, {gpus:g} GPU{extra}"


def _reclaim_signals() -> None:
    """Put this process's SIGTERM/SIGINT handlers back in force after ``ray.init``.

    Ray's core installs a C-level handler for fatal signals (SIGTERM among them) that
    aborts the process with a stack dump; it replaces, below Python, the handlers the
    server set (a graceful stop: close the sessions, then the workers). Setting Python's
    handlers again re-installs them. Only the main thread may set handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def _listens(address: str) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (a dead head's port refuses at once)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except (OSError, ValueError):
        return False
    return True


def _host_port(address: str) -> tuple[str, int | None]:
    """``host:port`` (``ray://`` dropped) -> (host, port or None)."""
    bare = address.removeprefix("ray://").rstrip("/")
    host, colon, port = bare.rpartition(":")
    if not colon or not port.isdigit():
        return bare.strip("[]"), None
    return host.strip("[]"), int(port)


def _ips(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _local_ip(ip: str) -> bool:
    """Whether ``ip`` is one of this machine's addresses (one a socket can bind to)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def _same_cluster(address: str, gcs_address: str) -> bool:
    """Whether ``address`` (``host:port`` or ``ray://host:port``) names the cluster whose head's GCS is
    at ``gcs_address``: the same port on the same machine (``localhost`` and this machine's own
    addresses are one machine); a ``ray://`` address (the Ray Client server's port, not the GCS's)
    by its host alone."""
    host, port = _host_port(address)
    gcs_host, gcs_port = _host_port(gcs_address)
    if not address.startswith("ray://") and port != gcs_port:
        return False
    mine, theirs = _ips(host), _ips(gcs_host)
    if mine & theirs:
        return True
    return any(_local_ip(ip) for ip in mine) and any(_local_ip(ip) for ip in theirs)


async def _off_loop(call: Callable[[], Any], timeout: float | None, *, then: Callable[[], None] | None = None) -> Any:
    """``call()`` in a daemon thread of its own, awaited for at most ``timeout`` seconds.

    Ray's blocking calls (``ray.init`` retries an address nothing answers for minutes; a
    cluster query waits on its head) never run on the event loop, so signals and the
    server's own timers keep working; a thread still blocked when the process exits does
    not hold it up (a default-executor thread would be joined at exit). ``then`` runs in the
    same thread after the result is handed over, for as long as it likes: a private local
    Ray's processes die with the thread that started them (they are started with a parent-
    death signal), so the thread that starts one lives on until it is shut down.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            result = call()
        except BaseException as error:  # handed to the awaiting task
            post(loop, settle, error, None)
            return
        post(loop, settle, None, result)
        if then is not None:
            then()

    threading.Thread(target=run, name="worldserve-ray", daemon=True).start()
    async with asyncio.timeout(timeout):
        return await done


class _PrivateRay:
    """A local Ray of this executor's own, owned by one thread from ``ray.init`` to ``ray.shutdown``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._stopped = threading.Event()

    async def start(self, ray: ModuleType, timeout: float) -> None:
        def own_until_stopped() -> None:
            self._stop.wait()
            try:
                ray.shutdown()
            finally:
                self._stopped.set()

        kwargs = {"include_dashboard": False, "_system_config": dict(LOCAL_SYSTEM_CONFIG)}
        await _off_loop(
            lambda: ray.init(address="local", log_to_driver=True, **kwargs), timeout, then=own_until_stopped
        )

    async def stop(self, timeout: float = 10.0) -> None:
        """``ray.shutdown`` in the owning thread; waits at most ``timeout`` (the process may exit anyway)."""
        self._stop.set()
        with contextlib.suppress(TimeoutError):
            await _off_loop(lambda: self._stopped.wait(timeout), timeout + 1.0)


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
        num_gpus: float = 0.0,
        resources: Mapping[str, float] | None = None,
        ping_interval_s: float = 1.0,
        ping_timeout_s: float = 3.0,
        start_timeout: float = 300.0,
        connect_timeout: float = 20.0,
        head_timeout: float = 10.0,
        retry_s: float = 1.0,
    ) -> None:
        super().__init__(config, num_workers)
        self._address = address
        self._num_cpus = num_cpus
        self._num_gpus = num_gpus
        self._connect_timeout = connect_timeout
        self._head_timeout = head_timeout
        self._head_watch: asyncio.Task[None] | None = None
        self._resources = dict(resources or {})
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._start_timeout = start_timeout
        self._retry_s = retry_s
        self._actors: list[_Actor | None] = [None] * num_workers
        self._remote: Any = None  # the actor class made remote, with its options
        self._private: _PrivateRay | None = None  # a local Ray this executor started
        self._pinger: asyncio.Task[None] | None = None

    # -- starting ----------------------------------------------------------------------

    async def start(self) -> None:
        self._bind_loop()
        ray = _ray()
        if not ray.is_initialized():
            await self._connect(ray)
        elif self._address is not None:
            await self._check_connected(ray, self._address)
        actor_class = ray.remote(concurrency_groups={_HEALTH_GROUP: 1})(RayWorker)
        self._remote = actor_class.options(
            num_cpus=self._num_cpus,
            num_gpus=self._num_gpus,
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
        self._head_watch = asyncio.ensure_future(self._watch_head())

    async def _connect(self, ray: ModuleType) -> None:
        """Join the cluster ``address`` names, else the one ``RAY_ADDRESS`` names, else the one a
        ``ray start`` on this machine runs; with none of them, start a private local Ray.

        Joining gives up after ``connect_timeout`` seconds (:class:`WorkerStartError` naming the
        address); starting a private Ray, after the start timeout. Both run off the event loop.
        """
        try:
            await self._init(ray)
        finally:
            _reclaim_signals()

    async def _init(self, ray: ModuleType) -> None:
        target = self._address or os.environ.get("RAY_ADDRESS") or None
        if target is None:
            from ray._common.utils import get_ray_address_file
            from ray._private.services import find_bootstrap_address

            # The cluster of this machine's last `ray start`: its address file, nothing else (Ray's
            # "auto" also takes any Ray it finds running here, another program's private one included).
            local: str | None = find_bootstrap_address(None)
            if local is not None:
                where = f"{local} (the cluster of this machine's last `ray start`, from {get_ray_address_file(None)})"
                if not await _off_loop(lambda: _listens(local), None):  # bounded by its own 2 s connect timeout
                    raise self._no_answer(where)
                # "auto", not the address: only then does Ray take this machine's cluster token too; with
                # that cluster up, "auto" is that cluster.
                await self._join(ray, "auto", where)
                return
            self._private = _PrivateRay()
            try:
                await self._private.start(ray, self._start_timeout)
            except TimeoutError:
                raise WorkerStartError(f"a private local Ray did not start within {self._start_timeout:g} s.") from None
            return
        await self._join(ray, target)

    async def _join(self, ray: ModuleType, address: str, where: str | None = None) -> None:
        where = where or address
        try:
            await _off_loop(lambda: ray.init(address=address, log_to_driver=True), self._connect_timeout)
        except TimeoutError:
            raise self._no_answer(where) from None
        _log.info("joined the Ray cluster at %s", where)

    async def _check_connected(self, ray: ModuleType, address: str) -> None:
        """This process is already connected to a Ray cluster (Ray connects a process to one):
        an explicit ``address`` naming another is refused, naming both; the same one is used.
        ``auto`` takes the connected cluster, said once in the log."""
        try:
            connected: str = ray.get_runtime_context().gcs_address
        except Exception:  # e.g. a Ray Client connection: no GCS address to compare
            _log.warning("ray_address=%s: this process is already connected to Ray; its workers start there", address)
            return
        if address == "auto":
            _log.info("ray_address=auto: using the Ray cluster this process is connected to, at %s", connected)
            return
        if await _off_loop(lambda: _same_cluster(address, connected), 10.0):  # names may need a DNS lookup
            _log.info("joined the Ray cluster at %s (this process was already connected to it)", address)
            return
        raise WorkerStartError(
            f"ray_address={address} names another Ray cluster than the one this process is already "
            f"connected to ({connected}), and Ray connects a process to one cluster only: call ray.shutdown() "
            f"before starting the runtime to join {address}, or pass ray_address=None to use {connected}."
        )

    def _no_answer(self, where: str) -> WorkerStartError:
        return WorkerStartError(
            f"no Ray cluster answered at {where} within {self._connect_timeout:g} s "
            "(--ray-connect-timeout-s); is the head running, and is the address right?"
        )

    async def cluster_summary(self) -> str:
        """What the cluster has, in all and free now, and its live nodes (for messages; best effort)."""
        ray = _ray()

        def read() -> str:
            total, free = ray.cluster_resources(), ray.available_resources()
            nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
            return (
                f"{total.get('CPU', 0):g} CPU, {total.get('GPU', 0):g} GPU in all; "
                f"{free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU free now; {nodes} live node(s)"
            )

        try:
            summary: str = await _off_loop(read, 5.0)
        except Exception as error:  # a slow or lost head: say so rather than wait
            return f"the cluster could not be read ({type(error).__name__})"
        return summary

    def asks(self) -> str:
        """What each worker's actor reserves, e.g. ``1 CPU, 1 GPU, 1 worldserve``."""
        return _resources(self._num_cpus, self._num_gpus, self._resources)

    async def restart(self, worker: int) -> None:
        """Start a replacement wherever Ray finds room; with none, wait until a node joins.

        Only a model that cannot load raises (``WorkerStartError``); see :meth:`_place`.
        """
        if self._closed:
            raise RuntimeClosedError("the executor is shut down.")
        if self.lost is not None:
            raise WorkerStartError(f"no worker can start: {self.lost}")
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
            spec, actor.pid, actor.node = await self._until_ready(index, actor, timeout)
        except TimeoutError:
            ray.kill(actor.handle, no_restart=True)
            raise WorkerStartError(
                f"worker {index} was not placed and ready within {timeout:g} s (--worker-start-timeout-s): "
                f"it asks for {self.asks()}; the cluster has {await self.cluster_summary()}."
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

    async def _until_ready(self, index: int, actor: _Actor, timeout: float | None) -> Any:
        """The actor's ``ready()`` answer; says every ``_NOTICE_S`` what it waits for (Ray places an
        actor only where its resources are free). ``TimeoutError`` after ``timeout``."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        ready = asyncio.ensure_future(self._await(actor.handle.ready.remote()))
        try:
            while True:
                left = None if timeout is None else timeout - (loop.time() - began)
                if left is not None and left <= 0:
                    raise TimeoutError
                wait = _NOTICE_S if left is None else min(_NOTICE_S, left)
                done, _ = await asyncio.wait({ready}, timeout=wait)
                if done:
                    return ready.result()
                if left is None or left > wait:
                    _log.warning(
                        "worker %d: not placed and ready after %.0f s; it asks for %s; the cluster has %s",
                        index,
                        loop.time() - began,
                        self.asks(),
                        await self.cluster_summary(),
                    )
        finally:
            ready.cancel()

    # -- calls -------------------------------------------------------------------------

    def _send(self, worker: int, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        actor = self._current(worker)
        self._track(actor, request_id, actor.handle.call.remote(method, args))

    def _send_step(self, worker: int, request_id: int, ticks: Sequence[TickRequest], parted: frozenset[str]) -> None:
        # An actor call answers once: its chunks come whole, so ``parted`` sessions get no parts.
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
            async with asyncio.timeout(self._ping_timeout_s):
                await self._await(ref)
        except TimeoutError:
            self._lost(actor, f"its Ray actor did not answer a ping within {self._ping_timeout_s:g} s")
        except Exception as error:
            self._lost(actor, f"its Ray actor is gone ({type(error).__name__})")

    async def _watch_head(self) -> None:
        """Ask the head (GCS) for the cluster's nodes every ``ping_interval_s``: a head that does not
        answer within ``head_timeout`` is lost, and with it every worker (the front-end's Ray
        driver cannot place, kill or replace an actor without it, and Ray ends the whole process
        about a minute later): each worker dies with ``worker_died`` and the executor is lost.
        Actor calls go straight to the actors, so the pings alone would not notice."""
        ray = _ray()
        while not self._closed and self.lost is None:
            await asyncio.sleep(self._ping_interval_s)
            try:
                await _off_loop(ray.nodes, self._head_timeout)
            except Exception as error:
                if self._closed:
                    return
                why = "no answer" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {error}"
                self._executor_lost(
                    WorkerDiedError(
                        f"the Ray head (GCS) did not answer within {self._head_timeout:g} s "
                        f"(--ray-head-timeout-s; {why}): every worker of this front-end is lost with it."
                    )
                )
                return

    def _lost(self, actor: _Actor, why: str) -> None:
        if actor.life.ended:
            return
        if not self._closed and self.lost is None:
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
        for task in (self._pinger, self._head_watch):
            if task is not None:
                task.cancel()
        ray = _ray()
        for actor in self._actors:
            if actor is not None:
                actor.life.closing = True
                if self.lost is None:  # without a head, killing an actor would wait on it
                    ray.kill(actor.handle, no_restart=True)
        if self._private is not None:
            await self._private.stop()
