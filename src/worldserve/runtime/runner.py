"""The model runner: what one worker owns (vLLM's model runner, for world models).

Owns, inside one worker: ``session_id -> state`` with each session's
:class:`~worldserve.models.SessionOptions` and its own chunk count; residency (a
count and a byte budget from ``spec.state_bytes``; idle sessions evicted least
recently used, sessions the caller pins never; a refused admission raised at once);
fail-closed release of states whose tick failed; the lifecycle RPC methods
``reset_ar_diffusion_session`` / ``close_ar_diffusion_session``; and, for a model with
``spec.can_rollback``, each session's undo record of its last step (the model's
``snapshot`` taken before it, kept until the next step) and
``rollback_ar_diffusion_session``, which undoes that step when the engine cancelled its
chunk; and encoding the frames of sessions whose options carry an ``encoding``
(:class:`~worldserve.media.FrameEncoding`) right after ``model.step``, so the step's reply
holds their compressed payloads instead of raw arrays (the time is reported as
``StepReport.encode_s``, apart from the model's ``compute_s``). With ``encode_threads`` > 1
a batch's chunks are encoded in parallel (Pillow releases the GIL while it encodes), so the
encoding adds less to the step.

When ``model.step`` raises for a batch, every state of that batch is suspect. If the
model declares ``spec.atomic_step`` (a step that raises leaves its states unchanged),
each tick is retried alone: the failing session's state is released and the others
complete. Otherwise all states of the batch are released and every tick fails with
``model_error`` -- explicitly, never silently regenerated.

Synchronous and single-threaded: its caller (an executor's worker) serializes calls.
Must not know: asyncio, processes, pipes, sessions' event queues.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.errors import ErrorCode
from worldserve.media import EncodedFrames, FrameEncoding, encode
from worldserve.models.base import ModelSpec, RollbackModel, SessionOptions, WorldModel
from worldserve.protocol import TickRequest, parse_chunk_envelope
from worldserve.runtime.errors import AdmissionRefusedError, ModelStepError
from worldserve.runtime.messages import (
    ROLLBACK_SESSION_RPC,
    ResidencyLimits,
    ResidencyReport,
    StepReport,
    TickFailure,
    TickOutput,
)

__all__ = ["ADMIT", "RUNNER_RPC_METHODS", "STEP", "ModelRunner"]

_log = logging.getLogger(__name__)

#: The batched model step (:meth:`ModelRunner.step`): the hot path, which executors may carry specially.
STEP = "step"
#: Creating a session's state (:meth:`ModelRunner.admit`); like :data:`STEP`, only the engine calls it.
ADMIT = "admit"

#: Methods an engine may call on a runner (anything else answers ``supported: False``).
RUNNER_RPC_METHODS = frozenset(
    {
        ADMIT,
        STEP,
        "reset_ar_diffusion_session",
        "close_ar_diffusion_session",
        "resident_sessions",
        "residency",
        ROLLBACK_SESSION_RPC,
    }
)

_MAX_TOMBSTONES = 4096


class _Resident:
    __slots__ = ("next_chunk", "options", "state", "undo")

    def __init__(self, state: Any, options: SessionOptions) -> None:
        self.state = state
        self.options = options
        self.next_chunk = 0
        self.undo: tuple[int, Any] | None = None  # (chunk index of the last step, the model's snapshot before it)


class ModelRunner:
    """Holds one worker's sessions' states and runs their ticks through the model."""

    def __init__(
        self, model: WorldModel, limits: ResidencyLimits | None = None, *, worker: int = 0, encode_threads: int = 1
    ) -> None:
        if isinstance(encode_threads, bool) or not isinstance(encode_threads, int) or encode_threads < 1:
            raise ValueError(f"encode_threads must be a positive integer; got {encode_threads!r}.")
        self._model = model
        self._spec = model.spec
        self._limits = limits or ResidencyLimits()
        self._capacity = self._limits.capacity(self._spec.state_bytes)
        self._worker = worker
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._tombstones: OrderedDict[str, None] = OrderedDict()  # evicted, not yet reset/closed
        self._evictions = 0
        self._compute_s = 0.0  # time inside model.step during the current step call
        self._encode_threads = encode_threads
        self._encoder: ThreadPoolExecutor | None = None  # made on the first step that can use it
        self._rollback: RollbackModel | None = None
        if self._spec.can_rollback:
            if not isinstance(model, RollbackModel):
                raise TypeError(f"model {self._spec.name!r} declares can_rollback but has no snapshot/restore.")
            self._rollback = model

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def capacity(self) -> int | None:
        return self._capacity

    # -- RPC dispatch ------------------------------------------------------------------

    def call(self, method: str, args: Sequence[Any] = ()) -> Any:
        """Run one RPC method by name; an unknown one answers the ``supported: False`` shape."""
        if method not in RUNNER_RPC_METHODS:
            return {"supported": False, "error": f"worker {self._worker} has no RPC method {method!r}."}
        return getattr(self, method)(*args)

    # -- residency ---------------------------------------------------------------------

    def admit(self, session_id: str, options: SessionOptions, pinned: Collection[str] = ()) -> tuple[str, ...]:
        """Create ``session_id``'s state, evicting idle sessions (LRU) if full.

        Returns the ids evicted to make room. ``pinned`` sessions (a tick queued or in
        flight, or marked in use by the caller) are never evicted. Raises :class:`AdmissionRefusedError` when no room
        can be made, before touching any state.
        """
        victims = self._victims(session_id, pinned)
        old = self._resident.pop(session_id, None)
        if old is not None:
            self._release(session_id, old)
        self._tombstones.pop(session_id, None)
        for victim in victims:
            self._evict(victim)
        self._resident[session_id] = _Resident(self._new_state(session_id, options), options)
        return victims

    def _victims(self, session_id: str, pinned: Collection[str]) -> tuple[str, ...]:
        capacity = self._capacity
        if capacity is None:
            return ()
        if capacity == 0:
            raise AdmissionRefusedError(
                f"worker {self._worker} cannot hold any session: one session's state needs "
                f"{self._spec.state_bytes} bytes and the budget is {self._limits.memory_budget_bytes} bytes "
                f"(max sessions {self._limits.max_sessions}); raise the budget."
            )
        others = len(self._resident) - (session_id in self._resident)
        need = others + 1 - capacity
        if need <= 0:
            return ()
        idle = [sid for sid in self._resident if sid not in pinned and sid != session_id]
        if len(idle) < need:
            raise AdmissionRefusedError(
                f"session {session_id!r} refused: worker {self._worker} is full ({others} of "
                f"{capacity} sessions resident) and every resident session is in use or has a tick in "
                "flight; try again later or close a session."
            )
        return tuple(idle[:need])

    def _evict(self, session_id: str) -> None:
        resident = self._resident.pop(session_id)
        self._release(session_id, resident)
        self._tombstones[session_id] = None
        if len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._evictions += 1

    def _new_state(self, session_id: str, options: SessionOptions) -> Any:
        try:
            return self._model.new_state(session_id, options)
        except Exception as error:
            raise ModelStepError(
                f"model {self._spec.name!r} could not create a state for session {session_id!r}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _release(self, session_id: str, resident: _Resident) -> None:
        try:
            self._model.release(resident.state)
        except Exception:  # the state is dropped either way
            _log.exception("model %r failed to release session %r's state", self._spec.name, session_id)
        resident.state = None

    def resident_sessions(self) -> tuple[str, ...]:
        return tuple(self._resident)

    def residency(self) -> ResidencyReport:
        return ResidencyReport(
            worker=self._worker,
            resident=tuple(self._resident),
            capacity=self._capacity,
            state_bytes=self._spec.state_bytes,
            evictions=self._evictions,
        )

    # -- lifecycle RPC -------------------------------------------------------------------

    def reset_ar_diffusion_session(self, session_id: str) -> bool:
        """Start the session over from its options at chunk 0; an unknown session is fine."""
        self._tombstones.pop(session_id, None)
        resident = self._resident.pop(session_id, None)
        if resident is not None:
            self._release(session_id, resident)
            self._resident[session_id] = _Resident(self._new_state(session_id, resident.options), resident.options)
        return True

    def close_ar_diffusion_session(self, session_id: str) -> bool:
        """Release the session's state; idempotent (an unknown session is fine)."""
        self._tombstones.pop(session_id, None)
        resident = self._resident.pop(session_id, None)
        if resident is not None:
            self._release(session_id, resident)
        return True

    def rollback_ar_diffusion_session(self, session_id: str, chunk_index: int) -> bool:
        """Undo the session's step that made chunk ``chunk_index`` (its last one): its state and
        chunk count are as before that step. ``False`` when it cannot be undone (the session
        holds no state here, its last step was another chunk, or the model cannot roll
        back); then the state is released, so the session's next tick fails with a code."""
        resident = self._resident.get(session_id)
        if resident is None:
            return False
        undo, resident.undo = resident.undo, None
        if self._rollback is None or undo is None or undo[0] != chunk_index or resident.next_chunk != chunk_index + 1:
            self._drop(session_id)
            return False
        try:
            resident.state = self._rollback.restore(resident.state, undo[1])
        except Exception:
            _log.exception("model %r failed to roll back session %r", self._spec.name, session_id)
            self._drop(session_id)
            return False
        resident.next_chunk = chunk_index
        return True

    # -- ticks ---------------------------------------------------------------------------

    def step(self, ticks: Sequence[TickRequest]) -> StepReport:
        """Run one AR block for each tick (batched up to ``spec.max_batch_size``)."""
        results: list[TickOutput | TickFailure | None] = [None] * len(ticks)
        runnable: list[tuple[int, str, _Resident, TickRequest]] = []
        seen: set[str] = set()
        for index, tick in enumerate(ticks):
            sid = tick.session_id
            if sid in seen:
                results[index] = TickFailure(
                    ErrorCode.OUT_OF_SYNC,
                    f"session {sid!r} has two ticks in one step; a session runs one tick at a time.",
                )
                continue
            seen.add(sid)
            checked = self._admit_tick(tick)
            if isinstance(checked, TickFailure):
                results[index] = checked
            else:
                runnable.append((index, sid, checked, tick))
        self._compute_s = 0.0
        limit = self._spec.max_batch_size
        for start in range(0, len(runnable), limit):
            group = runnable[start : start + limit]
            for (index, _, _, _), outcome in zip(group, self._run(group), strict=True):
                results[index] = outcome
        encodings = {
            index: (sid, resident.options.encoding)
            for index, sid, resident, _ in runnable
            if resident.options.encoding is not None
        }
        encode_s = self._encode(results, encodings) if encodings else 0.0
        return StepReport(tuple(result for result in results if result is not None), self._compute_s, encode_s)

    def _encode(
        self, results: list[TickOutput | TickFailure | None], encodings: dict[int, tuple[str, FrameEncoding]]
    ) -> float:
        """Replace the outputs of sessions with an encoding by their encoded frames; the seconds it took.

        A chunk that fails to encode fails its own tick (``bad_output``, its state released:
        the chunk was computed but cannot be delivered); the batch's other chunks go on."""
        jobs: list[tuple[int, str, npt.NDArray[np.uint8], FrameEncoding]] = []
        for index, (sid, encoding) in encodings.items():
            output = results[index]
            if isinstance(output, TickOutput) and isinstance(output.frames, np.ndarray):
                jobs.append((index, sid, output.frames, encoding))
        began = time.perf_counter()
        if self._encode_threads > 1 and len(jobs) > 1:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(self._encode_threads, thread_name_prefix="worldserve-encode")
            encoded = list(self._encoder.map(_try_encode, jobs))
        else:
            encoded = [_try_encode(job) for job in jobs]
        for (index, sid, _, encoding), frames in zip(jobs, encoded, strict=True):
            output = results[index]
            assert isinstance(output, TickOutput)
            if isinstance(frames, Exception):
                _log.error("encoding session %r's chunk as %s failed: %r", sid, encoding.media, frames)
                self._drop(sid)
                results[index] = TickFailure(
                    ErrorCode.BAD_OUTPUT,
                    f"chunk {output.metadata.chunk_index} of session {sid!r} could not be encoded as "
                    f"{encoding.media}: {frames}; reset the session to go on.",
                )
            else:
                results[index] = TickOutput(frames, output.metadata)
        return time.perf_counter() - began

    def _admit_tick(self, tick: TickRequest) -> _Resident | TickFailure:
        sid = tick.session_id
        resident = self._resident.get(sid)
        if resident is None:
            if sid in self._tombstones:
                return TickFailure(
                    ErrorCode.EVICTED,
                    f"session {sid!r} was evicted from worker {self._worker} (not in use, least recently used) "
                    "to admit another session; reset it to start over.",
                )
            return TickFailure(
                ErrorCode.NOT_RESIDENT,
                f"session {sid!r} holds no state on worker {self._worker}; reset it to start over.",
            )
        if tick.reset:
            if tick.chunk_index != 0:
                self._drop(sid)
                return TickFailure(ErrorCode.OUT_OF_SYNC, f"a reset tick must be chunk 0; got {tick.chunk_index}.")
            self.reset_ar_diffusion_session(sid)
            resident = self._resident[sid]
        if tick.chunk_index != resident.next_chunk:
            self._drop(sid)
            return TickFailure(
                ErrorCode.OUT_OF_SYNC,
                f"tick for chunk {tick.chunk_index} of session {sid!r} does not continue its state "
                f"(next chunk is {resident.next_chunk}); the state was released, reset the session.",
            )
        return resident

    def _drop(self, session_id: str) -> None:
        resident = self._resident.pop(session_id, None)
        if resident is not None:
            self._release(session_id, resident)

    def _run(self, group: list[tuple[int, str, _Resident, TickRequest]]) -> list[TickOutput | TickFailure]:
        began = time.perf_counter()
        try:
            if self._rollback is not None:
                for _, _, resident, tick in group:
                    resident.undo = (tick.chunk_index, self._rollback.snapshot(resident.state))
            envelopes = self._model.step([(resident.state, tick) for _, _, resident, tick in group])
        except Exception as error:
            self._compute_s += time.perf_counter() - began
            if len(group) > 1 and self._spec.atomic_step:
                # The model promises an untouched batch: retry alone to isolate the culprit.
                return [outcome for item in group for outcome in self._run([item])]
            for _, sid, _, _ in group:
                self._drop(sid)
            detail = f"model step raised {type(error).__name__}: {error}"
            if len(group) > 1:
                detail += (
                    f" (in a batch of {len(group)} sessions; the model cannot isolate the failing one, "
                    "so every state of the batch was released)"
                )
            return [TickFailure(ErrorCode.MODEL_ERROR, f"{detail}; reset the session to go on.")] * len(group)
        self._compute_s += time.perf_counter() - began
        if not isinstance(envelopes, list) or len(envelopes) != len(group):
            for _, sid, _, _ in group:
                self._drop(sid)
            failure = TickFailure(
                ErrorCode.BAD_OUTPUT, f"model step returned {_describe(envelopes)} for {len(group)} ticks."
            )
            return [failure] * len(group)
        return [self._finish(item, envelope) for item, envelope in zip(group, envelopes, strict=True)]

    def _finish(self, item: tuple[int, str, _Resident, TickRequest], envelope: Any) -> TickOutput | TickFailure:
        _, sid, resident, tick = item
        spec = self._spec
        expected = (spec.frames_per_chunk, spec.height, spec.width, 3)
        try:
            payload, metadata = parse_chunk_envelope(envelope)
            if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.shape != expected:
                raise ValueError(f"payload must be uint8 {list(expected)}; got {_describe(payload)}")
        except ValueError as error:
            self._drop(sid)
            return TickFailure(ErrorCode.BAD_OUTPUT, f"model output for session {sid!r} is not a chunk: {error}.")
        resident.next_chunk += 1
        if tick.close_session:
            self._drop(sid)
        else:
            self._resident.move_to_end(sid)
        return TickOutput(np.ascontiguousarray(payload), metadata)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


def _try_encode(job: tuple[int, str, npt.NDArray[np.uint8], FrameEncoding]) -> EncodedFrames | Exception:
    """Encode one chunk's frames, or the error that stopped it (one chunk fails, not its batch)."""
    try:
        return encode(job[2], job[3])
    except Exception as error:
        return error
