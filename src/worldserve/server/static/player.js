// worldserve browser player: one WebSocket session, frames played at the model's rate,
// keyboard and mouse-drag controls sent as input events, an overlay of live figures;
// share links (?join=SESSION&token=TOKEN&role=viewer|controller) and resume after a drop.
// Plain JS, no build step. Protocol: docs/protocol.md.
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
    $("close").disabled = !live && status !== "queued"; // Close also leaves the waiting line
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
        options: { media: "raw" },
        share: { viewers: true, controllers: true },
        queue: true, // a full server puts this start in line (session.queued) instead of refusing it
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
      case "session.queued":
        showQueued(message);
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
        if (message.frames.count === 0) finishChunk();
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

  // The waiting line of a full server: "you are #3 in line, about 40 s" until session.started.
  function showQueued(message) {
    const eta = message.eta_s == null ? "" : `, about ${Math.max(1, Math.round(message.eta_s))} s`;
    const text = `you are #${message.position} in line${eta}`;
    setStatus("queued", text);
    log(`server full: ${text}`);
  }

  function onFrame(buffer) {
    const header = state.header;
    if (!header) return;
    const { width, height, media } = header.frames;
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
    if (state.frames.length === header.frames.count) finishChunk();
  }

  function finishChunk() {
    const header = state.header;
    state.lastSeq = Math.max(state.lastSeq, header.seq);
    const pending = state.frames;
    state.header = null;
    state.frames = [];
    const now = performance.now();
    for (const id of header.applied_event_ids) {
      const sentAt = state.sentAt.get(id);
      if (sentAt !== undefined) {
        state.lastAppliedMs = now - sentAt;
        state.sentAt.delete(id);
      }
    }
    state.lastChunkMs = header.timings.tick_ms;
    Promise.all(pending).then((images) => {
      images.forEach((image, index) => {
        state.queue.push({ image, seq: header.seq, epoch: header.epoch, first: index === 0, chunk: header.chunk_index });
      });
      if (images.length === 0) ack(header.seq);
    });
  }

  function ack(seq) {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify({ type: "chunk.ack", seq }));
  }

  function play(now) {
    const period = state.spec ? 1000 / state.spec.fps : 1000 / 16;
    if (state.queue.length === 0) {
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
    $("stat-buffered").textContent = String(state.queue.length);
    requestAnimationFrame(play);
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
