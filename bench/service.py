"""A service of two front-ends behind nginx, measured: what its doors, its one line and a drain cost.

One command (``python bench/service.py``) runs a Ray head, two front-ends (``--directory ray``, the
procedural model, ``--max-sessions-per-worker 2``, ``--drain-timeout-s 30``) and nginx on this machine
(``worldserve.tools.topology.service``) and prints one table:

- **resume / join**: from opening a connection to ``session.resumed`` / ``session.joined``, through the
  world's own front-end's door and through the other one's (which answers ``session.moved``: the
  client opens a second connection and asks again): what the redirect adds.
- **queued start**: both front-ends full; a start waits at one door; a world ends on the same
  front-end, or on the other one (the start is moved there): from the end's ``session.closed`` to
  ``session.started``.
- **drain**: front-end 1 gets SIGTERM under playing worlds: how many chunks each world got during the
  drain and whether its ledger stayed exact, what a new start through the balancer got, and how long
  the front-end took to stop after its last world closed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from collections.abc import Awaitable, Callable

from worldserve.client import WorldClient, WorldError
from worldserve.tools.topology import Service, service


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered) * 1000:.1f} / {p95 * 1000:.1f}"


async def _timed(make: Callable[[], Awaitable[object]], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        began = time.perf_counter()
        await make()
        samples.append(time.perf_counter() - began)
    return samples


async def _doors(running: Service, repeat: int) -> list[tuple[str, str, str]]:
    own, other = running.door(1), running.door(2)
    host = WorldClient(own)
    await host.connect()
    info = await host.start(seed=1, share_viewers=True)
    await host.next_chunk(timeout=10)
    rows = []
    for label, door in (("its own", own), ("the other", other)):

        async def resume(door: str = door) -> None:
            await host.drop()
            host.url = door
            await host.resume()

        async def join(door: str = door) -> None:
            async with WorldClient(door) as viewer:
                assert info.viewer_token is not None
                await viewer.join(info.session_id, info.viewer_token)

        rows.append((f"resume through {label} door", "open -> session.resumed", _ms(await _timed(resume, repeat))))
        rows.append((f"join through {label} door", "open -> session.joined", _ms(await _timed(join, repeat))))
    await host.close()
    return rows


async def _line(running: Service, repeat: int) -> list[tuple[str, str, str]]:
    rows = []
    for label, freed in (("the same front-end", 1), ("the other front-end (moved)", 2)):
        samples = []
        for _ in range(repeat):
            hosts = []
            for door in (1, 1, 2, 2):  # two slots each: both front-ends full
                client = WorldClient(running.door(door))
                await client.connect()
                await client.start(seed=len(hosts))
                hosts.append(client)
            waiter = WorldClient(running.door(1))
            await waiter.connect()
            queued = asyncio.ensure_future(waiter.start(seed=9, queue=True))
            while not waiter.queued:  # noqa: ASYNC110 -- its first notice: it is in line
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            closing = hosts.pop(0 if freed == 1 else 2)
            began = time.perf_counter()
            await closing.close()
            await queued
            samples.append(time.perf_counter() - began)
            for client in [*hosts, waiter]:
                await client.close()
            await asyncio.sleep(0.5)  # the slots are free again
        rows.append((f"queued start, a slot frees on {label}", "world closed -> session.started", _ms(samples)))
    return rows


async def _drain(running: Service, worlds: int) -> list[tuple[str, str, str]]:
    players = []
    for seed in range(worlds):
        client = WorldClient(running.door(1))
        await client.connect()
        await client.start(seed=seed)
        players.append(client)
    for client in players:
        await client.next_chunk(timeout=10)
    process = running.processes[0]
    process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    balancer = f"ws://{running.balancer.listen[0]}:{running.balancer.listen[1]}/v1/world"
    refusals: list[str] = []
    started = False
    for _attempt in range(4):  # a client retrying through the balancer: a new connection each time
        async with WorldClient(balancer) as newcomer:
            try:
                await newcomer.start(seed=99)
            except WorldError as error:
                refusals.append(error.code)
                continue
            started = True
            await newcomer.close()
            break
    tried = (
        f"{len(refusals)} refused ({', '.join(sorted(set(refusals))) or '-'}), then {'started' if started else 'none'}"
    )
    got = []
    exact = True
    for client in players:
        seqs = []
        for _ in range(8):
            seqs.append((await client.next_chunk(timeout=10)).seq)
        exact &= seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        got.append(len(seqs))
    for client in players:
        await client.close()
    closed = time.perf_counter()
    process.wait(timeout=60)
    stopped = time.perf_counter() - closed
    return [
        (
            f"drain under {worlds} worlds",
            "chunks each world got while draining",
            f"{min(got)}+ each, contiguous: {exact}",
        ),
        ("drain: new starts through the balancer", "retried on a new connection", tried),
        ("drain: stop after the last world closed", "seconds", f"{stopped:.2f}"),
    ]


async def _run(args: argparse.Namespace) -> None:
    serve = ["--model", "procedural", "--max-sessions-per-worker", "2", "--drain-timeout-s", "30"]
    with service(2, serve_args=serve) as running:
        rows = await _doors(running, args.repeat)
        rows += await _line(running, max(3, args.repeat // 4))
        rows += await _drain(running, args.worlds)
    load = os.getloadavg()[0]
    print(f"service bench: 2 front-ends (procedural), nginx, a Ray head; {os.cpu_count()} CPUs, load {load:.1f}")
    print("| measure | what | p50 / p95 ms (or result) |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="samples per door measure")
    parser.add_argument("--worlds", type=int, default=2, help="worlds playing on the front-end that drains")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
