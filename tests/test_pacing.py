"""The pacing rule (server/pacing.py) in simulated time, with the worker's chunk clock (runtime/clock.py).

A key answered by the chunk whose tick is the first after it: with a lead of one chunk that chunk
plays a whole period after it is ready; just in time it plays one margin after its step.
"""

from __future__ import annotations

import random

import pytest

from worldserve.runtime.clock import ChunkClock, tick_instant
from worldserve.server.config import ServerConfig
from worldserve.server.pacing import Lead, Pacer

C = 0.25  # the chunk period
F = C / 4  # one frame


def run(lead: Lead, steps: list[float], start: float = 10.0) -> tuple[list[tuple[float, float, float]], Pacer]:
    """Paces ``len(steps)`` chunks on one worker's clock; (tick, ready, playout) of each."""
    clock = ChunkClock(C)
    pacer = Pacer(C, lead)
    now, served, made = start, float("-inf"), []
    for step in steps:
        plan = pacer.plan(now)
        tick = tick_instant(clock, now, plan.want, served=served, eager=plan.eager)
        tick = max(tick, now)
        served = tick
        ready = tick + step
        pacer.made(0, tick, ready)
        playout = plan.due if plan.due is not None else ready  # chunk 0 plays when it is ready
        made.append((tick, ready, playout))
        now = ready
    return made, pacer


def test_a_lead_of_one_chunk_is_the_rule_the_server_always_had() -> None:
    made, _ = run(Lead(1), [0.04] * 6)
    ticks = [tick for tick, _, _ in made]
    assert ticks[1] == pytest.approx(made[0][1])  # the lead chunk goes at once (eager)
    for k in range(2, 6):  # then one per period, a whole period before its chunk plays
        assert made[k][2] - made[k][0] == pytest.approx(C + 0.04)
    assert [round(t - ticks[0], 6) for t in ticks[2:]] == [round(k * C, 6) for k in range(1, 5)]


def test_just_in_time_ticks_on_the_clock_and_plays_one_margin_after_the_step() -> None:
    made, pacer = run(Lead(0, F), [0.04] * 8)
    for k, (tick, ready, playout) in enumerate(made):
        assert tick == pytest.approx(made[0][0] + k * C)  # the worker's instants: batching unchanged
        if k:
            assert playout - tick == pytest.approx(0.04 + F)  # no chunk made ahead of playback
            assert ready <= playout
    assert (pacer.late, pacer.stalled_s) == (0, 0.0)


@pytest.mark.parametrize(("lead", "bound"), [(Lead(1), 2 * C + 0.05), (Lead(0, F), C + 0.05 + F)])
def test_a_key_at_any_instant_plays_within_a_period_plus_the_step_just_in_time(lead: Lead, bound: float) -> None:
    rng = random.Random(7)
    steps = [rng.uniform(0.02, 0.05) for _ in range(60)]
    made, _ = run(lead, steps)
    worst = 0.0
    for _ in range(500):
        key = rng.uniform(made[2][0], made[-2][0])
        _, _, playout = next(m for m in made if m[0] >= key)  # the first tick after the key takes it
        worst = max(worst, playout - key)
    assert worst <= bound + 1e-9
    if lead.jit:
        assert worst < C + 0.05 + F + 1e-9 < 2 * C  # about a chunk sooner than a lead of one chunk


def test_a_late_chunk_moves_playback_by_its_lateness_and_is_counted() -> None:
    steps = [0.04, 0.04, 0.04 + F + 0.03, 0.04, 0.04]  # the third step overruns its margin by 30 ms
    made, pacer = run(Lead(0, F), steps)
    assert (pacer.late, pacer.stalled_s) == (1, pytest.approx(0.03))
    assert made[3][2] - made[3][0] == pytest.approx(0.04 + F + 0.03)  # the lead grew by what it demanded
    assert made[4][1] <= made[4][2]
    direct = Pacer(C, Lead(0, F))  # what the host counts in worldserve_late_chunks
    assert direct.made(0, 1.0, 1.04) is False
    assert direct.made(0, 1.25, 1.29) is False  # due 1.04 + F + C = 1.3525
    assert direct.made(0, 1.5, 1.65) is True  # due 1.6025: 47.5 ms late


def test_the_players_acks_bring_a_grown_anchor_back_and_lateness_is_judged_against_them_again() -> None:
    """A late chunk pushes playback later; the players' acks (their jitter buffers took the stall back)
    bring the anchor back, never further than they say, and never later; a later late chunk counts again."""
    pacer = Pacer(C, Lead(0, F))
    pacer.made(0, 1.0, 1.04)  # chunk 0 plays at 1.04 + F
    anchor = 1.04 + F
    assert pacer.made(0, 1.25, 1.35) is False  # chunk 1, due anchor + C = 1.3525: on time
    assert pacer.late == 0
    assert pacer.made(0, 1.5, 1.70) is True  # chunk 2 due anchor + 2C = 1.6025: 97.5 ms late
    assert pacer.due_of(3) == pytest.approx(1.70 + C)  # playback moved by the lateness
    pacer.played(3, 1.70 + C + 0.5)  # an ack later than the pacer's own instant: nothing moves
    assert pacer.due_of(3) == pytest.approx(1.70 + C)
    pacer.played(3, anchor + 3 * C + 0.01)  # the player took the stall back: chunk 3 showed 10 ms after its old time
    assert pacer.due_of(4) == pytest.approx(anchor + 4 * C + 0.01)
    assert pacer.made(0, 1.75, 1.75 + 0.04) is False  # chunk 3, on time
    assert pacer.made(0, 2.0, anchor + 4 * C + 0.05) is True  # 40 ms after its players' instant: late again
    Pacer(C, Lead(1)).played(2, 0.0)  # a lead of whole chunks keeps its own rule


def test_a_world_held_back_more_than_a_period_is_re_anchored_and_a_reset_starts_over() -> None:
    for lead in (Lead(1), Lead(0, F)):
        pacer = Pacer(C, lead)
        pacer.made(0, 1.0, 1.04)
        late = pacer.plan(5.0)  # held back for seconds (no acks): no burst of catch-up ticks
        assert late.want == pytest.approx(5.0)
        assert late.due is not None
        assert late.due > 5.0
        pacer.restart(1)
        assert pacer.plan(6.0).want is None  # a new epoch waits for its worker's next instant
    with pytest.raises(ValueError, match="lead chunks"):
        Lead(-1)


def test_the_server_config_gives_just_in_time_a_frame_of_margin() -> None:
    from worldserve.models.procedural import ProceduralModel

    spec = ProceduralModel().spec
    assert ServerConfig().lead_for(spec) == Lead(0, 1.0 / spec.fps)  # the default: just in time
    assert ServerConfig(lead_chunks=1).lead_for(spec) == Lead(1)
    assert ServerConfig(lead_chunks=0).lead_for(spec) == Lead(0, 1.0 / spec.fps)
    assert ServerConfig(lead_chunks=0, lead_margin_s=0.1).lead_for(spec).margin_s == 0.1
