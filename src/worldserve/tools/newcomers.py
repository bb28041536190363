"""``worldserve bench --find-capacity --newcomers N``: what newcomers meet at a full server.

Owns one phase of the load test, run against a server that is full: players fill it (each
start without a line, until one is refused), then ``N`` newcomers start with ``queue: true``
one after another (each joins the line before the next arrives) and as many start without
it; then the players leave one by one, ``leave_every`` seconds apart. It reports what a
newcomer and a player see: worlds evicted while their player was playing (must be 0), the
newcomers' waits in line (p50 / p99), the position each newcomer was first told against its
place in arrival order, the order they got in against the order they came (both must match:
first come, first served), and the plain starts refused with a retry hint. Every client is
a plain :class:`~worldserve.client.WorldClient` over the socket.

Must not know: the server's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field

from worldserve.client import SessionFailedError, WorldClient, WorldClientError, WorldError

__all__ = ["NewcomersResult", "format_newcomers_table", "run_newcomers"]


@dataclass
class NewcomersResult:
    """One newcomers phase (see the module docstring)."""

    players: int = 0  # sessions the server held when full
    newcomers: int = 0
    evicted_in_use: int = 0  # players whose world was evicted while they played
    player_failures: dict[str, int] = field(default_factory=dict)  # other codes a player's world failed with
    first_positions: list[int] = field(default_factory=list)  # each newcomer's first position, in arrival order
    admitted_order: list[int] = field(default_factory=list)  # newcomers (by arrival index) in the order they got in
    waits: list[float] = field(default_factory=list)  # seconds in line, of those admitted
    not_admitted: dict[str, int] = field(default_factory=dict)  # why a newcomer never got in
    refused_with_hint: int = 0  # plain starts refused with admission_refused and retry_after_ms
    plain_starts: int = 0
    plain_admitted: int = 0  # plain starts that got in although the server was full (must be 0)

    @property
    def positions_match(self) -> bool:
        return self.first_positions == list(range(1, len(self.first_positions) + 1))

    @property
    def order_matches(self) -> bool:
        return self.admitted_order == sorted(self.admitted_order)

    @property
    def ok(self) -> bool:
        """Every *must* held: no world in use evicted, first come first served, no start past the line."""
        return self.evicted_in_use == 0 and self.positions_match and self.order_matches and self.plain_admitted == 0


async def _play(client: WorldClient, stop: asyncio.Event, result: NewcomersResult) -> None:
    """Read and ack chunks (a player) until ``stop``; a failure of its world is counted."""
    while not stop.is_set():
        try:
            await client.next_chunk(timeout=0.5)
        except TimeoutError:
            continue
        except SessionFailedError as failed:
            if failed.code == "evicted":
                result.evicted_in_use += 1
            else:
                result.player_failures[failed.code] = result.player_failures.get(failed.code, 0) + 1
            return
        except (WorldClientError, WorldError):
            return


async def run_newcomers(
    url: str,
    *,
    newcomers: int,
    max_players: int = 64,
    leave_every: float = 1.0,
    play_after: int = 2,
    token: str | None = None,
    timeout: float = 300.0,
) -> NewcomersResult:
    """Fill the server with players, line up ``newcomers`` (and as many plain starts), then let the
    players leave one by one; see the module docstring."""
    result = NewcomersResult(newcomers=newcomers)
    stops: list[asyncio.Event] = []
    players: list[tuple[WorldClient, asyncio.Task[None]]] = []
    waiting: list[tuple[WorldClient, asyncio.Task[None]]] = []
    try:
        while len(players) < max_players:  # fill: until a plain start is refused
            client = WorldClient(url, token=token)
            await client.connect()
            try:
                await client.start(seed=len(players) + 1)
            except WorldError as refused:
                await client.disconnect()
                if refused.code != "admission_refused":
                    raise
                break
            stop = asyncio.Event()
            stops.append(stop)
            players.append((client, asyncio.ensure_future(_play(client, stop, result))))
            await client.next_chunk(timeout=60)
        result.players = len(players)

        started_at: dict[int, float] = {}
        for index in range(newcomers):
            client = WorldClient(url, token=token)
            await client.connect()
            started_at[index] = time.monotonic()
            task = asyncio.ensure_future(_wait_in_line(client, index, started_at, result, play_after))
            waiting.append((client, task))
            for _ in range(2000):  # in line (or in at once) before the next one arrives
                if client.queued or task.done():
                    break
                await asyncio.sleep(0.005)
            result.first_positions.append(client.queued[0].position if client.queued else 0)
            plain = WorldClient(url, token=token)  # one plain start per newcomer: never ahead of the line
            await plain.connect()
            result.plain_starts += 1
            try:
                await plain.start(seed=1000 + index)
                result.plain_admitted += 1
            except WorldError as refused:
                if refused.code == "admission_refused" and refused.retry_after_ms is not None:
                    result.refused_with_hint += 1
            await plain.disconnect()

        deadline = time.monotonic() + timeout
        for (client, task), stop in zip(players, stops, strict=True):  # the players leave, one by one
            if all(task.done() for _, task in waiting) or time.monotonic() > deadline:
                break
            await asyncio.sleep(leave_every)
            stop.set()
            await task
            await client.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                await asyncio.gather(*(task for _, task in waiting))
    finally:
        for stop in stops:
            stop.set()
        for client, task in [*players, *waiting]:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(Exception):
                await client.close()
    return result


async def _wait_in_line(
    client: WorldClient, index: int, started_at: dict[int, float], result: NewcomersResult, play_after: int
) -> None:
    try:
        await client.start(seed=500 + index, queue=True)
    except (WorldError, WorldClientError) as error:
        why = getattr(error, "code", type(error).__name__)
        result.not_admitted[why] = result.not_admitted.get(why, 0) + 1
        return
    result.waits.append(time.monotonic() - started_at[index])
    result.admitted_order.append(index)
    for _ in range(play_after):  # it plays a little, then leaves: room for the next in line
        await client.next_chunk(timeout=60)
    await client.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def format_newcomers_table(result: NewcomersResult) -> str:
    """The phase as one Markdown table (what must hold is said in each row)."""
    waits = result.waits
    rows = [
        ("sessions held when full (players)", f"{result.players}"),
        ("worlds evicted while in use (must be 0)", f"{result.evicted_in_use}"),
        (
            "newcomers in line: admitted / came",
            f"{len(result.admitted_order)} / {result.newcomers}"
            + (f" (not: {result.not_admitted})" if result.not_admitted else ""),
        ),
        (
            "wait in line s: p50 / p99",
            f"{statistics.median(waits):.2f} / {_percentile(waits, 0.99):.2f}" if waits else "-",
        ),
        (
            "first position told = arrival order (must)",
            ("yes" if result.positions_match else "no") + f" {result.first_positions}",
        ),
        (
            "admitted order = arrival order (must)",
            ("yes" if result.order_matches else "no") + f" {result.admitted_order}",
        ),
        (
            "plain starts refused with a retry hint",
            f"{result.refused_with_hint} / {result.plain_starts} (admitted past the line: {result.plain_admitted})",
        ),
    ]
    if result.player_failures:
        rows.append(("players' worlds failed otherwise", f"{result.player_failures}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'newcomers past capacity':<{width}} | value |", f"|{'-' * (width + 2)}|---|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)
