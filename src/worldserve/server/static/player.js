// worldserve browser player: one WebSocket session, frames played at the model's rate,
// keyboard and mouse-drag controls sent as input events, an overlay of live figures;
// share links (?join=SESSION&token=TOKEN&role=viewer|controller) and resume after a drop.
// Frames arrive as H.264 (played through Media Source Extensions, see "H.264 playback"
// below), or JPEG where the browser cannot; ?media=raw|jpeg|h264 picks one.
// Plain JS, no build step. Protocol: docs/protocol.md; media: docs/media.md.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const canvas = $("screen");
  const ctx = canvas.getContext("2d");
  const KEY_MAP = {
    KeyW: "W", KeyA: "A", KeyS: "S", KeyD: "D",
    ArrowUp: "W", ArrowLeft: "A", ArrowDown: "S", ArrowRight: "D",
  };
  const MAX_PAN = 4; // px per frame, the camera schema's bound

  const state = {
    ws: null,
    spec: null,
    sessionId: null,
    role: null, // "host", "controller" or "viewer"
    resumeToken: null,
    lastSeq: -1, // the last chunk received: what a resume asks to go on from
    join: null, // {session, token, role} from a share link
    status: "idle",
    epoch: 0,
    nextMessageId: 1,
    nextEventId: 1,
    held: new Set(),
    sentAt: new Map(), // event_id -> performance.now() when sent
    header: null, // chunk header waiting for its binary frames
    frames: [], // frames received for the header so far
    queue: [], // {image, seq, epoch, first, chunk} to play, in order
    displayed: 0,
    chunkIndex: -1,
    lastChunkMs: null,
    lastAppliedMs: null,
    fpsTimes: [],
    nextFrameAt: 0,
    media: null, // what this session's frames arrive as
    frameInChunk: -1, // the frame of its chunk shown last
    camera: { dragging: false, x: 0, y: 0, dx: 0, dy: 0, last: { dx: 0, dy: 0 } },
  };
  // A read-only window for tests and curious users.
  window.worldserve = {
    get status() { return state.status; },
    get sessionId() { return state.sessionId; },
    get role() { return state.role; },
    get shareLinks() { return { viewer: $("share-viewer").value, controller: $("share-controller").value }; },
    get epoch() { return state.epoch; },
    get chunkIndex() { return state.chunkIndex; },
    get displayed() { return state.displayed; },
    get spec() { return state.spec; },
    get media() { return state.media; },
    get frameInChunk() { return state.frameInChunk; },
    get kbps() { return meter.kbps; },
  };

  function log(text, kind) {
    const item = document.createElement("li");
    item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
    if (kind) item.className = kind;
    const list = $("log");
    list.prepend(item);
    while (list.children.length > 60) list.lastChild.remove();
  }

  function setStatus(status, text) {
    state.status = status;
    const badge = $("status");
    badge.dataset.state = status;
    badge.textContent = text || status;
    const live = status === "live" || status === "failed";
    $("reset").disabled = !live;
    $("close").disabled = !live;
    $("apply-prompt").disabled = status !== "live" || state.role === "viewer";
    $("reset").disabled = !live || state.role === "viewer";
  }

  function shareLink(token, role) {
    if (!token) return "";
    const url = new URL(location.href);
    url.search = new URLSearchParams({ join: state.sessionId, token, role }).toString();
    return url.toString();
  }

  function showShare(share) {
    $("share-viewer").value = shareLink(share && share.viewer, "viewer");
    $("share-controller").value = shareLink(share && share.controller, "controller");
    $("share").hidden = !(share && (share.viewer || share.controller));
  }

  function enterWorld(message, role) {
    state.spec = message.model;
    state.sessionId = message.session_id;
    state.role = role;
    state.resumeToken = message.resume_token || null;
    state.epoch = 0;
    state.queue = [];
    state.media = message.media;
    mseClose();
    canvas.width = message.model.width;
    canvas.height = message.model.height;
    $("model-name").textContent = `${message.model.name} · ${message.model.width}×${message.model.height} · ${message.model.fps} fps`;
    $("model-name").title = message.model.description || "";
    renderPresets(message.model.styles || []);
    setStatus("live", role === "host" ? "live" : `live (${role})`);
    if (message.model.description) log(message.model.description);
    canvas.focus();
  }

  function send(message) {
    if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return null;
    const id = `m${state.nextMessageId++}`;
    state.ws.send(JSON.stringify({ ...message, id }));
    return id;
  }

  function sendEvent(fields) {
    if (state.status !== "live" || state.role === "viewer") return;
    const eventId = state.nextEventId++;
    state.sentAt.set(eventId, performance.now());
    send({ type: "input.event", event_id: eventId, ...fields });
  }

  function sendKeys() {
    const held = ["W", "A", "S", "D"].filter((key) => state.held.has(key));
    sendEvent({ controls: [{ track: "keys", schema: "worldserve.keys.v1", data: { held } }] });
  }

  function sendCamera(dx, dy) {
    const last = state.camera.last;
    if (Math.abs(dx - last.dx) < 0.05 && Math.abs(dy - last.dy) < 0.05) return;
    state.camera.last = { dx, dy };
    sendEvent({ controls: [{ track: "camera", schema: "worldserve.camera.v1", data: { dx, dy } }] });
  }

  function connect(resume) {
    if (state.ws) state.ws.close();
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const protocols = ["worldserve.v1"];
    const token = $("token").value.trim();
    if (token) protocols.push(`bearer.${token}`);
    const ws = new WebSocket(`${scheme}${location.host}/v1/world`, protocols);
    ws.binaryType = "arraybuffer";
    state.ws = ws;
    setStatus("connecting", "connecting…");
    ws.onopen = () => {
      if (resume) {
        send({ type: "session.resume", session_id: state.sessionId, token: state.resumeToken, last_seq: state.lastSeq });
        return;
      }
      if (state.join) {
        send({ type: "session.join", session_id: state.join.session, token: state.join.token, role: state.join.role });
        return;
      }
      const prompt = $("prompt").value.trim();
      const message = {
        type: "session.start",
        seed: Number($("seed").value) || 0,
        options: { media: chooseMedia() },
        share: { viewers: true, controllers: true },
      };
      if (prompt) message.prompt = prompt;
      state.lastSeq = -1;
      send(message);
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") onMessage(JSON.parse(event.data));
      else onFrame(event.data);
    };
    ws.onclose = (event) => {
      if (state.ws !== ws) return;
      state.ws = null;
      // A lost connection (not a clean close, not a refusal): take the session back once.
      if (state.sessionId && state.resumeToken && !resume && ![1000, 1001, 1008, 4000].includes(event.code)) {
        log("connection lost; resuming…", "error");
        connect(true);
        return;
      }
      setStatus(event.code === 1008 ? "error" : "idle", event.code === 1008 ? "refused (token or origin)" : "disconnected");
    };
  }

  function onMessage(message) {
    switch (message.type) {
      case "session.started":
        state.lastSeq = -1;
        enterWorld(message, "host");
        showShare(message.share);
        log(`session ${message.session_id.slice(0, 8)}… started`);
        break;
      case "session.joined":
        state.lastSeq = message.seq;
        enterWorld(message, message.role);
        log(`joined session ${message.session_id.slice(0, 8)}… as ${message.role}`);
        break;
      case "session.resumed":
        state.role = message.role;
        setStatus("live", message.role === "host" ? "live" : `live (${message.role})`);
        log(`resumed (${message.replayed} chunks re-sent)`);
        break;
      case "chunk.skipped":
        state.lastSeq = Math.max(state.lastSeq, message.to_seq);
        log(`chunks ${message.from_seq}–${message.to_seq} skipped (this view lagged)`);
        break;
      case "chunk":
        state.header = message;
        state.frames = [];
        if (message.frames.sizes.length === 0) finishChunk();
        break;
      case "input.accepted":
        if (message.status === "duplicate") log(`event ${message.event_id} was a duplicate`);
        break;
      case "input.dropped":
        // A superseded held key/camera event is routine (a newer one replaced it), not worth a log line.
        if (message.reason !== "superseded") log(`events ${message.event_ids.join(", ")} dropped (${message.reason})`);
        message.event_ids.forEach((id) => state.sentAt.delete(id));
        break;
      case "session.failed":
        setStatus("failed", `failed: ${message.code}`);
        log(`session failed (${message.code}): ${message.message} — press Reset`, "error");
        break;
      case "session.reset":
        state.epoch = message.epoch;
        state.queue = state.queue.filter((item) => item.epoch >= state.epoch);
        setStatus("live", "live");
        log(`reset (epoch ${message.epoch})`);
        break;
      case "session.closed":
        state.sessionId = null;
        state.resumeToken = null;
        showShare(null);
        setStatus("idle", "closed");
        log(`session closed (${message.reason})`);
        break;
      case "error":
        if (message.code === "resume_refused" || message.code === "join_refused") {
          state.sessionId = null;
          setStatus("error", message.code === "join_refused" ? "cannot join" : "cannot resume");
        }
        log(`error ${message.code}: ${message.message}`, "error");
        break;
      default:
        break;
    }
  }

  function onFrame(buffer) {
    const header = state.header;
    if (!header) return;
    meterAdd(buffer.byteLength);
    const { width, height, media } = header.frames;
    if (media === "h264") {
      state.header = null;
      state.lastSeq = Math.max(state.lastSeq, header.seq);
      noteApplied(header);
      mseChunk(header, buffer);
      return;
    }
    if (media === "raw") {
      const rgb = new Uint8Array(buffer);
      const rgba = new Uint8ClampedArray(width * height * 4);
      for (let i = 0, j = 0; i < rgb.length; i += 3, j += 4) {
        rgba[j] = rgb[i]; rgba[j + 1] = rgb[i + 1]; rgba[j + 2] = rgb[i + 2]; rgba[j + 3] = 255;
      }
      state.frames.push(Promise.resolve(new ImageData(rgba, width, height)));
    } else {
      state.frames.push(createImageBitmap(new Blob([buffer], { type: "image/jpeg" })));
    }
    if (state.frames.length === header.frames.sizes.length) finishChunk();
  }

  function finishChunk() {
    const header = state.header;
    state.lastSeq = Math.max(state.lastSeq, header.seq);
    const pending = state.frames;
    state.header = null;
    state.frames = [];
    noteApplied(header);
    Promise.all(pending).then((images) => {
      images.forEach((image, index) => {
        state.queue.push({ image, seq: header.seq, epoch: header.epoch, first: index === 0, chunk: header.chunk_index });
      });
      if (images.length === 0) ack(header.seq);
    });
  }

  function noteApplied(header) {
    const now = performance.now();
    for (const id of header.applied_event_ids) {
      const sentAt = state.sentAt.get(id);
      if (sentAt !== undefined) {
        state.lastAppliedMs = now - sentAt;
        state.sentAt.delete(id);
      }
    }
    state.lastChunkMs = header.timings.tick_ms;
  }

  function ack(seq) {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify({ type: "chunk.ack", seq }));
  }

  function play(now) {
    const period = state.spec ? 1000 / state.spec.fps : 1000 / 16;
    if (mse.video) {
      mseTick();
    } else if (state.queue.length === 0) {
      state.nextFrameAt = Math.max(state.nextFrameAt, now);
    } else if (now >= state.nextFrameAt) {
      let item = state.queue.shift();
      while (item && item.epoch < state.epoch) {
        if (item.first) ack(item.seq);
        item = state.queue.shift();
      }
      if (item) {
        if (item.image instanceof ImageData) ctx.putImageData(item.image, 0, 0);
        else ctx.drawImage(item.image, 0, 0);
        if (item.first) ack(item.seq);
        state.chunkIndex = item.chunk;
        state.displayed += 1;
        state.fpsTimes.push(now);
        // Catch up if we fell far behind instead of playing in slow motion.
        state.nextFrameAt = Math.max(state.nextFrameAt + period, now - period);
      }
    }
    while (state.fpsTimes.length && state.fpsTimes[0] < now - 1000) state.fpsTimes.shift();
    $("stat-fps").textContent = String(state.fpsTimes.length);
    $("stat-chunk").textContent = state.chunkIndex >= 0 ? String(state.chunkIndex) : "–";
    $("stat-chunk-ms").textContent = state.lastChunkMs === null ? "–" : state.lastChunkMs.toFixed(1);
    $("stat-applied-ms").textContent = state.lastAppliedMs === null ? "–" : state.lastAppliedMs.toFixed(0);
    $("stat-buffered").textContent = String(mse.video ? mseBuffered() : state.queue.length);
    $("stat-media").textContent = state.media || "–";
    $("stat-kbps").textContent = meterUpdate(now);
    requestAnimationFrame(play);
  }

  // ---- H.264 playback through Media Source Extensions ---------------------------------
  // Kept apart from the rest of the player on purpose: the session gets one fMP4 fragment
  // per chunk (docs/media.md), the init segment in front where this connection's stream
  // starts. They are appended in order to one SourceBuffer in "sequence" mode (so a stream
  // that starts again after a gap continues the timeline) of a muted <video> under the
  // canvas; each frame the video presents is drawn onto the canvas, so input, overlay and
  // scaling work as for the other media. The buffer stays short: generation is paced by
  // our acks (sent when a chunk's first frame is shown), what has been played is trimmed,
  // and a player that falls behind jumps to the live edge.
  const PROBE_TYPE = 'video/mp4; codecs="avc1.42E01E"';
  const mse = {
    video: null, source: null, buffer: null, url: null,
    appends: [], // binaries waiting for the SourceBuffer
    chunks: [], // {start, count, seq, epoch, chunk, acked}: where each chunk lies, in frames
    frames: 0, // frames appended so far (the timeline, in frames)
    keys: [], // where chunks that start with an IDR frame begin (frames): the buffer is cut only there
    shown: -1, // the last frame drawn
  };

  function h264Playable() {
    return typeof MediaSource !== "undefined" && MediaSource.isTypeSupported(PROBE_TYPE);
  }

  function chooseMedia() {
    const asked = state.forceMedia || new URLSearchParams(location.search).get("media");
    if (asked === "raw" || asked === "jpeg") return asked;
    if (h264Playable()) return "h264";
    log("this browser cannot play H.264 (Media Source Extensions); frames come as JPEG");
    return "jpeg";
  }

  function codecOf(init) {
    // The avcC box: configurationVersion, then profile, compatibility and level bytes.
    const hex = (byte) => byte.toString(16).padStart(2, "0");
    for (let i = 4; i + 8 <= init.length; i++) {
      if (init[i] === 0x61 && init[i + 1] === 0x76 && init[i + 2] === 0x63 && init[i + 3] === 0x43) {
        return `avc1.${hex(init[i + 5])}${hex(init[i + 6])}${hex(init[i + 7])}`;
      }
    }
    return "avc1.42E01E";
  }

  function mseClose() {
    if (!mse.video) return;
    mse.video.pause();
    mse.video.remove();
    URL.revokeObjectURL(mse.url);
    Object.assign(mse, {
      video: null, source: null, buffer: null, url: null, appends: [], chunks: [], frames: 0, keys: [], shown: -1,
    });
  }

  function mseOpen(type) {
    mseClose();
    const video = document.createElement("video");
    video.className = "mse";
    video.muted = true;
    video.playsInline = true;
    const source = new MediaSource();
    mse.url = URL.createObjectURL(source);
    video.src = mse.url;
    canvas.parentElement.prepend(video);
    Object.assign(mse, { video, source });
    source.addEventListener("sourceopen", () => {
      try {
        const buffer = source.addSourceBuffer(type);
        buffer.mode = "sequence";
        buffer.timestampOffset = 0; // the first fragment plays at 0, whatever its decode time
        buffer.addEventListener("updateend", mseFeed);
        buffer.addEventListener("error", () => mseFail("the SourceBuffer refused a fragment"));
        mse.buffer = buffer;
        mseFeed();
      } catch (error) {
        mseFail(error.message);
      }
    }, { once: true });
    if ("requestVideoFrameCallback" in video) {
      const onFrame = (_, meta) => {
        if (mse.video !== video) return;
        mseShow(meta.mediaTime);
        video.requestVideoFrameCallback(onFrame);
      };
      video.requestVideoFrameCallback(onFrame);
    }
  }

  function mseFail(reason) {
    log(`cannot play H.264 here (${reason})`, "error");
    mseClose();
    if (state.role === "host") { // start over with JPEG
      state.forceMedia = "jpeg";
      log("starting again with JPEG");
      connect(false);
    }
  }

  function mseChunk(header, buffer) {
    const bytes = new Uint8Array(buffer);
    const initBytes = header.frames.init_bytes || 0;
    if (!mse.video) {
      if (!initBytes) return ack(header.seq); // nothing to start from (the server sends the init first)
      const type = `video/mp4; codecs="${codecOf(bytes.subarray(0, initBytes))}"`;
      if (typeof MediaSource === "undefined" || !MediaSource.isTypeSupported(type)) return mseFail(`${type} unsupported`);
      mseOpen(type);
    }
    const count = header.frames.count;
    if (header.frames.keyframe) mse.keys.push(mse.frames);
    mse.chunks.push({ start: mse.frames, count, seq: header.seq, epoch: header.epoch, chunk: header.chunk_index, acked: false });
    mse.frames += count;
    mse.appends.push(bytes);
    mseFeed();
  }

  function mseFeed() {
    const buffer = mse.buffer;
    if (!buffer || buffer.updating) return;
    if (mse.appends.length) {
      try {
        buffer.appendBuffer(mse.appends.shift());
      } catch (error) {
        mseFail(error.message);
      }
      return;
    }
    // Trim what has been played: everything before the last IDR frame that is over a second
    // old (cutting inside a group of pictures would drop the frames that depend on it), so the
    // buffer holds at most the current group (IDR frames come at least every 10 s).
    const video = mse.video;
    const fps = state.spec.fps;
    const cut = mse.keys.filter((frame) => frame / fps <= video.currentTime - 1).pop();
    if (cut !== undefined && buffer.buffered.length && cut / fps > buffer.buffered.start(0) + 0.5 / fps) {
      mse.keys = mse.keys.filter((frame) => frame >= cut);
      buffer.remove(0, cut / fps);
    }
  }

  function mseBuffered() {
    const video = mse.video;
    if (!video || !video.buffered.length) return 0;
    return Math.max(0, Math.round((video.buffered.end(video.buffered.length - 1) - video.currentTime) * state.spec.fps));
  }

  function mseShow(mediaTime) {
    const fps = state.spec.fps;
    const frame = Math.round(mediaTime * fps);
    if (frame === mse.shown) return;
    mse.shown = frame;
    const item = mse.chunks.find((c) => c.start <= frame && frame < c.start + c.count);
    for (const c of mse.chunks) { // a chunk is played once its first frame is shown (or passed)
      if (!c.acked && c.start <= frame) {
        c.acked = true;
        ack(c.seq);
      }
    }
    while (mse.chunks.length > 1 && mse.chunks[0].start + mse.chunks[0].count < frame - 4 * fps) mse.chunks.shift();
    if (!item || item.epoch < state.epoch) return; // made before a reset: not shown
    ctx.drawImage(mse.video, 0, 0, canvas.width, canvas.height);
    state.chunkIndex = item.chunk;
    state.frameInChunk = frame - item.start;
    state.displayed += 1;
    state.fpsTimes.push(performance.now());
  }

  function mseTick() {
    const video = mse.video;
    if (!video.buffered.length) return;
    const end = video.buffered.end(video.buffered.length - 1);
    const period = state.spec.frames_per_chunk / state.spec.fps;
    // Fallen behind (a busy tab, a stall): jump to the live edge rather than play old frames.
    if (end - video.currentTime > Math.max(1, 4 * period)) video.currentTime = Math.max(0, end - period);
    if (video.paused && video.readyState >= 2) video.play().catch(() => {});
    if (!("requestVideoFrameCallback" in video)) mseShow(video.currentTime);
  }

  // The bitrate overlay: bytes of frames received over the last two seconds.
  const meter = { samples: [], kbps: 0 };

  function meterAdd(bytes) {
    meter.samples.push([performance.now(), bytes]);
  }

  function meterUpdate(now) {
    while (meter.samples.length && meter.samples[0][0] < now - 2000) meter.samples.shift();
    const bytes = meter.samples.reduce((sum, [, n]) => sum + n, 0);
    meter.kbps = (bytes * 8) / 2000;
    return meter.samples.length ? meter.kbps.toFixed(0) : "–";
  }

  function renderPresets(styles) {
    const box = $("presets");
    box.replaceChildren();
    for (const style of styles) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = style;
      button.addEventListener("click", () => {
        $("prompt").value = style;
        sendEvent({ prompt: style });
        canvas.focus();
      });
      box.append(button);
    }
  }

  // Keyboard: held-key state, sent whenever the set changes.
  function typing(event) {
    return event.target instanceof HTMLInputElement;
  }
  document.addEventListener("keydown", (event) => {
    const key = KEY_MAP[event.code];
    if (!key || typing(event)) return;
    event.preventDefault();
    if (!state.held.has(key)) {
      state.held.add(key);
      sendKeys();
    }
  });
  document.addEventListener("keyup", (event) => {
    const key = KEY_MAP[event.code];
    if (!key || typing(event)) return;
    event.preventDefault();
    if (state.held.delete(key)) sendKeys();
  });
  window.addEventListener("blur", () => {
    if (state.held.size) {
      state.held.clear();
      sendKeys();
    }
  });

  // Mouse drag pans the camera ("grab" the world: it follows the pointer).
  canvas.addEventListener("pointerdown", (event) => {
    canvas.setPointerCapture(event.pointerId);
    canvas.classList.add("dragging");
    Object.assign(state.camera, { dragging: true, x: event.clientX, y: event.clientY, dx: 0, dy: 0 });
  });
  canvas.addEventListener("pointermove", (event) => {
    if (!state.camera.dragging) return;
    state.camera.dx += event.clientX - state.camera.x;
    state.camera.dy += event.clientY - state.camera.y;
    state.camera.x = event.clientX;
    state.camera.y = event.clientY;
  });
  function endDrag() {
    if (!state.camera.dragging) return;
    state.camera.dragging = false;
    canvas.classList.remove("dragging");
    sendCamera(0, 0);
  }
  canvas.addEventListener("pointerup", endDrag);
  canvas.addEventListener("pointercancel", endDrag);
  const PAN_INTERVAL_MS = 100;
  setInterval(() => {
    if (!state.camera.dragging || !state.spec) return;
    const scale = canvas.clientWidth / canvas.width; // screen px per world px
    const framesPerInterval = (state.spec.fps * PAN_INTERVAL_MS) / 1000;
    const clamp = (v) => Math.max(-MAX_PAN, Math.min(MAX_PAN, Math.round(v * 100) / 100));
    sendCamera(clamp(-state.camera.dx / scale / framesPerInterval), clamp(-state.camera.dy / scale / framesPerInterval));
    state.camera.dx = 0;
    state.camera.dy = 0;
  }, PAN_INTERVAL_MS);

  $("start-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.join = null;
    connect(false);
  });
  for (const role of ["viewer", "controller"]) {
    $(`copy-${role}`).addEventListener("click", () => {
      const link = $(`share-${role}`).value;
      if (navigator.clipboard && link) navigator.clipboard.writeText(link).catch(() => {});
      $(`share-${role}`).select();
    });
  }
  $("apply-prompt").addEventListener("click", () => {
    const prompt = $("prompt").value.trim();
    if (prompt) sendEvent({ prompt });
    canvas.focus();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && state.status === "live") {
      event.preventDefault();
      $("apply-prompt").click();
    }
  });
  $("reset").addEventListener("click", () => {
    send({ type: "session.reset" });
    canvas.focus();
  });
  $("close").addEventListener("click", () => send({ type: "session.close" }));

  setStatus("idle", "not connected");
  requestAnimationFrame(play);

  // A share link opens that world at once: ?join=SESSION&token=TOKEN&role=viewer|controller.
  const params = new URLSearchParams(location.search);
  if (params.get("join") && params.get("token")) {
    const role = params.get("role") === "controller" ? "controller" : "viewer";
    state.join = { session: params.get("join"), token: params.get("token"), role };
    connect(false);
  }
})();
