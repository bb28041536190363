"""The browser player in a real headless Chromium (Debian's), driven by Playwright.

The server runs the procedural model with raw frames, so every frame the page shows
can be matched exactly against the world rendered at some view position: holding a
key must move that position the right way, a prompt must switch the palette, and a
reset must bring back the start view.

Nothing here samples the canvas on a clock: a script added before the player loads
(:data:`RECORDER`) records every frame the player draws, with the player's own ``epoch``
and ``chunkIndex`` for it and when it was drawn, every chunk header the page receives,
every input event it sends and every key pressed (with its event's time). The tests wait on
those records (an event applied in chunk k, chunk k drawn) and check the frames drawn one by
one, in order, so they hold on a machine of any speed.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from runtime_models import carried_by, chunk_controls
from server_harness import RunningServer, start_server
from worldserve.models.world import Motion, World, style_for_prompt, velocity
from worldserve.protocol import ControlInput

CHROMIUM = os.environ.get("WORLDSERVE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
SEED = 11
SIZE = 48
FRAMES_PER_CHUNK = 4  # procedural's and tinyworld's

#: Added to the page before player.js runs; it leaves the player untouched. Each draw on the
#: ``#screen`` canvas (putImageData or drawImage) is recorded with the canvas's pixels; the
#: player's ``displayed``/``epoch``/``chunkIndex`` for that frame are read in a microtask,
#: once the player's frame callback (which draws, then updates them) has returned. The page's
#: WebSocket records each chunk header received and each input event sent.
RECORDER = """
(() => {
  const LIMIT = 4000;
  const log = { drawn: [], chunks: [], sent: [], dropped: [], keys: [], last: { epoch: -1, chunk: -1 } };
  window.__worldserveTest = log;
  const keep = (list, item) => { list.push(item); if (list.length > LIMIT) list.shift(); };
  const record = (context) => {
    if (!context.canvas || context.canvas.id !== "screen") return;
    const { width, height } = context.canvas;
    const rgba = context.getImageData(0, 0, width, height).data;
    let binary = "";
    for (let i = 0; i < rgba.length; i += 4) {
      binary += String.fromCharCode(rgba[i], rgba[i + 1], rgba[i + 2]);
    }
    const entry = { width, height, pixels: btoa(binary), at: performance.now() };
    keep(log.drawn, entry);
    queueMicrotask(() => {
      const player = window.worldserve;
      entry.displayed = player.displayed;
      entry.epoch = player.epoch;
      entry.chunk = player.chunkIndex;
      entry.seq = player.seq;
      entry.frame = player.frameInChunk;
      log.last = { epoch: entry.epoch, chunk: entry.chunk };
    });
  };
  for (const name of ["putImageData", "drawImage"]) {
    const original = CanvasRenderingContext2D.prototype[name];
    CanvasRenderingContext2D.prototype[name] = function (...args) {
      const result = original.apply(this, args);
      record(this);
      return result;
    };
  }
  // Each key pressed, with its event's time (the player's time base: performance.now()).
  window.addEventListener("keydown", (event) => {
    if (!event.repeat) keep(log.keys, { code: event.code, at: event.timeStamp });
  }, true);
  const NativeWebSocket = window.WebSocket;
  window.WebSocket = class extends NativeWebSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener("message", (event) => {
        if (typeof event.data !== "string") return;
        const message = JSON.parse(event.data);
        if (message.type === "chunk") {
          keep(log.chunks, { seq: message.seq, epoch: message.epoch, chunk: message.chunk_index,
                             applied: message.applied_event_ids, supersedes: message.supersedes ?? null });
        }
        if (message.type === "input.dropped") keep(log.dropped, [message.event_ids, message.detail || ""]);
      });
    }
    send(data) {
      if (typeof data === "string") {
        const message = JSON.parse(data);
        if (message.type === "input.event") keep(log.sent, message);
      }
      return super.send(data);
    }
  };
})();
"""


@dataclass(frozen=True, slots=True)
class Drawn:
    """One frame the player drew: its number (the player's ``displayed``), epoch, chunk, pixels, and when
    (``performance.now()`` in the page, milliseconds)."""

    number: int
    epoch: int
    chunk: int
    frame: npt.NDArray[np.uint8]
    at: float = 0.0
    seq: int = -1  # the chunk's seq (a preemption's replacement has the chunk index of the one it replaced)
    index: int = -1  # the frame within its chunk


class Recording:
    """The page's records (see :data:`RECORDER`), read from Python."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self._drawn: list[Drawn] = []

    def drawn(self) -> list[Drawn]:
        """Every frame drawn so far, in the order drawn."""
        entries = self.page.evaluate("() => window.__worldserveTest.drawn.splice(0)")
        for entry in entries:
            pixels = np.frombuffer(base64.b64decode(entry["pixels"]), dtype=np.uint8)
            frame = pixels.reshape(entry["height"], entry["width"], 3)
            self._drawn.append(
                Drawn(
                    entry["displayed"], entry["epoch"], entry["chunk"], frame, entry["at"],
                    entry.get("seq", -1), entry.get("frame", -1),
                )
            )  # fmt: skip
        return list(self._drawn)

    def sent_event(self, condition: str) -> dict[str, Any]:
        """The last input event sent that satisfies the JS predicate ``condition`` (waits for one)."""
        handle = self.page.wait_for_function(
            f"() => {{ const match = ({condition}); const found = window.__worldserveTest.sent.filter(match);"
            " return found.length ? found[found.length - 1] : null; }",
            timeout=TIMEOUT_MS,
        )
        event: dict[str, Any] = handle.json_value()
        return event

    def applied_in(self, event_id: int) -> tuple[int, int]:
        """``(epoch, chunk_index)`` of the chunk that applied ``event_id`` (waits for it)."""
        handle = self.page.wait_for_function(
            f"() => {{ const c = window.__worldserveTest.chunks.find((c) => c.applied.includes({event_id}));"
            " return c ? [c.epoch, c.chunk] : null; }",
            timeout=TIMEOUT_MS,
        )
        epoch, chunk = handle.json_value()
        return int(epoch), int(chunk)

    def wait_drawn(self, epoch: int, chunk: int) -> None:
        """Wait until the player has drawn every frame of ``chunk`` (the first frame of a later one)."""
        wait_for(
            self.page,
            f"(() => {{ const last = window.__worldserveTest.last; return last.epoch > {epoch}"
            f" || (last.epoch === {epoch} && last.chunk > {chunk}); }})()",
        )


TIMEOUT_MS = 180_000  # generous: a busy CPU may generate far slower than real time

#: A real browser and server: generous, so that a slow or busy CPU passes too.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


#: Whether the page's canvas (what the download records) holds a frame: any pixel not black.
CANVAS_DRAWN = """() => {
  const canvas = document.getElementById('screen');
  const rgba = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  return rgba.some((value, i) => i % 4 !== 3 && value > 16);
}"""


@contextlib.contextmanager
def open_page(server: RunningServer, query: str = "?media=raw", recorder: str = RECORDER) -> Iterator[Page]:
    """The player page of ``server`` in Debian's headless Chromium, with ``recorder`` (:data:`RECORDER`) added.

    ``query``: raw frames by default, so that every frame drawn can be matched exactly
    (``test_browser_h264`` plays the default, H.264)."""
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}; `make test` installs Debian's chromium package.")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                # WebRTC on one machine: host candidates as addresses, not mDNS names a peer cannot resolve.
                "--disable-features=WebRtcHideLocalIpsWithMdns",
            ],
        )
        page = browser.new_page()
        page.add_init_script(recorder)
        page.goto(server.http + "/" + query)
        yield page
        browser.close()


def canvas(page: Page) -> npt.NDArray[np.uint8]:
    data = page.evaluate(
        "() => { const c = document.getElementById('screen');"
        " return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"
    )
    return np.asarray(data, dtype=np.uint8).reshape(SIZE, SIZE, 4)[..., :3]


def locate(frame: npt.NDArray[np.uint8], style: str, xs: range, ys: range) -> tuple[int, int] | None:
    """The view position whose rendering equals ``frame`` exactly, if any."""
    world = World(SEED)
    for y in ys:
        for x in xs:
            if np.array_equal(world.render(x, y, SIZE, SIZE, style), frame):
                return (x, y)
    return None


#: What a page test that timed out reports of the page: its figures, each <video>'s state, its log's last lines.
_PAGE_STATE = """() => {
  const w = window.worldserve || {};
  const figures = {};
  for (const name of ["status", "role", "transport", "media", "epoch", "chunkIndex", "seq", "displayed", "superseded",
                      "resumes", "restarts", "jitter", "receivedSeqs", "h264Nudges"]) {
    try { figures[name] = w[name]; } catch (error) { figures[name] = String(error); }
  }
  const videos = [...document.querySelectorAll("video")].map((v) => ({
    paused: v.paused, readyState: v.readyState, currentTime: v.currentTime, error: v.error && v.error.code,
    buffered: [...Array(v.buffered.length).keys()].map((i) => [v.buffered.start(i), v.buffered.end(i)]),
  }));
  const log = [...document.querySelectorAll("#log li")].slice(-12).map((item) => item.textContent);
  return { figures, videos, log };
}"""


def wait_for(page: Page, condition: str, timeout: float = TIMEOUT_MS / 1000) -> None:
    """Wait until ``condition`` holds in the page; on a timeout, fail saying what the page was doing."""
    try:
        page.wait_for_function(condition, timeout=timeout * 1000)
    except PlaywrightTimeoutError:
        try:
            state = page.evaluate(_PAGE_STATE)
        except PlaywrightError as error:
            state = f"(the page could not be read: {error})"
        raise AssertionError(f"not true after {timeout:.0f} s: {condition}; the page: {state}") from None


def assert_in_chunk_order(drawn: list[Drawn], *, whole_chunks: bool = True, every_chunk: bool = True) -> None:
    """Every frame drawn once, in order: consecutive numbers, chunks in order, whole chunks
    (``whole_chunks=False``: no chunk missing, but a chunk's frames may be passed over; ``every_chunk=False``:
    all of a chunk's frames too, as a browser's compositor stalled on a busy machine passes them over)."""
    assert [d.number for d in drawn] == list(range(1, len(drawn) + 1)), "a drawn frame was not recorded"
    keys = [(d.epoch, d.chunk) for d in drawn]
    assert keys == sorted(keys), keys
    for epoch in sorted({d.epoch for d in drawn}):
        chunks = [d.chunk for d in drawn if d.epoch == epoch]
        runs = [chunks.count(c) for c in sorted(set(chunks))]
        assert not every_chunk or sorted(set(chunks)) == list(range(chunks[0], chunks[-1] + 1)), chunks  # none skipped
        # Whole chunks, except the last: still playing, or cut short by a reset.
        assert not whole_chunks or all(n == FRAMES_PER_CHUNK for n in runs[:-1]), chunks
        assert runs[-1] <= FRAMES_PER_CHUNK, chunks


def page_controls(sent: list[dict[str, Any]]) -> dict[int, list[ControlInput]]:
    """The controls of each input event a page sent, by its event id."""
    return {
        event["event_id"]: [ControlInput(c["track"], c["schema"], c["data"]) for c in event.get("controls", ())]
        for event in sent
    }


def replay(recording: Recording, drawn: list[Drawn], start_prompt: str) -> list[tuple[int, int, str]]:
    """Where each drawn frame must show the world, and in which style, by the events applied.

    The procedural world's rules replayed on the page's records: each chunk applies its
    ``applied_event_ids`` in order (a prompt replaces the prompt, a control replaces its
    track's; a key tapped since the chunk before is held in it: ``chunk_controls``), then the
    view moves by :func:`velocity` each frame; a reset starts over from the start view, the
    start prompt and no controls.
    """
    sent = recording.page.evaluate("() => window.__worldserveTest.sent")
    chunks = recording.page.evaluate("() => window.__worldserveTest.chunks")
    carried = carried_by(recording.page.evaluate("() => window.__worldserveTest.dropped"))
    events = {event["event_id"]: event for event in sent}
    controls_of = page_controls(sent)
    applied = {(c["epoch"], c["chunk"]): c["applied"] for c in chunks}
    expected: list[tuple[int, int, str]] = []
    for epoch in sorted({d.epoch for d in drawn}):
        motion, prompt, controls = Motion(), start_prompt, dict[str, ControlInput]()
        shown = [d for d in drawn if d.epoch == epoch]
        for chunk in range(shown[-1].chunk + 1):
            for event_id in applied[(epoch, chunk)]:
                prompt = events[event_id].get("prompt", prompt)
            held = chunk_controls(controls, applied[(epoch, chunk)], controls_of, carried)
            positions = motion.advance(*velocity(held), FRAMES_PER_CHUNK)
            count = sum(1 for d in shown if d.chunk == chunk)
            expected += [(x, y, style_for_prompt(prompt)) for x, y in positions[:count]]
    return expected


def assert_replayed(recording: Recording, drawn: list[Drawn], start_prompt: str) -> list[tuple[int, int]]:
    """Every drawn frame is exactly the world where :func:`replay` puts it; returns the positions."""
    world = World(SEED)
    expected = replay(recording, drawn, start_prompt)
    assert len(expected) == len(drawn)
    for d, (x, y, style) in zip(drawn, expected, strict=True):
        if not np.array_equal(world.render(x, y, SIZE, SIZE, style), d.frame):
            found = locate(d.frame, style, range(x - 40, x + 41), range(y - 8, y + 9))
            raise AssertionError(
                f"frame {d.number} (epoch {d.epoch}, chunk {d.chunk}) should be the {style} world at {(x, y)};"
                f" it is at {found} (None: not that style near there)"
            )
    return [(x, y) for x, y, _ in expected]


def keys_event(held: str) -> str:
    return f"(e) => e.controls && e.controls[0].track === 'keys' && e.controls[0].data.held.join() === '{held}'"


def test_player_moves_switches_style_and_resets(page: Page) -> None:
    recording = Recording(page)
    page.fill("#prompt", "islands")
    page.fill("#seed", str(SEED))
    page.click("#start")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
    # No keys held: the view stays at the start position.
    assert all(locate(d.frame, "islands", range(0, 1), range(0, 1)) == (0, 0) for d in recording.drawn())

    # Holding D moves the view right by KEY_SPEED (2 px) every frame, from the chunk that applied
    # it to the chunk that applied its release; never back, never skipping a frame.
    page.click("#screen")
    page.keyboard.down("KeyD")
    _, pressed = recording.applied_in(recording.sent_event(keys_event("D"))["event_id"])
    recording.wait_drawn(0, pressed + 2)
    page.keyboard.up("KeyD")
    _, released = recording.applied_in(recording.sent_event(keys_event(""))["event_id"])
    recording.wait_drawn(0, released + 1)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    positions = assert_replayed(recording, drawn, "islands")
    steps = [(b[0] - a[0], b[1] - a[1], d.chunk) for a, b, d in zip(positions, positions[1:], drawn[1:], strict=False)]
    assert all((dx, dy) == ((2, 0) if pressed <= chunk < released else (0, 0)) for dx, dy, chunk in steps), steps
    stopped = positions[-1]
    assert stopped[0] >= 2 * FRAMES_PER_CHUNK * 3, positions  # D took effect in 3 chunks at least

    # A prompt switches the palette from the chunk that applied it on, at the same view.
    before = len(drawn)
    page.fill("#prompt", "a snowy tundra")
    page.click("#apply-prompt")
    _, switched = recording.applied_in(recording.sent_event("(e) => e.prompt === 'a snowy tundra'")["event_id"])
    recording.wait_drawn(0, switched + 1)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    assert_replayed(recording, drawn, "islands")
    for d in drawn[before:]:
        style = "snow" if d.chunk >= switched else "islands"
        assert locate(d.frame, style, range(stopped[0], stopped[0] + 1), range(0, 1)) == stopped, (d.chunk, switched)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-player.png"))

    page.click("#reset")
    recording.wait_drawn(1, 1)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    # After a reset the world starts over: start view, start prompt's style.
    restarted = [d for d in drawn if d.epoch == 1]
    assert restarted
    assert all(locate(d.frame, "islands", range(0, 1), range(0, 1)) == (0, 0) for d in restarted)

    # Dragging grabs the world: pulling it to the right pans the camera left. The drag goes on,
    # at a person's pace, until a chunk after the one that applied its first pan has been
    # generated, so the pan lasts a whole chunk whatever the machine's speed.
    first_drag_event = 1 + max(int(e["event_id"]) for e in page.evaluate("() => window.__worldserveTest.sent"))
    box = page.locator("#screen").bounding_box()
    assert box is not None
    x0, y0 = box["x"] + 8, box["y"] + box["height"] / 2
    panned_on = f"""() => {{
        const log = window.__worldserveTest;
        // Any pan of this drag: held controls coalesce, so an earlier one may be superseded.
        const pans = log.sent.filter((e) => e.event_id >= {first_drag_event} && e.controls
                                            && e.controls[0].track === "camera" && e.controls[0].data.dx < 0);
        const chunk = log.chunks.find((c) => pans.some((pan) => c.applied.includes(pan.event_id)));
        return Boolean(chunk) && log.chunks.some((c) => c.epoch === chunk.epoch && c.chunk > chunk.chunk);
    }}"""
    viewport = page.viewport_size
    assert viewport is not None
    page.mouse.move(x0, y0)
    page.mouse.down()
    step = 0
    while not page.evaluate(panned_on):
        step += 1
        assert x0 + step * 6 < viewport["width"], "the drag reached the page's edge before a pan was applied"
        page.mouse.move(x0 + step * 6, y0)
        time.sleep(0.05)  # a person's drag: 6 screen px per 50 ms
    page.mouse.up()
    release = recording.sent_event(
        f"(e) => e.event_id >= {first_drag_event} && e.controls && e.controls[0].track === 'camera'"
        " && e.controls[0].data.dx === 0 && e.controls[0].data.dy === 0"
    )
    _, stop = recording.applied_in(release["event_id"])
    recording.wait_drawn(1, stop + 1)
    drawn = recording.drawn()
    assert_in_chunk_order(drawn)
    restarted = [d for d in drawn if d.epoch == 1]
    positions = assert_replayed(recording, restarted, "islands")
    xs = [x for x, _ in positions]
    assert all(y == 0 for _, y in positions), positions  # a horizontal drag
    assert xs == sorted(xs, reverse=True), xs  # the camera pans left, never back
    assert xs[-1] < 0, xs
    assert len({p for p, d in zip(positions, restarted, strict=True) if d.chunk >= stop}) == 1, positions  # stopped
