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
``StepReport.encode_s``, apart from the model's ``compute_s``). Each such session has its
own :class:`~worldserve.media.FrameEncoder` (for H.264, the session's one stream: kept
across a reset, which starts with an IDR frame; a cancelled chunk is rolled out of it too;
``request_keyframe`` starts its next chunk with an IDR frame, for a viewer that needs to
start there). A session whose options also carry ``extra_encodings`` (members of its world
asked for other media) has one encoder per media, each chunk encoded once in each and
handed back as one :class:`~worldserve.media.EncodedFrames` with the others as its
``alternates``; ``set_extra_encodings`` changes that set as members come and go (an
encoder whose media is no longer wanted is dropped, and stops costing anything). With
``encode_threads`` > 1 a batch's encodings (every chunk in every media) run in parallel
(Pillow and PyAV release the GIL while they encode), so the encoding adds less to the step.

For a model with ``spec.frame_parts``, the ticks of sessions a step names in ``parted``
hand their frames on as :class:`~worldserve.runtime.messages.ChunkPart` s while the step runs (to
``on_part``), encoded part by part in a JPEG or raw encoding (the chunk's payloads are then the parts',
not encoded again); a session whose chunk is wanted in H.264 or in more than one media sends no parts
(its encodings are made per chunk). A batch that raises after a part left fails those sessions
instead of retrying them alone (their frames would be made twice).

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
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from worldserve.errors import ErrorCode
from worldserve.media import EncodedFrames, FrameEncoder, FrameEncoding
from worldserve.models.base import ModelSpec, RollbackModel, SessionOptions, WorldModel
from worldserve.protocol import TickRequest, parse_chunk_envelope
from worldserve.runtime.errors import AdmissionRefusedError, ModelStepError
from worldserve.runtime.messages import (
    ROLLBACK_SESSION_RPC,
    ChunkPart,
    ResidencyLimits,
    ResidencyReport,
    StepReport,
    TickFailure,
    TickOutput,
)

__all__ = ["ADMIT", "REQUEST_KEYFRAME_RPC", "RUNNER_RPC_METHODS", "SET_EXTRA_ENCODINGS_RPC", "STEP", "ModelRunner"]

_log = logging.getLogger(__name__)

#: The batched model step (:meth:`ModelRunner.step`): the hot path, which executors may carry specially.
STEP = "step"
#: Creating a session's state (:meth:`ModelRunner.admit`); like :data:`STEP`, only the engine calls it.
ADMIT = "admit"
#: Start a session's next chunk with an IDR frame (:meth:`ModelRunner.request_keyframe`).
REQUEST_KEYFRAME_RPC = "request_keyframe"
#: Change the other media a session's chunks are encoded in (:meth:`ModelRunner.set_extra_encodings`).
SET_EXTRA_ENCODINGS_RPC = "set_extra_encodings"

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
        REQUEST_KEYFRAME_RPC,
        SET_EXTRA_ENCODINGS_RPC,
    }
)

_MAX_TOMBSTONES = 4096


class _Resident:
    __slots__ = ("encoders", "next_chunk", "options", "state", "undo")

    def __init__(self, state: Any, options: SessionOptions) -> None:
        self.state = state
        self.options = options
        self.next_chunk = 0
        self.undo: tuple[int, Any] | None = None  # (chunk index of the last step, the model's snapshot before it)
        self.encoders: dict[str, FrameEncoder] = {}  # by media; each made on its first chunk


class _Parting:
    """One tick's chunk handed on in parts while its step runs: what went out so far."""

    __slots__ = ("chunk_index", "encode_s", "encoder", "payloads", "sent", "session_id", "sink")

    def __init__(self, tick: TickRequest, encoder: FrameEncoder | None, sink: Callable[[ChunkPart], None]) -> None:
        self.session_id = tick.session_id
        self.chunk_index = tick.chunk_index
        self.encoder = encoder  # a stateless one (JPEG, raw), or None: the parts go as arrays
        self.sink = sink
        self.sent = 0  # frames handed on
        self.payloads: list[bytes] = []  # the encoded parts' payloads, in order
        self.encode_s = 0.0

    def hand_on(self, frames: npt.NDArray[np.uint8]) -> None:
        out: npt.NDArray[np.uint8] | EncodedFrames = frames
        if self.encoder is not None:
            began = time.perf_counter()
            out = self.encoder.encode(frames)
            self.encode_s += time.perf_counter() - began
            self.payloads.extend(out.payloads)
        else:
            frames.flags.writeable = False
        part = ChunkPart(self.session_id, self.chunk_index, self.sent, out)
        self.sent += part.count
        self.sink(part)


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
        # Sessions whose state is gone, not yet reset/closed, and why: evicted, or their last step
        # failed (a tick cancelled mid-step, whose result nobody took, says so to the next tick).
        self._tombstones: OrderedDict[str, TickFailure] = OrderedDict()
        self._evictions = 0
        self._compute_s = 0.0  # time inside model.step during the current step call
        self._parting: dict[int, _Parting] = {}  # the current step's ticks that hand their frames on, by index
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
        self._bury(
            session_id,
            TickFailure(
                ErrorCode.EVICTED,
                f"session {session_id!r} was evicted from worker {self._worker} (not in use, least recently "
                "used) to admit another session; reset it to start over.",
            ),
        )
        self._evictions += 1

    def _bury(self, session_id: str, failure: TickFailure) -> None:
        """The session's state is gone for ``failure``: its later ticks fail so until a reset or close."""
        self._tombstones[session_id] = failure
        self._tombstones.move_to_end(session_id)
        if len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _lost(self, session_id: str, failure: TickFailure) -> TickFailure:
        """A step failed for the session: its state is released, and its next tick says why."""
        self._drop(session_id)
        self._bury(session_id, TickFailure(failure.code, f"the session's last step failed: {failure.message}"))
        return failure

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
        resident.encoders = {}  # a step may still be encoding with them; each is freed with its last reference

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
            # The session's frames go on as one stream (a viewer keeps its decoder), from an IDR frame.
            encoders, resident.encoders = resident.encoders, {}
            self._release(session_id, resident)
            fresh = self._resident[session_id] = _Resident(
                self._new_state(session_id, resident.options), resident.options
            )
            for encoder in encoders.values():
                encoder.keyframe()
            fresh.encoders = encoders
        return True

    def request_keyframe(self, session_id: str) -> bool:
        """Start the session's next encoded chunk with an IDR frame (H.264: where a late joiner, a
        viewer that skipped chunks or a resumed connection can start); ``False`` if it is not here."""
        resident = self._resident.get(session_id)
        if resident is None:
            return False
        for encoder in resident.encoders.values():
            encoder.keyframe()
        return True

    def set_extra_encodings(self, session_id: str, encodings: tuple[FrameEncoding, ...]) -> bool:
        """Encode the session's chunks in these other media too, from its next step on (see
        ``SessionOptions.extra_encodings``): a media added gets its encoder on its first chunk
        (H.264: starting a stream with an IDR frame), one left out is dropped. ``False`` if the
        session is not here (its options, where the engine keeps them, say it for a re-admission)."""
        resident = self._resident.get(session_id)
        if resident is None:
            return False
        resident.options = replace(resident.options, extra_encodings=tuple(encodings))
        wanted = {encoding.media: encoding for encoding in resident.options.encodings}
        for media, encoder in list(resident.encoders.items()):
            if media not in wanted or not wanted[media].same_bytes(encoder.encoding):
                del resident.encoders[media]
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
        for encoder in resident.encoders.values():  # the undone chunk was encoded but never delivered
            encoder.rollback(self._spec.frames_per_chunk)
        return True

    # -- ticks ---------------------------------------------------------------------------

    def step(
        self,
        ticks: Sequence[TickRequest],
        parted: Collection[str] = (),
        on_part: Callable[[ChunkPart], None] | None = None,
    ) -> StepReport:
        """Run one AR block for each tick (batched up to ``spec.max_batch_size``); the sessions named in
        ``parted`` hand their frames on to ``on_part`` as they are made, where the model and their
        encodings allow it."""
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
        # Taken before the step: a session whose tick closes it still has its last chunk encoded.
        encoders = {
            index: (sid, self._session_encoders(resident))
            for index, sid, resident, _ in runnable
            if resident.options.encoding is not None
        }
        self._parting = {}
        if on_part is not None and parted and self._spec.frame_parts:
            for index, sid, resident, tick in runnable:
                encodings = resident.options.encodings
                if sid in parted and len(encodings) <= 1 and not any(item.stateful for item in encodings):
                    encoder = encoders.pop(index)[1][0] if encodings else None
                    self._parting[index] = _Parting(tick, encoder, on_part)
        self._compute_s = 0.0
        limit = self._spec.max_batch_size
        for start in range(0, len(runnable), limit):
            group = runnable[start : start + limit]
            for (index, _, _, _), outcome in zip(group, self._run(group), strict=True):
                results[index] = outcome
        parts_s = sum(parting.encode_s for parting in self._parting.values())
        encode_s = self._encode(results, encoders) if encoders else 0.0
        self._parting = {}
        return StepReport(
            tuple(result for result in results if result is not None), self._compute_s - parts_s, encode_s + parts_s
        )

    def _session_encoders(self, resident: _Resident) -> tuple[FrameEncoder, ...]:
        """The session's encoders, its ``encoding``'s first (each made on its first chunk)."""
        spec = self._spec
        made = []
        for encoding in resident.options.encodings:
            encoder = resident.encoders.get(encoding.media)
            if encoder is None:
                encoder = resident.encoders[encoding.media] = FrameEncoder(encoding, spec.width, spec.height, spec.fps)
            made.append(encoder)
        return tuple(made)

    def _encode(
        self,
        results: list[TickOutput | TickFailure | None],
        encoders: dict[int, tuple[str, tuple[FrameEncoder, ...]]],
    ) -> float:
        """Replace the outputs of sessions with an encoding by their encoded frames; the seconds it took.

        Each chunk is encoded once per encoder (media) of its session; all the batch's
        encodings run in the pool. A chunk that fails to encode in any of them fails its own
        tick (``bad_output``, its state released: the chunk was computed but cannot be
        delivered); the batch's other chunks go on."""
        jobs: list[tuple[int, str, npt.NDArray[np.uint8], FrameEncoder]] = []
        for index, (sid, session_encoders) in encoders.items():
            output = results[index]
            if isinstance(output, TickOutput) and isinstance(output.frames, np.ndarray):
                jobs.extend((index, sid, output.frames, encoder) for encoder in session_encoders)
        began = time.perf_counter()
        if self._encode_threads > 1 and len(jobs) > 1:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(self._encode_threads, thread_name_prefix="worldserve-encode")
            encoded = list(self._encoder.map(_try_encode, jobs))
        else:
            encoded = [_try_encode(job) for job in jobs]
        made: dict[int, list[EncodedFrames]] = {}
        for (index, sid, _, encoder), frames in zip(jobs, encoded, strict=True):
            output = results[index]
            if not isinstance(output, TickOutput):
                continue  # another of its encodings failed already
            if isinstance(frames, Exception):
                media = encoder.encoding.media
                _log.error("encoding session %r's chunk as %s failed: %r", sid, media, frames)
                self._drop(sid)
                made.pop(index, None)
                results[index] = TickFailure(
                    ErrorCode.BAD_OUTPUT,
                    f"chunk {output.metadata.chunk_index} of session {sid!r} could not be encoded as "
                    f"{media}: {frames}; reset the session to go on.",
                )
            else:
                made.setdefault(index, []).append(frames)
        for index, versions in made.items():
            output = results[index]
            assert isinstance(output, TickOutput)
            first, *others = versions
            results[index] = TickOutput(replace(first, alternates=tuple(others)), output.metadata)
        return time.perf_counter() - began

    def _admit_tick(self, tick: TickRequest) -> _Resident | TickFailure:
        sid = tick.session_id
        resident = self._resident.get(sid)
        if resident is None:
            if sid in self._tombstones:
                return self._tombstones[sid]
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
        partings = [self._parting.get(index) for index, _, _, _ in group]
        try:
            if self._rollback is not None:
                for _, _, resident, tick in group:
                    resident.undo = (tick.chunk_index, self._rollback.snapshot(resident.state))
            pairs = [(resident.state, tick) for _, _, resident, tick in group]
            if any(partings):

                def sink(row: int, frames: npt.NDArray[np.uint8]) -> None:
                    parting = partings[row]
                    if parting is not None:
                        parting.hand_on(frames)

                envelopes = self._model.step(pairs, on_part=sink)  # type: ignore[call-arg]
            else:
                envelopes = self._model.step(pairs)
        except Exception as error:
            self._compute_s += time.perf_counter() - began
            out = [p is not None and p.sent > 0 for p in partings]  # frames already handed on: never made twice
            if len(group) > 1 and self._spec.atomic_step:
                # The model promises an untouched batch: retry alone to isolate the culprit.
                detail = f"model step raised {type(error).__name__}: {error}, after frames of its chunk were sent"
                sent = TickFailure(ErrorCode.MODEL_ERROR, f"{detail}; reset the session to go on.")
                return [
                    outcome
                    for item, gone in zip(group, out, strict=True)
                    for outcome in ([self._lost(item[1], sent)] if gone else self._run([item]))
                ]
            detail = f"model step raised {type(error).__name__}: {error}"
            if len(group) > 1:
                detail += (
                    f" (in a batch of {len(group)} sessions; the model cannot isolate the failing one, "
                    "so every state of the batch was released)"
                )
            failure = TickFailure(ErrorCode.MODEL_ERROR, f"{detail}; reset the session to go on.")
            return [self._lost(sid, failure) for _, sid, _, _ in group]
        self._compute_s += time.perf_counter() - began
        if not isinstance(envelopes, list) or len(envelopes) != len(group):
            failure = TickFailure(
                ErrorCode.BAD_OUTPUT, f"model step returned {_describe(envelopes)} for {len(group)} ticks."
            )
            return [self._lost(sid, failure) for _, sid, _, _ in group]
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
            failure = TickFailure(ErrorCode.BAD_OUTPUT, f"model output for session {sid!r} is not a chunk: {error}.")
            return self._lost(sid, failure)
        parting = self._parting.get(item[0])
        frames: npt.NDArray[np.uint8] | EncodedFrames = np.ascontiguousarray(payload)
        if parting is not None:
            if parting.sent != spec.frames_per_chunk:
                failure = TickFailure(
                    ErrorCode.BAD_OUTPUT,
                    f"model handed on {parting.sent} of session {sid!r}'s {spec.frames_per_chunk} frames in parts.",
                )
                return self._lost(sid, failure)
            if parting.encoder is not None:  # the chunk's payloads are its parts', encoded once
                frames = EncodedFrames(parting.encoder.encoding, spec.width, spec.height, tuple(parting.payloads))
        resident.next_chunk += 1
        if tick.close_session:
            self._drop(sid)
        else:
            self._resident.move_to_end(sid)
        return TickOutput(frames, metadata)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


def _try_encode(job: tuple[int, str, npt.NDArray[np.uint8], FrameEncoder]) -> EncodedFrames | Exception:
    """Encode one chunk's frames, or the error that stopped it (one chunk fails, not its batch)."""
    try:
        return job[3].encode(job[2])
    except Exception as error:
        return error
