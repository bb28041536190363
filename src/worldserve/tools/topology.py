"""A whole service on one machine: a Ray head, worker nodes, N front-ends and nginx as the L7 balancer.

``python -m worldserve.tools.topology`` starts a Ray head (``ray start --head``, no work on it), Ray
worker nodes (``ray start --address``, each with a temporary folder of its own) where each front-end
runs its worker (``--executor ray``), front-ends (``worldserve serve --directory ray``, each with its
own port and a public URL through the balancer: ``http://HOST:PORT/fe/N``) and nginx (round robin
over the front-ends for ``/`` and ``/v1/world``, WebSocket upgrade, and ``/fe/N/`` to front-end N,
where ``session.moved`` sends a client), prints the balancer's URL and tears it all down on Ctrl-C or
SIGTERM. These are the commands docs/deploy.md ("Many front-ends") gives; the tests run the script's
own :func:`service` once (``tests/test_topology.py``) and the same pieces (``tests/test_front_ends.py``).

Owns: the nginx configuration of such a balancer (:func:`nginx_config`), running nginx from a
folder of its own (:class:`Nginx`: no root, no system files), the whole service for as long as a
block runs (:func:`service`: ``bench/service.py`` measures one), and the script.
Must not know: what a world is; how the front-ends find each other (the directory does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Nginx", "Service", "front_end_path", "nginx_config", "processes_of", "service", "start_ray", "stop_ray"]


def front_end_path(index: int) -> str:
    """The balancer's path prefix to front-end ``index`` (1-based): its ``--public-url`` path."""
    return f"/fe/{index}"


def nginx_config(listen: tuple[str, int], front_ends: Sequence[tuple[str, int]], folder: Path) -> str:
    """nginx's configuration for a balancer at ``listen`` over ``front_ends`` (host, port), everything it
    writes (pid, logs, temporary files) under ``folder``: new connections round robin, a WebSocket's
    upgrade passed on and kept open as long as the world plays, and ``/fe/N/`` to front-end N alone."""
    servers = "\n".join(f"        server {host}:{port} max_fails=1 fail_timeout=2s;" for host, port in front_ends)
    direct = "\n".join(
        f"""        location {front_end_path(index)}/ {{
            proxy_pass http://{host}:{port}/;
            include {folder}/proxy.conf;
        }}"""
        for index, (host, port) in enumerate(front_ends, 1)
    )
    return f"""# worldserve: a balancer over {len(front_ends)} front-ends (worldserve.tools.topology)
worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
    upstream worldserve {{
{servers}
    }}
    server {{
        listen {listen[0]}:{listen[1]};
{direct}
        location / {{
            proxy_pass http://worldserve;
            include {folder}/proxy.conf;
        }}
    }}
}}
"""


_PROXY_CONF = """proxy_http_version 1.1;
proxy_set_header Upgrade $http_upgrade;
proxy_set_header Connection $connection_upgrade;
proxy_set_header Host $http_host;
proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
proxy_read_timeout 3600s;
proxy_send_timeout 3600s;
proxy_buffering off;
"""


class Nginx:
    """nginx as a balancer, from a folder of its own; ``with Nginx(...) as lb:`` runs it until the block ends."""

    def __init__(self, listen: tuple[str, int], front_ends: Sequence[tuple[str, int]], folder: Path) -> None:
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light; `make services`).")
        self.binary = binary
        self.listen = listen
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "proxy.conf").write_text(_PROXY_CONF)
        self.config = folder / "nginx.conf"
        self.config.write_text(nginx_config(listen, front_ends, folder))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.listen[0]}:{self.listen[1]}"

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [self.binary, "-c", str(self.config), "-p", str(self.folder)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "stderr.log", "wb"),  # noqa: SIM115 -- the child holds it
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.log()}")
            with contextlib.suppress(OSError):
                socket.create_connection(self.listen, timeout=0.5).close()
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not listen on {self.listen} within {timeout} s: {self.log()}")

    def log(self) -> str:
        return "".join(
            (self.folder / name).read_text(errors="replace")
            for name in ("stderr.log", "error.log")
            if (self.folder / name).exists()
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: ends once its connections do ...
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()  # ... or at once
                self.process.wait()

    def __enter__(self) -> Nginx:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _healthy(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/healthz", timeout=1) as reply:
            if reply.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not healthy within {timeout} s")


@dataclass(frozen=True)
class Service:
    """A running service: its balancer, and each front-end's own address and process."""

    balancer: Nginx
    front_ends: tuple[tuple[str, int], ...]
    processes: tuple[subprocess.Popen[bytes], ...]
    folder: Path

    @property
    def url(self) -> str:
        """The balancer's HTTP URL (the page); its ``/v1/world`` is the service's WebSocket."""
        return self.balancer.url

    def door(self, index: int) -> str:
        """Front-end ``index``'s ``/v1/world`` through the balancer (its public URL's; 1-based)."""
        return f"ws://{self.balancer.listen[0]}:{self.balancer.listen[1]}{front_end_path(index)}/v1/world"


def start_ray(ray: Sequence[str], env: dict[str, str], *args: str) -> None:
    done = subprocess.run([*ray, "start", *args, "--disable-usage-stats"], env=env, capture_output=True, text=True)
    if done.returncode != 0:  # e.g. a folder so deep that Ray's socket paths pass the 107 bytes a socket takes
        raise RuntimeError(f"`ray start {' '.join(args)}` failed ({done.returncode}): {done.stderr[-2000:]}")


def processes_of(folder: Path) -> list[int]:
    """This machine's processes whose command line names ``folder`` (Linux's /proc), this one left out."""
    mark = str(folder).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if mark in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def stop_ray(folder: Path, timeout: float = 20.0) -> None:
    """End the Ray processes of this service alone (``ray stop`` would end every Ray on the machine): those
    whose command line names its folder (their session and socket paths are under it). Again until none
    is left: a raylet may start a worker while the others end."""
    deadline = time.monotonic() + timeout
    while found := processes_of(folder):
        late = time.monotonic() > deadline - timeout / 2
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


@contextlib.contextmanager
def service(
    front_ends: int = 2,
    *,
    worker_nodes: int = 0,
    host: str = "127.0.0.1",
    port: int = 0,
    serve_args: Sequence[str] = (),
    folder: Path | None = None,
    start_timeout: float = 180.0,
) -> Iterator[Service]:
    """Run a Ray head, ``worker_nodes`` Ray nodes for the workers (one CPU and one ``worldserve`` resource
    each; with any, each front-end runs one worker there: ``--executor ray``), ``front_ends`` front-ends
    sharing the head's session directory (each ``worldserve serve --directory ray`` with ``serve_args``) and
    nginx over them, until the block ends; then all of it is torn down."""
    folder = folder or Path(tempfile.mkdtemp(prefix="worldserve-service-"))
    folder.mkdir(parents=True, exist_ok=True)
    ray_port = _free_port(host)
    # A Ray of the service's own: its address file and token under the head's RAY_TMPDIR, so the front-ends
    # join it as `ray start`'s own cluster and Ray's token authentication needs nothing more. Each node has
    # a temporary folder of its own (two raylets of one machine cannot share one).
    env = {**os.environ, "RAY_TMPDIR": str(folder / "ray")}
    ray = [str(Path(sys.executable).with_name("ray"))]
    servers: list[subprocess.Popen[bytes]] = []
    try:
        start_ray(ray, env, "--head", "--port", str(ray_port), "--num-cpus", "0", "--num-gpus", "0",
                   "--include-dashboard", "false")  # fmt: skip
        for node in range(1, worker_nodes + 1):
            node_env = {**env, "RAY_TMPDIR": str(folder / f"ray-node-{node}"), "RAY_AUTH_MODE": "token"}
            start_ray(ray, node_env, "--address", f"{host}:{ray_port}", "--num-cpus", "1",
                       "--resources", '{"worldserve": 1}')  # fmt: skip
        workers = ["--executor", "ray", "--workers", "1", "--ray-resource", "worldserve=1"] if worker_nodes else []
        lb_port = port or _free_port(host)
        ports = [_free_port(host) for _ in range(front_ends)]
        for index, front_end_port in enumerate(ports, 1):
            public = f"http://{host}:{lb_port}{front_end_path(index)}"
            command = [sys.executable, "-m", "worldserve", "serve", "--host", host, "--port", str(front_end_port),
                       "--directory", "ray", "--public-url", public, *workers, *serve_args]  # fmt: skip
            log = open(folder / f"front-end-{index}.log", "wb")  # noqa: SIM115 -- the child holds it
            servers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        for front_end_port, process in zip(ports, servers, strict=True):
            _healthy(f"http://{host}:{front_end_port}", process, start_timeout)
        with Nginx((host, lb_port), [(host, p) for p in ports], folder / "nginx") as balancer:
            yield Service(balancer, tuple((host, p) for p in ports), tuple(servers), folder)
    finally:
        for process in servers:
            process.terminate()
        for process in servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=20)
        stop_ray(folder)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worldserve.tools.topology",
        description="Run a whole service on this machine: a Ray head, front-ends sharing its session "
        "directory, and nginx balancing over them; Ctrl-C tears it down.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address everything listens on")
    parser.add_argument("--port", type=int, default=8080, help="the balancer's port (0: a free one)")
    parser.add_argument("--front-ends", type=int, default=2, help="how many front-ends")
    parser.add_argument(
        "--worker-nodes",
        type=int,
        default=2,
        help="Ray nodes for the workers (each front-end then runs one worker there, --executor ray; 0: the "
        "front-ends' own processes)",
    )
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds each front-end may take to start")
    parser.add_argument("--folder", type=Path, default=None, help="where logs and configs go (default: a new temp dir)")
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: passed to each `worldserve serve` (--model ...)"
    )
    args = parser.parse_args(argv)
    if args.serve_args[:1] == ["--"]:
        args.serve_args = args.serve_args[1:]
    stop = False

    def ask_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    with service(
        args.front_ends,
        worker_nodes=args.worker_nodes,
        host=args.host,
        port=args.port,
        serve_args=args.serve_args,
        folder=args.folder,
        start_timeout=args.start_timeout,
    ) as running:
        print(f"worldserve service: {running.url}/ (logs and configs in {running.folder}); Ctrl-C stops it", flush=True)
        while not stop:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
