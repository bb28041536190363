"""A lossy, slow network link on this machine, for benchmarks: two network namespaces joined by TUN devices.

The kernel here has no ``netem`` (``tc qdisc add ... netem`` answers "unknown qdisc"), so the link is made in user
space: a ``client`` namespace (10.77.0.1) and a ``server`` namespace (10.77.0.2), each with one TUN device and the
other's address as its point-to-point peer. A thread reads every IP packet from either device and writes it to the
other after ``delay`` seconds, or drops it with probability ``loss`` (each direction on its own: 20 ms each way is
a 40 ms round trip). TCP and UDP cross it alike, so a WebSocket and WebRTC (ICE's host candidates are the two
addresses) meet the same network. Needs root (CAP_NET_ADMIN) and ``/dev/net/tun``.

    with Link(delay=0.02, loss=0.01) as link:
        server = link.popen("server", ["worldserve", "serve", "--host", link.server_ip])
        with link.inside("client"):          # this thread's sockets are now the client's
            ...

Owns: the namespaces, the devices and the forwarding. Must not know: what crosses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_LIBC = ctypes.CDLL(None, use_errno=True)


def available() -> str | None:
    """Why a link cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and TUN devices)"
    if not Path("/dev/net/tun").exists():
        return "no /dev/net/tun"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "no 'ip netns' (iproute2)"
    return None


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Link:
    """Two namespaces, ``client`` and ``server``, joined by a link of ``delay`` seconds and ``loss`` each way."""

    client_ip = "10.77.0.1"
    server_ip = "10.77.0.2"

    def __init__(self, delay: float = 0.02, loss: float = 0.0, *, seed: int = 0) -> None:
        if delay < 0 or not 0 <= loss < 1:
            raise ValueError(f"delay must be >= 0 and loss in [0, 1); got {delay!r}, {loss!r}.")
        self.delay = delay
        self.loss = loss
        self._rng = random.Random(seed)
        tag = f"{os.getpid()}"
        self.names = {"client": f"wsc{tag}", "server": f"wss{tag}"}
        self._fds: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Packets carried and dropped, both ways.
        self.forwarded = 0
        self.dropped = 0

    def __enter__(self) -> Link:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> None:
        here = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        home = os.open(here, os.O_RDONLY)
        try:
            for side, name in self.names.items():
                _ip("netns", "add", name)
                _setns(f"/run/netns/{name}")
                try:
                    fd = os.open("/dev/net/tun", os.O_RDWR)
                    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
                    self._fds[side] = fd
                finally:
                    if _LIBC.setns(home, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(home)
        for side, (own, peer) in {
            "client": (self.client_ip, self.server_ip),
            "server": (self.server_ip, self.client_ip),
        }.items():
            name = self.names[side]
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", own, "peer", peer, "dev", name)
            _ip("-n", name, "link", "set", name, "up")
        self._thread = threading.Thread(target=self._forward, name="link", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for name in self.names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def _forward(self) -> None:
        client, server = self._fds["client"], self._fds["server"]
        other = {client: server, server: client}
        due: list[tuple[float, int, int, bytes]] = []  # (when, order, to fd, packet)
        order = 0
        while not self._stop.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, _, fd, packet = heapq.heappop(due)
                with contextlib.suppress(OSError):
                    os.write(fd, packet)
                self.forwarded += 1
            wait = min(0.05, max(0.0, due[0][0] - now)) if due else 0.05
            ready, _, _ = select.select([client, server], [], [], wait)
            for fd in ready:
                try:
                    packet = os.read(fd, 65536)
                except OSError:
                    continue
                if self.loss and self._rng.random() < self.loss:
                    self.dropped += 1
                    continue
                order += 1
                heapq.heappush(due, (time.monotonic() + self.delay, order, other[fd], packet))

    def command(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``side``'s namespace."""
        return ["ip", "netns", "exec", self.names[side], *argv]

    def popen(self, side: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(side, argv), **kwargs)

    @contextlib.contextmanager
    def inside(self, side: str) -> Iterator[None]:
        """This thread's new sockets are ``side``'s while inside (threads it starts meanwhile stay there)."""
        here = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.names[side]}")
            yield
        finally:
            _LIBC.setns(here, _CLONE_NEWNET)
            os.close(here)
