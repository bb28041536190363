"""One call wires it all: a model by name, its workers, the engine and the control plane.

Owns: :class:`Runtime` -- builds the executor and :class:`~worldserve.runtime.engine.Engine`
from a :class:`~worldserve.runtime.config.RuntimeConfig`, a
:class:`~worldserve.session.SessionManager` that ticks (and cancels ticks) through the
engine, validates controls with the model's spec at acceptance and coalesces the
model's continuous tracks (unless ``coalesce_controls`` is off), and a
:class:`~worldserve.lifecycle.WorkerLifecycle` over the engine's ``collective_rpc``.
Creating a session admits it at once (or refuses it); closing one through the runtime
also drops its routing.

Must not know: transports, what a model computes.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from worldserve.errors import SessionExistsError
from worldserve.lifecycle import WorkerLifecycle
from worldserve.media import FrameEncoding
from worldserve.models.base import ModelSpec, SessionOptions, SpecControlValidator
from worldserve.runtime.chunk import Chunk
from worldserve.runtime.config import RuntimeConfig
from worldserve.runtime.engine import Engine
from worldserve.runtime.errors import RuntimeClosedError, WorkerDiedError
from worldserve.runtime.executor import Executor, InprocExecutor, MultiprocExecutor
from worldserve.runtime.journal import Journals
from worldserve.runtime.messages import ChunkPart
from worldserve.runtime.metrics import Capacity, EngineStats
from worldserve.session import Session, SessionManager, SessionStateError, SessionStatus, TickConsumer
from worldserve.stats import SessionStats

__all__ = ["Runtime", "RuntimeStats"]


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """The control plane's summed session counters and the engine's counters, together."""

    sessions: SessionStats
    engine: EngineStats


class Runtime:
    """A served world model: ``async with Runtime("procedural", workers=2) as rt: ...``.

    Keyword arguments are :class:`RuntimeConfig` fields (``workers``, ``model_options``,
    ``max_sessions_per_worker``, ``memory_budget_bytes``, ``tick_deadline_s``, ...);
    or pass a whole ``config``.
    """

    def __init__(self, model: str | None = None, *, config: RuntimeConfig | None = None, **overrides: Any) -> None:
        base = config or RuntimeConfig()
        if model is not None:
            overrides["model"] = model
        self.config = dataclasses.replace(base, **overrides) if overrides else base
        self.engine = Engine(_build_executor(self.config), self.config.engine_config())
        self._manager: SessionManager[Chunk] | None = None
        #: The session journals, when ``record_dir`` is set (``worldserve replay`` reads them).
        self.journals: Journals | None = None
        self._started = False

    # -- starting and stopping ---------------------------------------------------------

    async def start(self) -> Runtime:
        """Start the workers (each loads the model) and the control plane.

        Raises ``ValueError`` (the workers stopped again) when a memory budget leaves no room for
        one session's state: such a runtime would refuse every world."""
        if self._started:
            raise SessionStateError("the runtime is already started.")
        self._started = True
        await self.engine.start()
        limits = self.engine.executor.config.limits  # what the workers were given (admission reads the same)
        if limits.capacity(self.engine.spec.state_bytes) == 0:  # a worker that holds nothing refuses every world
            await self.engine.shutdown()
            raise ValueError(
                f"a worker can hold no session: one session's state needs {self.engine.spec.state_bytes} bytes "
                f"and the memory budget is {limits.memory_budget_bytes} bytes; raise --memory-budget"
            )
        consumer: TickConsumer[Chunk] = self.engine
        if self.config.record_dir is not None:
            self.journals = Journals(self.config.record_dir, self.engine, self.spec, dict(self.config.model_options))
            consumer = self.journals
        self._manager = SessionManager(
            tick_consumer=consumer,
            lifecycle=WorkerLifecycle(self.engine, stage_ids=[0], timeout=self.config.rpc_timeout_s),
            max_pending_events=self.config.max_pending_events,
            control_validator=SpecControlValidator(self.engine.spec),
            coalesce_tracks=frozenset(self.engine.spec.continuous_tracks if self.config.coalesce_controls else ()),
        )
        return self

    async def aclose(self) -> None:
        """Close every session (releasing its state), then stop the workers."""
        if self._manager is not None:
            for session in list(self._manager):
                try:
                    await self.close_session(session.session_id)
                except Exception:  # shutting down regardless
                    self.engine.forget_session(session.session_id)
        await self.engine.shutdown()
        if self.journals is not None:
            self.journals.close_all()

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- what the server uses ------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        """The model's spec, as its workers reported it."""
        return self.engine.spec

    @property
    def manager(self) -> SessionManager[Chunk]:
        if self._manager is None:
            raise RuntimeClosedError("the runtime is not started; use `async with Runtime(...)` or `await start()`.")
        return self._manager

    async def create_session(
        self,
        *,
        prompt: str | None = None,
        seed: int = 0,
        image: bytes | None = None,
        session_id: str | None = None,
        encoding: FrameEncoding | None = None,
        references: tuple[bytes, ...] = (),
    ) -> Session[Chunk]:
        """Admit a new world and return its session.

        ``encoding``: how the caller will send the frames (media and JPEG quality). When the
        configuration has workers encode (:attr:`RuntimeConfig.encode_frames`), the session's
        chunks then carry :class:`~worldserve.media.EncodedFrames` made by its worker;
        otherwise (and without an encoding) they carry ``uint8`` arrays. ``references``: the
        model's reference images (``spec.reference_slots``, raw RGB, all or none).

        Admitted now or refused now: raises ``AdmissionRefusedError`` (code
        ``admission_refused``, with a ``retry_after_s`` hint) at once when no worker can
        take it (full, stalled in a step, down or restarting; a worker that dies while
        admitting is skipped, so this never raises ``worker_died``), ``ValueError`` for
        options the model cannot take, and ``SessionExistsError`` (a
        ``SessionStateError``, code ``session_exists``) for an id already in use.
        """
        manager = self.manager
        await self._sweep_closed()
        if encoding is not None and not isinstance(encoding, FrameEncoding):
            raise ValueError(f"encoding must be a FrameEncoding or None; got {encoding!r}.")
        worker_encoding = encoding if self.config.encodes_in_worker else None
        options = SessionOptions(
            prompt=prompt, seed=seed, image=image, encoding=worker_encoding, references=tuple(references)
        )
        options.check_image(self.spec)  # an image-to-world model without its image is refused here, at once
        resolved = session_id or uuid.uuid4().hex
        if resolved in {session.session_id for session in manager}:
            raise SessionExistsError(f"session {resolved!r} already exists.")
        if self.journals is not None:
            self.journals.path(resolved)  # a session id that cannot name a journal is refused first
        await self.engine.add_session(resolved, options)
        try:
            session = await manager.create_session(resolved)
        except BaseException:
            self.engine.forget_session(resolved)
            raise
        if self.journals is not None:
            self.journals.open(resolved, options)
        return session

    async def close_session(self, session_id: str) -> None:
        """Close the session (its worker releases the state) and drop its routing."""
        await self.manager.close_session(session_id)
        self.engine.forget_session(session_id)
        if self.journals is not None:
            self.journals.close(session_id)

    def request_keyframe(self, session_id: str) -> bool:
        """Start the session's next encoded chunk with an IDR frame (H.264), for a viewer that
        must start there; returns at once (see :meth:`Engine.request_keyframe
        <worldserve.runtime.engine.Engine.request_keyframe>`)."""
        return self.engine.request_keyframe(session_id)

    def set_extra_encodings(self, session_id: str, encodings: tuple[FrameEncoding, ...]) -> bool:
        """Have the session's worker encode its chunks in these other media too (members of its
        world asked for them); returns at once. ``False`` when its worker does not encode its
        chunks (the caller then encodes them; see :meth:`Engine.set_extra_encodings
        <worldserve.runtime.engine.Engine.set_extra_encodings>`)."""
        return self.engine.set_extra_encodings(session_id, tuple(encodings))

    def listen_parts(self, session_id: str, listener: Callable[[ChunkPart], None] | None) -> bool:
        """Hear the session's chunks in parts as its worker makes them (see :meth:`Engine.listen_parts
        <worldserve.runtime.engine.Engine.listen_parts>`); ``False`` when its model makes them whole."""
        return self.engine.listen_parts(session_id, listener)

    def capacity(self) -> Capacity:
        """Room for new sessions now: free slots and ready workers (for ``/healthz``)."""
        return self.engine.capacity()

    def mark_in_use(self, session_id: str, seconds: float) -> None:
        """The session is in use for the next ``seconds``: a full worker never evicts it to admit
        another (0: no longer in use). See :meth:`Engine.mark_in_use
        <worldserve.runtime.engine.Engine.mark_in_use>`; without it, the runtime keeps its old
        rule: any session without a tick queued or in flight may be evicted, least recently used first."""
        self.engine.mark_in_use(session_id, seconds)

    def tick_due(self, session_id: str, want: float | None, *, eager: bool = False, due: float | None = None) -> float:
        """When the session should issue its next tick to share its worker's chunk clock
        (see :meth:`Engine.tick_due <worldserve.runtime.engine.Engine.tick_due>`)."""
        return self.engine.tick_due(session_id, want, eager=eager, due=due)

    def preempt_cost(self, session_id: str) -> float | None:
        """The expected step time of the session made once more, when its worker has room for that
        extra step now, else None (see :meth:`Engine.preempt_cost
        <worldserve.runtime.engine.Engine.preempt_cost>`); a preemption asks this first."""
        if not self.engine.spec.can_rollback:
            return None
        return self.engine.preempt_cost(session_id)

    @property
    def lost(self) -> WorkerDiedError | None:
        """Why no worker can run any more (e.g. the Ray head is gone), or None while the runtime can serve."""
        return self.engine.lost

    async def wait_lost(self) -> WorkerDiedError:
        """Wait until no worker can run any more (the server then stops; see :attr:`lost`)."""
        return await self.engine.wait_lost()

    def stats(self) -> RuntimeStats:
        return RuntimeStats(sessions=self.manager.stats(), engine=self.engine.stats())

    async def _sweep_closed(self) -> None:
        # A session closed directly (session.close()) still holds its registration here.
        for session in list(self.manager):
            if session.status is SessionStatus.CLOSED:
                await self.close_session(session.session_id)


def _build_executor(config: RuntimeConfig) -> Executor:
    """The executor the configuration names (Ray's is imported only when named)."""
    if config.executor == "multiprocess":
        return MultiprocExecutor(
            config.worker_config(),
            config.workers,
            frame_buffer_bytes=config.frame_buffer_bytes,
            start_timeout=config.worker_start_timeout_s,
        )
    if config.executor == "ray":
        from worldserve.runtime.executor.ray_actor import RayExecutor

        return RayExecutor(
            config.worker_config(),
            config.workers,
            address=config.ray_address,
            num_cpus=config.ray_num_cpus,
            num_gpus=config.ray_gpus_per_worker,
            resources=config.ray_resources,
            ping_interval_s=config.ray_ping_interval_s,
            ping_timeout_s=config.ray_ping_timeout_s,
            start_timeout=config.worker_start_timeout_s,
            connect_timeout=config.ray_connect_timeout_s,
            head_timeout=config.ray_head_timeout_s,
        )
    return InprocExecutor(config.worker_config(), config.workers)
