"""The benchmarks' user-space link (bench/link.py): two network namespaces joined by TUN devices, packets delayed
and dropped in between. TCP crosses it intact despite the loss, never faster than the delay allows, and the
namespaces are gone afterwards. Root only (network namespaces, /dev/net/tun): skipped elsewhere."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from link import Link, available

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(available() is not None, reason=f"no link here: {available()}"),
]

_ECHO = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], 9999))
server.listen()
print("listening", flush=True)
connection, _ = server.accept()
while data := connection.recv(65536):
    connection.sendall(data)
"""


def test_tcp_crosses_a_slow_lossy_link_intact_and_the_namespaces_go_after() -> None:
    with Link(delay=0.01, loss=0.1, seed=3) as link:
        echo = link.popen("server", [sys.executable, "-c", _ECHO, link.server_ip], stdout=subprocess.PIPE)
        try:
            assert echo.stdout is not None
            assert echo.stdout.readline() == b"listening\n"
            with link.inside("client"):
                connection = socket.create_connection((link.server_ip, 9999), timeout=30)
            with connection:
                began = time.monotonic()
                connection.sendall(b"?")
                assert connection.recv(1) == b"?"
                assert time.monotonic() - began >= 0.02  # a round trip is at least the delay each way
                data = bytes(range(256)) * 1000
                got = bytearray()

                def read() -> None:
                    while len(got) < len(data) and (chunk := connection.recv(65536)):
                        got.extend(chunk)

                reader = threading.Thread(target=read)
                reader.start()
                connection.sendall(data)
                reader.join(40)
            assert bytes(got) == data  # TCP made up for every packet the link dropped
            assert link.dropped > 0
            assert link.forwarded > 100
        finally:
            echo.kill()
            echo.wait()
        names = set(link.names.values())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not names & {line.split()[0] for line in listed.splitlines() if line.strip()}
