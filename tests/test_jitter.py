"""The player's jitter buffer (tools/jitter.py, the page's rule) in simulated time: it starts at one
frame of slack, grows a frame after each underrun up to two chunks, shrinks back a frame at a time
after a calm spell by playing frames early (never dropping one), and a superseded chunk loses only
its frames not yet played."""

from __future__ import annotations

import itertools

import pytest

from worldserve.tools.jitter import SHRINK_AFTER_S, JitterBuffer

FRAME = 1 / 16
FPC = 4  # frames per chunk
PERIOD = FPC * FRAME


def feed(buffer: JitterBuffer, arrivals: list[float], first_seq: int = 0) -> list[float | None]:
    """Chunk ``first_seq + k`` arrives at ``arrivals[k]``; when each one's first frame plays."""
    return [buffer.arrive(first_seq + k, FPC, at) for k, at in enumerate(arrivals)]


def assert_every_frame_once_in_order(buffer: JitterBuffer, chunks: int) -> None:
    assert [(s.seq, s.index) for s in buffer.shown] == [(c, i) for c in range(chunks) for i in range(FPC)]
    instants = [s.at for s in buffer.shown]
    assert all(b - a >= FRAME / 2 - 1e-9 for a, b in itertools.pairwise(instants)), instants


def test_it_starts_one_frame_after_the_first_chunk_and_steady_chunks_never_underrun() -> None:
    buffer = JitterBuffer(FRAME, FPC)
    firsts = feed(buffer, [k * PERIOD for k in range(40)])
    assert firsts[0] == pytest.approx(FRAME)  # one frame of slack
    assert firsts == pytest.approx([FRAME + k * PERIOD for k in range(40)])
    buffer.advance(40 * PERIOD)
    assert (buffer.underruns, buffer.target) == (0, 1.0)
    assert_every_frame_once_in_order(buffer, 40)


def test_an_underrun_grows_the_target_by_a_frame_up_to_two_chunks() -> None:
    buffer = JitterBuffer(FRAME, FPC)
    arrivals = [0.0]
    for k in range(1, 40):  # every third chunk comes four periods after the one before (a stall)
        arrivals.append(arrivals[-1] + (4 * PERIOD if k % 3 == 0 else PERIOD))
    firsts = feed(buffer, arrivals)
    # the first stall: chunk 3 finds the player stopped and waits the grown target, 2 frames
    assert firsts[3] == pytest.approx(arrivals[3] + 2 * FRAME)
    assert firsts[4] == pytest.approx(firsts[3] + PERIOD)  # then one period apart again
    assert firsts[6] == pytest.approx(arrivals[6] + 3 * FRAME)
    assert buffer.underruns == 13
    assert buffer.target == buffer.cap == 2 * FPC  # capped at two chunks
    assert buffer.most == 2 * FPC
    buffer.advance(arrivals[-1] + 3 * PERIOD)  # the last chunk plays out
    assert_every_frame_once_in_order(buffer, 40)


def test_after_the_stalls_the_target_shrinks_back_slowly_by_playing_frames_early() -> None:
    buffer = JitterBuffer(FRAME, FPC)
    arrivals = [k * PERIOD for k in range(4)]
    for _stall in range(3):  # three stalls of a chunk and a half each
        arrivals.append(arrivals[-1] + 2.5 * PERIOD)
        arrivals += [arrivals[-1] + (k + 1) * PERIOD for k in range(3)]
    grown_at = arrivals[-1]
    arrivals += [grown_at + (k + 1) * PERIOD for k in range(int(6 * SHRINK_AFTER_S / PERIOD))]
    buffer.arrive(0, FPC, arrivals[0])
    targets = []
    for seq, at in enumerate(arrivals[1:], start=1):
        buffer.arrive(seq, FPC, at)
        targets.append(buffer.target)
    assert buffer.underruns == 3
    assert max(targets) == 4.0  # one frame more per underrun
    after = targets[len(targets) - (len(arrivals) - 16) :]
    assert after == sorted(after, reverse=True)  # never grows again: down a frame at a time
    assert all(a - b in (0.0, 1.0) for a, b in itertools.pairwise(after))
    assert buffer.target == 1.0  # back at the start
    # slowly: the first shrink comes a calm spell after the last underrun, not at once
    changes = [k for k in range(1, len(after)) if after[k] != after[k - 1]]
    assert len(changes) == 3
    assert all(b - a >= SHRINK_AFTER_S / PERIOD - 1 for a, b in itertools.pairwise(changes))
    buffer.advance(arrivals[-1])
    assert buffer.underruns == 3  # playing early ran nothing dry
    assert_every_frame_once_in_order(buffer, len(arrivals) - 1)  # nothing dropped (the last still queued)


def test_a_dropped_stream_running_dry_is_no_underrun() -> None:
    buffer = JitterBuffer(FRAME, FPC)
    buffer.arrive(0, FPC, 0.0)
    buffer.set_live(False, 0.1)
    buffer.arrive(1, FPC, 2.0)  # back after a resume: starts again at the same target
    assert (buffer.underruns, buffer.target) == (0, 1.0)
    assert buffer.first_played(1) == pytest.approx(2.0 + FRAME)


def test_supersede_removes_only_the_unplayed_frames_of_that_chunk() -> None:
    buffer = JitterBuffer(FRAME, FPC)
    feed(buffer, [0.0, 0.01, 0.02])  # three chunks queued at once
    assert buffer.first_played(2) == pytest.approx(FRAME + 8 * FRAME)
    now = FRAME + 1.5 * FRAME  # chunk 0's frames 0 and 1 have played
    assert buffer.supersede(0, now) == 2
    assert [(s.seq, s.index) for s in buffer.shown] == [(0, 0), (0, 1)]
    assert buffer.supersede(0, now) == 0  # nothing of it left to remove
    assert buffer.supersede(7, now) == 0  # a chunk never queued
    assert buffer.queued == 8
    # the frames behind move up: chunk 1 plays next, where chunk 0's frame 2 would have
    assert buffer.first_played(1) == pytest.approx(FRAME + 2 * FRAME)
    assert buffer.supersede(2, now) == 4  # a chunk not started at all goes whole
    superseding = buffer.arrive(3, FPC, now)  # the chunk that takes its place, behind chunk 1
    assert superseding == pytest.approx(FRAME + 6 * FRAME)
    buffer.advance(10.0)
    assert [s.seq for s in buffer.shown] == [0, 0, 1, 1, 1, 1, 3, 3, 3, 3]
    assert buffer.underruns == 1  # ran dry once, after the last frame (no more chunks came)


def test_a_start_of_zero_frames_plays_on_arrival_and_still_grows() -> None:
    buffer = JitterBuffer(FRAME, FPC, start=0.0)
    assert buffer.arrive(0, FPC, 1.0) == pytest.approx(1.0)
    assert buffer.arrive(1, FPC, 1.0 + 2 * PERIOD) == pytest.approx(1.0 + 2 * PERIOD + FRAME)
    assert (buffer.underruns, buffer.target) == (1, 1.0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="frame"):
        JitterBuffer(0.0, FPC)
    with pytest.raises(ValueError, match="frames_per_chunk"):
        JitterBuffer(FRAME, 0)
    with pytest.raises(ValueError, match="start"):
        JitterBuffer(FRAME, FPC, start=-1)
    with pytest.raises(ValueError, match="ahead"):
        JitterBuffer(FRAME, FPC, ahead=-1)


def test_a_server_a_chunk_ahead_keeps_its_chunk_queued() -> None:
    """Chunks 0 and 1 at once, then one a period: a chunk stays queued (the lead), and it is left there."""
    buffer = JitterBuffer(FRAME, FPC)
    feed(buffer, [0.0] + [k * PERIOD for k in range(40)])
    assert (buffer.taken_back, buffer.underruns, buffer.target) == (0, 0, 1.0)
    assert buffer.queued == 2 * FPC  # the lead chunk and the newest
    assert buffer.first_played(40) == pytest.approx(FRAME + 40 * PERIOD)  # still a chunk and a frame behind


@pytest.mark.parametrize(("ahead", "taken_back", "level"), [(0, 3, 0), (FPC, 0, 3)])
def test_a_slow_start_is_taken_back_to_the_target_just_in_time_and_kept_a_chunk_ahead(
    ahead: int, taken_back: int, level: int
) -> None:
    """Chunk 0 was decoded 2.5 frames late against the stream that follows (a slow first decode), so
    every later chunk finds 3 frames queued and waits 3.5. Just in time (``ahead`` 0: the server queues
    nothing by design) the player takes the 2.5 frames beyond its target of 1 back, at most a frame a
    chunk (1, 1, 0.5), and no more: each chunk then waits exactly the target; for a server a chunk
    ahead (``ahead`` one chunk) 3.5 frames are within what it keeps queued, and stay."""
    buffer = JitterBuffer(FRAME, FPC, ahead=ahead)
    arrivals = [2.5 * FRAME] + [k * PERIOD for k in range(1, 40)]
    levels = []
    for seq, at in enumerate(arrivals):
        buffer.advance(at)
        levels.append(buffer.queued)
        buffer.arrive(seq, FPC, at)
    assert levels[1:5] == [3, 3, 3, 3]
    assert (buffer.taken_back, buffer.underruns, buffer.target) == (taken_back, 0, 1.0)
    assert levels[-10:] == [level] * 10
    buffer.advance(arrivals[-1] + 2 * PERIOD)  # the last chunk plays out
    settled = 1.0 if ahead == 0 else 3.5  # the last chunk's wait: the target, or as it came
    assert [s.at for s in buffer.shown if s.index == 0][-1] - arrivals[-1] == pytest.approx(settled * FRAME)
    assert_every_frame_once_in_order(buffer, len(arrivals))  # nothing dropped


def test_a_stalls_burst_is_drained_to_target_plus_a_chunk_by_playing_early() -> None:
    """The network held four chunks back and let them go at once, the server then goes on a period
    apart: the queue drains a frame a chunk until the chunks find at most the target and a chunk."""
    buffer = JitterBuffer(FRAME, FPC)
    arrivals = [k * PERIOD for k in range(4)] + [4 * PERIOD + 0.9] * 4 + [8 * PERIOD + k * PERIOD for k in range(40)]
    levels = []
    for seq, at in enumerate(arrivals):
        buffer.advance(at)
        levels.append(buffer.queued)
        buffer.arrive(seq, FPC, at)
    assert buffer.underruns == 1  # the stall
    assert buffer.taken_back > 0
    assert max(levels[12:20]) > 2 * FPC  # what the burst left queued ...
    assert max(levels[-8:]) <= buffer.target + FPC  # ... drained
    buffer.advance(arrivals[-1] + 4 * PERIOD)  # what is queued plays out (then it runs dry: no more chunks)
    assert buffer.underruns == 2  # nothing ran dry meanwhile
    assert_every_frame_once_in_order(buffer, len(arrivals))  # and nothing dropped


def test_a_chunk_in_parts_plays_from_its_first_part_and_its_rest_queues_behind_it() -> None:
    """Each chunk's first half comes at its period, the other half a frame later (well before it is due): it
    plays exactly as whole chunks arriving with their first halves would, every frame once, no underrun."""
    parted, whole = JitterBuffer(FRAME, FPC), JitterBuffer(FRAME, FPC)
    for k in range(20):
        first = parted.arrive(k, 2, k * PERIOD)
        assert parted.arrive(k, 2, k * PERIOD + FRAME, first=2) is None  # the rest says nothing of the start
        assert first == whole.arrive(k, FPC, k * PERIOD)
    for buffer in (parted, whole):
        buffer.advance(20 * PERIOD)
    assert [(s.seq, s.index, s.at) for s in parted.shown] == [(s.seq, s.index, s.at) for s in whole.shown]
    assert parted.underruns == 0
    assert_every_frame_once_in_order(parted, 20)
    # a rest that comes after its frames were due: the player runs dry there, and counts it
    late = JitterBuffer(FRAME, FPC)
    late.arrive(0, 1, 0.0)
    late.arrive(0, 3, 4 * FRAME, first=1)
    late.advance(PERIOD * 2)
    assert late.underruns == 1
    assert [(s.seq, s.index) for s in late.shown] == [(0, i) for i in range(FPC)]
