"""The player as a new user meets it, in a real headless Chromium (Debian's), against real servers.

Connections are cut for real: the page talks to the server through a TCP proxy
(:mod:`tcp_proxy`) that aborts every connection on demand, so the browser sees what a
network failure gives it (1006, no close frame). A restart is a real SIGTERM and a new
server process. Every wait is for something the page or the server did (a status, a frame
drawn, a message), never a sample on a clock, so the tests hold on a machine of any speed.
Screenshots go to ``artifacts/`` (the fullscreen view and the phone layout).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from server_harness import RunningServer, start_server
from tcp_proxy import TcpProxy
from test_browser import (
    ARTIFACTS,
    CHROMIUM,
    RECORDER,
    Recording,
    assert_in_chunk_order,
    keys_event,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

FRAME_MS = 1000 / 16  # procedural's frame period


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}; `make test` installs Debian's chromium package.")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


@contextlib.contextmanager
def player(browser: Browser, url: str, **context: object) -> Iterator[Page]:
    """A fresh browser context (no shared storage) with the recorder, at ``url``."""
    opened = browser.new_context(**context)  # type: ignore[arg-type]
    try:
        page = opened.new_page()
        page.add_init_script(RECORDER)
        page.goto(url)
        yield page
    finally:
        opened.close()


def start(page: Page, seed: int = 11, prompt: str = "islands", token: str | None = None) -> str:
    page.fill("#prompt", prompt)
    page.fill("#seed", str(seed))
    if token is None:
        page.click("#start")
    else:  # typed last and sent with Enter: the token field's change (on blur) has the page learn the model,
        # which can move the Start button between a click's press and release, and the click then is lost
        page.fill("#token", token)
        page.press("#token", "Enter")
    wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
    # The page's default: H.264 through Media Source Extensions, so these tests run every feature of
    # the player (resume, restart, key->screen, download, ...) over its H.264 playback.
    assert page.evaluate("() => window.worldserve.media") == "h264"
    session_id: str = page.evaluate("() => window.worldserve.sessionId")
    return session_id


def more_frames(page: Page, count: int = 8) -> None:
    """Wait until the player has drawn ``count`` more frames than now."""
    shown = page.evaluate("() => window.worldserve.displayed")
    wait_for(page, f"window.worldserve.displayed >= {shown + count}")


# -- connections lost and found ------------------------------------------------------------------


def test_two_drops_in_a_row_both_resume(browser: Browser, server: RunningServer) -> None:
    with TcpProxy(server.port) as proxy, player(browser, proxy.http + "/") as page:
        recording = Recording(page)
        session_id = start(page)
        for drop in (1, 2):
            proxy.drop()  # the network fails: no close frame either way
            wait_for(page, f"window.worldserve.resumes === {drop} && window.worldserve.status === 'live'")
            more_frames(page)
        assert page.evaluate("() => window.worldserve.sessionId") == session_id
        log = page.evaluate("() => window.worldserve.statusLog")
        assert log.count("reconnecting") == 2, log
        # The same world, every chunk received once and in order across both drops (the resume's
        # promise). What is drawn is in order, but not every frame: the chunks a resume re-sends can put
        # the <video> more than a second behind the live edge on a busy machine, where the player jumps to
        # it by design (mseTick), and a compositor stalled by a busy machine passes frames over, a whole
        # chunk's too (both seen with every core busy).
        seqs = page.evaluate("() => window.worldserve.receivedSeqs")
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert_in_chunk_order(recording.drawn(), whole_chunks=False, every_chunk=False)


def test_a_reload_goes_on_in_the_same_world_from_a_fresh_h264_start(browser: Browser, server: RunningServer) -> None:
    """A reloaded page has no decoder: it resumes its world (kept in sessionStorage, parked by its
    4001 close) asking for a keyframe, and plays H.264 again from the IDR frame that comes."""
    with player(browser, server.http + "/") as page:
        session_id = start(page)
        links = page.evaluate("() => window.worldserve.shareLinks")
        page.reload()
        wait_for(page, "window.worldserve.resumes === 1 && window.worldserve.status === 'live'")
        assert page.evaluate("() => window.worldserve.sessionId") == session_id
        assert page.evaluate("() => window.worldserve.role") == "host"
        more_frames(page)  # drawn: the new page's MSE got the init segment and an IDR frame first
        assert page.evaluate("() => window.worldserve.media") == "h264"
        assert page.evaluate("() => window.worldserve.shareLinks") == links  # still the host's links
        page.click("#close")
        wait_for(page, "window.worldserve.status === 'idle'")
        page.reload()  # a world closed on purpose is not resumed
        assert page.evaluate("() => window.worldserve.statusLog") == ["idle"]


def test_after_the_grace_the_player_offers_a_new_world(browser: Browser) -> None:
    running = start_server("--model", "procedural", "--resume-grace-s", "2")
    try:
        with TcpProxy(running.port) as proxy, player(browser, proxy.http + "/") as page:
            old = start(page)
            proxy.refuse(True)  # the network stays down ...
            proxy.drop()
            wait_for(page, "window.worldserve.status === 'lost'")  # ... past the server's 2 s grace
            log = page.evaluate("() => window.worldserve.statusLog")
            assert log[log.index("reconnecting") :] == ["reconnecting", "lost"], log
            assert "Press Start for a new one" in page.inner_text("#notice")
            assert page.evaluate("() => window.worldserve.shareLinks") == {"viewer": "", "controller": ""}
            proxy.refuse(False)
            page.click("#start")  # the offer: a new world
            wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
            assert page.evaluate("() => window.worldserve.sessionId") != old
    finally:
        running.stop()


def test_a_server_restart_mid_session_ends_in_a_playing_world_without_a_click(browser: Browser) -> None:
    first = start_server("--model", "procedural")
    second: RunningServer | None = None
    try:
        with TcpProxy(first.port) as proxy, player(browser, proxy.http + "/") as page:
            old = start(page, seed=5, prompt="desert")
            old_links = page.evaluate("() => window.worldserve.shareLinks")
            assert old in old_links["viewer"]
            first.process.send_signal(signal.SIGTERM)  # the server tells every member "shutdown", then stops
            wait_for(page, "window.worldserve.status === 'restarting'")
            # The dead world's share links are gone at once.
            assert page.evaluate("() => window.worldserve.shareLinks") == {"viewer": "", "controller": ""}
            assert page.is_hidden("#share")
            first.process.wait(timeout=60)
            second = start_server("--model", "procedural")
            proxy.target = second.port  # the same address, a new server behind it
            wait_for(page, f"window.worldserve.status === 'live' && window.worldserve.sessionId !== '{old}'")
            more_frames(page)
            links = page.evaluate("() => window.worldserve.shareLinks")
            new = page.evaluate("() => window.worldserve.sessionId")
            assert new in links["viewer"]
            assert old not in links["viewer"] + links["controller"]
            assert page.evaluate("() => window.worldserve.restarts") == 1
            # The same start prompt and seed: the new world is the old one started over.
            assert page.evaluate("() => window.worldserve.role") == "host"
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_failed_handshake_within_the_grace_is_retried_and_only_a_refused_origin_is_named(
    browser: Browser, server: RunningServer
) -> None:
    # The socket drops, and the next handshakes fail while the server answers HTTP: not a refusal, so
    # the page goes on trying within the resume grace and takes its world back.
    with TcpProxy(server.port) as proxy, player(browser, proxy.http + "/") as page:
        session_id = start(page)
        proxy.refuse_websockets(True)
        proxy.drop()
        deadline = time.monotonic() + 60
        while proxy.websockets_refused < 2 and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        assert proxy.websockets_refused >= 2, page.evaluate("() => window.worldserve.statusLog")
        assert page.evaluate("() => window.worldserve.status") == "reconnecting"
        proxy.refuse_websockets(False)
        wait_for(page, "window.worldserve.resumes === 1 && window.worldserve.status === 'live'")
        assert page.evaluate("() => window.worldserve.sessionId") == session_id
        assert "error" not in page.evaluate("() => window.worldserve.statusLog")
        more_frames(page)

    # Behind a proxy that sends the server its own address as Host, the page's origin is not the server's
    # own: the server says so (POST /v1/origin), and the page names it.
    with TcpProxy(server.port) as proxy, player(browser, proxy.http + "/") as page:
        proxy.rewrite_host = True
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'error'")
        assert "refused this page's origin" in page.inner_text("#notice")
        assert page.inner_text("#status") == "refused (origin)"


# -- a server with a token --------------------------------------------------------------------


def test_a_token_server_refuses_readably_and_a_token_share_link_joins(browser: Browser) -> None:
    running = start_server("--model", "procedural", token="s3cret")
    try:
        with player(browser, running.http + "/") as page:
            page.click("#start")  # no token: the browser only says 1006; the page finds out why
            wait_for(page, "window.worldserve.status === 'error'")
            assert "needs a token" in page.inner_text("#notice")
            assert "needs a token" in page.inner_text("#status")
            page.fill("#token", "wrong")
            page.press("#token", "Enter")  # not a click: see start()
            wait_for(page, "window.worldserve.statusLog.filter((s) => s === 'error').length === 2")
            assert "refused this token" in page.inner_text("#notice")
            session_id = start(page, token="s3cret")

            plain = page.evaluate("() => window.worldserve.shareLinks")["viewer"]
            assert "s3cret" not in plain  # the server's token is in a link only when the host says so
            page.check("#share-token")
            with_token = page.evaluate("() => window.worldserve.shareLinks")["viewer"]
            assert with_token.endswith("#auth=s3cret"), with_token

            with player(browser, with_token) as viewer:  # a link with the token joins at once
                wait_for(viewer, "window.worldserve.status === 'live' && window.worldserve.displayed > 2")
                assert viewer.evaluate("() => [window.worldserve.role, window.worldserve.sessionId]") == [
                    "viewer",
                    session_id,
                ]
                assert "s3cret" not in viewer.url  # taken out of the address bar

            with player(browser, plain) as viewer:  # a link without it: asked for, then joins (not a new world)
                wait_for(viewer, "window.worldserve.status === 'error'")
                assert "needs a token" in viewer.inner_text("#notice")
                assert viewer.inner_text("#start") == "Join"
                viewer.fill("#token", "s3cret")
                viewer.press("#token", "Enter")  # not a click: see start()
                wait_for(viewer, "window.worldserve.status === 'live'")
                assert viewer.evaluate("() => [window.worldserve.role, window.worldserve.sessionId]") == [
                    "viewer",
                    session_id,
                ]
    finally:
        running.stop()


# -- the delay you feel ----------------------------------------------------------------------


def test_key_to_photon_is_what_the_page_measures(browser: Browser, server: RunningServer) -> None:
    """The figure the overlay shows (key event to the first frame on screen that applied it) is within
    one frame period of the test's own measure from the page's records."""
    with player(browser, server.http + "/") as page:
        recording = Recording(page)
        start(page)
        page.click("#screen")
        page.keyboard.down("KeyD")
        event = recording.sent_event(keys_event("D"))
        epoch, chunk = recording.applied_in(event["event_id"])
        recording.wait_drawn(epoch, chunk)
        shown = page.evaluate("() => window.worldserve.keyToPhotonMs")  # read before any later key is applied
        page.keyboard.up("KeyD")
        pressed = [key["at"] for key in page.evaluate("() => window.__worldserveTest.keys") if key["code"] == "KeyD"]
        first_frame = next(d for d in recording.drawn() if (d.epoch, d.chunk) == (epoch, chunk))
        measured = first_frame.at - pressed[0]
        assert measured > 0
        assert shown is not None
        assert abs(shown - measured) <= FRAME_MS, (shown, measured)
        server_figure = page.evaluate("() => window.worldserve.serverAppliedMs")
        assert server_figure is not None
        assert server_figure >= 0
        _parts_sum_to_the_total(page)  # H.264: the <video> decodes, so its decoding is in "buffer"
        overlay = page.inner_text("#overlay")
        assert "key→screen ms" in overlay
        assert "server applied ms" in overlay


def _parts_sum_to_the_total(page: Page) -> dict[str, float]:
    """The page's key->screen parts for the last key: each the part docs/latency.md names, and they
    add up to the total (the overlay's line too, to its rounding)."""
    parts: dict[str, float] = page.evaluate("() => window.worldserve.keyToPhotonParts")
    assert parts is not None
    assert set(parts) == {"total", "wait_tick", "step", "encode", "transfer", "decode", "buffer"}, parts
    total = parts.pop("total")
    assert abs(sum(parts.values()) - total) <= FRAME_MS, (parts, total)
    assert all(value >= -1.0 for value in parts.values()), parts  # each a duration (the clocks differ by < 1 ms)
    shown = page.evaluate(
        "() => [document.getElementById('stat-photon-ms').textContent,"
        " document.getElementById('stat-photon-parts').textContent]"
    )
    numbers = [float(n) for n in re.findall(r"-?\d+", shown[1])]
    assert re.fullmatch(r"tick -?\d+ · step -?\d+ · enc -?\d+ · net -?\d+ · dec -?\d+ · buf -?\d+", shown[1]), shown
    assert abs(sum(numbers) - float(shown[0])) <= FRAME_MS, shown
    return parts


def test_the_jitter_buffer_grows_after_stalls_and_shrinks_back_and_the_overlay_splits_key_to_photon(
    browser: Browser, server: RunningServer
) -> None:
    """JPEG through a proxy that holds the server's bytes back until the page has run dry, three times:
    each stall is an underrun that grows the jitter target a frame; once the stalls stop it shrinks
    back to one frame. Then a key's key->screen figure comes with its parts, which add up to it."""
    with TcpProxy(server.port) as proxy, player(browser, proxy.http + "/?media=jpeg") as page:
        recording = Recording(page)
        page.click("#start")
        wait_for(page, "window.worldserve.status === 'live' && window.worldserve.displayed > 4")
        assert page.evaluate("() => window.worldserve.media") == "jpeg"
        assert page.text_content("#stat-jitter") is not None
        stalls = 3
        for _ in range(stalls):
            # Read while playing, so that a stall makes it run dry past this count: a page already stopped (a chunk
            # late on a busy box, an underrun of its own) would wait through a stall without running dry again.
            jitter = page.evaluate("() => window.worldserve.jitter")
            while not jitter["playing"]:
                wait_for(page, "window.worldserve.jitter.playing")
                jitter = page.evaluate("() => window.worldserve.jitter")
            proxy.hold(True)  # the network stalls: nothing reaches the page ...
            wait_for(page, f"window.worldserve.jitter.underruns > {jitter['underruns']}")  # ... until it ran dry
            proxy.hold(False)
            grown = page.evaluate("() => window.worldserve.jitter")
            assert grown["target"] == 8 or grown["changes"][-1][0] == "grow", grown  # (8: two chunks, the cap)
            more_frames(page)  # playing again
        jitter = page.evaluate("() => window.worldserve.jitter")
        assert jitter["underruns"] >= stalls
        assert jitter["most"] >= 2  # it grew (a calm spell between two stalls may have shrunk it meanwhile)
        grows = [target for kind, target in jitter["changes"] if kind == "grow"]
        assert len(grows) >= stalls
        targets = [1] + [target for _, target in jitter["changes"]]  # a frame at a time, from 1 up to two chunks
        assert all(1 <= target <= 8 for target in targets), jitter
        assert all(abs(b - a) == 1 for a, b in itertools.pairwise(targets)), jitter
        assert int(page.text_content("#stat-underruns") or "0") >= stalls
        # No more stalls: back to one frame of slack (a frame per calm spell), nothing dropped meanwhile.
        wait_for(
            page,
            "window.worldserve.jitter.target === 1 && window.worldserve.jitter.changes.at(-1)[0] === 'shrink'",
        )
        # The overlay shows it at the next animation frame (the target may change between two of them).
        wait_for(page, "document.getElementById('stat-jitter').textContent === '1'")
        assert_in_chunk_order(recording.drawn())  # every frame of every chunk, in order

        page.click("#screen")
        page.keyboard.down("KeyD")
        event = recording.sent_event(keys_event("D"))
        epoch, chunk = recording.applied_in(event["event_id"])
        recording.wait_drawn(epoch, chunk)
        parts = _parts_sum_to_the_total(page)
        page.keyboard.up("KeyD")
        assert parts["buffer"] > 0, parts  # at least the frame of slack


# -- what a user sees and can do ----------------------------------------------------------------


def _contrast(foreground: tuple[float, ...], background: tuple[float, ...]) -> float:
    def luminance(rgb: tuple[float, ...]) -> float:
        def channel(value: float) -> float:
            value /= 255
            return value / 12.92 if value <= 0.03928 else ((value + 0.055) / 1.055) ** 2.4

        r, g, b = (channel(v) for v in rgb[:3])
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def _rgba(css: str) -> tuple[float, ...]:
    values = [float(v) for v in re.findall(r"[\d.]+", css)]
    return tuple(values) if len(values) == 4 else (*values, 1.0)


def test_overlay_reads_on_any_background_and_hides_help_and_viewer_controls(
    browser: Browser, server: RunningServer
) -> None:
    with player(browser, server.http + "/") as page:
        start(page)
        plate = _rgba(page.eval_on_selector("#overlay", "e => getComputedStyle(e).backgroundColor"))
        for selector in ("#overlay dt", "#overlay dd"):
            text = _rgba(page.eval_on_selector(selector, "e => getComputedStyle(e).color"))
            for under in ((255, 255, 255), (0, 0, 0), (230, 200, 140)):  # snow, night, sand
                alpha = plate[3]
                seen = tuple(alpha * p + (1 - alpha) * u for p, u in zip(plate[:3], under, strict=True))
                assert _contrast(text, seen) >= 4.5, (selector, under, text, plate)  # WCAG AA
        page.click("#screen")
        page.keyboard.press("KeyO")
        assert page.is_hidden("#overlay")
        page.click("#toggle-overlay")
        assert page.is_visible("#overlay")
        page.keyboard.press("KeyH")
        assert page.is_visible("#help")
        assert "right stick" in page.inner_text("#help")
        page.keyboard.press("Escape")
        assert page.is_hidden("#help")
        assert page.is_hidden("#weights-warning")  # the procedural world is no random network

        # Reset: a "resetting…" state until the new epoch's first frame, and the old prompt cleared.
        page.fill("#prompt", "a snowy tundra")
        page.click("#apply-prompt")
        page.click("#reset")
        wait_for(page, "window.worldserve.epoch === 1 && window.worldserve.status === 'live'")
        log = page.evaluate("() => window.worldserve.statusLog")
        assert log[-2:] == ["resetting", "live"], log
        assert page.input_value("#prompt") == ""
        assert page.get_attribute("#prompt", "placeholder") == "islands"

        # A viewer sees no control that would do nothing.
        link = page.evaluate("() => window.worldserve.shareLinks")["viewer"]
        with player(browser, link) as viewer:
            wait_for(viewer, "window.worldserve.status === 'live'")
            for selector in ("#apply-prompt", "#presets", "#prompt", "#reset", "#touchpad"):
                assert viewer.is_hidden(selector), selector
            assert viewer.is_visible("#close")
        # The copy buttons say what they did.
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        page.click("#copy-viewer")
        wait_for(page, "document.getElementById('copied').textContent.includes('viewer link')")


def test_random_weights_are_shown_on_screen(browser: Browser) -> None:
    running = start_server("--model", "runtime_models:RandomWeightsModel", test_models=True)
    try:
        with player(browser, running.http + "/") as page:
            start(page)
            assert page.is_visible("#weights-warning")
            assert page.inner_text("#weights-warning") == "RANDOM WEIGHTS"
    finally:
        running.stop()


def test_fullscreen_phone_layout_and_touch(browser: Browser, server: RunningServer) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with player(browser, server.http + "/") as page:
        start(page)
        page.click("#fullscreen")
        wait_for(page, "document.fullscreenElement && document.fullscreenElement.id === 'screen-box'")
        page.screenshot(path=str(ARTIFACTS / "player-fullscreen.png"))
        page.keyboard.press("KeyF")
        wait_for(page, "document.fullscreenElement === null")

    phone = {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True, "device_scale_factor": 2}
    with player(browser, server.http + "/", **phone) as page:
        recording = Recording(page)
        start(page)
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 390, width  # nothing wider than the phone
        box = page.locator("#screen").bounding_box()
        assert box is not None
        assert box["x"] >= 0, box
        assert box["x"] + box["width"] <= 390, box
        assert box["width"] >= 300, box  # the view uses the width it has
        assert page.is_visible("#touchpad")
        page.screenshot(path=str(ARTIFACTS / "player-phone.png"), full_page=True)
        pad = page.locator("#touchpad button[data-key='D']")
        pad.dispatch_event("pointerdown", {"pointerId": 7, "isPrimary": True, "pointerType": "touch"})
        held = recording.sent_event(keys_event("D"))
        pad.dispatch_event("pointerup", {"pointerId": 7, "isPrimary": True, "pointerType": "touch"})
        released = recording.sent_event(keys_event(""))
        assert released["event_id"] > held["event_id"]
    assert (ARTIFACTS / "player-fullscreen.png").stat().st_size > 0
    assert (ARTIFACTS / "player-phone.png").stat().st_size > 0


#: A standard-mapping gamepad the test moves: ``window.__pad.axes`` / ``.buttons`` (before the player loads).
GAMEPAD = """
(() => {
  const pad = { id: "test pad", index: 0, connected: true, mapping: "standard", timestamp: 0,
                axes: [0, 0, 0, 0], buttons: Array.from({ length: 17 }, () => ({ pressed: false, value: 0 })) };
  window.__pad = pad;
  navigator.getGamepads = () => [pad];
})();
"""


def test_gamepad_left_stick_moves_right_stick_pans(browser: Browser, server: RunningServer) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.add_init_script(RECORDER)
        page.add_init_script(GAMEPAD)
        page.goto(server.http + "/")
        recording = Recording(page)
        start(page)
        page.evaluate("() => { window.__pad.axes = [0.9, 0, 0, 0]; }")  # left stick right
        recording.sent_event(keys_event("D"))
        page.evaluate("() => { window.__pad.axes = [0, 0, 0.5, -1]; }")  # left stick back, right stick right/up
        recording.sent_event(keys_event(""))
        pan = recording.sent_event("(e) => e.controls && e.controls[0].track === 'camera' && e.controls[0].data.dx > 0")
        assert pan["controls"][0]["data"] == {"dx": 2, "dy": -4}
        page.evaluate(
            "() => { window.__pad.buttons[12] = { pressed: true, value: 1 }; window.__pad.axes = [0,0,0,0]; }"
        )
        recording.sent_event(keys_event("W"))  # the d-pad's up
    finally:
        context.close()


def test_download_what_you_played(browser: Browser, server: RunningServer, tmp_path: Path) -> None:
    with player(browser, server.http + "/", accept_downloads=True) as page:
        start(page)
        wait_for(page, "window.worldserve.recordedBytes > 0")  # the recorder hands over its first piece
        with page.expect_download() as event:
            page.click("#download")
        saved = tmp_path / event.value.suggested_filename
        event.value.save_as(saved)
        data = saved.read_bytes()
        assert data[:4] == bytes.fromhex("1a45dfa3")  # a Matroska/WebM file
        assert len(data) > 1000
        session = page.evaluate("() => window.worldserve.sessionId")
        assert saved.name == f"worldserve-{session[:8]}.webm"
