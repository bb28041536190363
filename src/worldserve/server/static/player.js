// worldserve browser player: one WebSocket session, frames played at the model's rate,
// keyboard, mouse-drag, touch-pad and gamepad controls sent as input events, an overlay of
// live figures (the delay you feel, measured here, beside the server's); share links
// (?join=SESSION&token=TOKEN&role=viewer|controller, the server's token in #auth=... only
// when the host chooses), reconnects that resume after every drop until the server's grace
// ends (a reload too: the page keeps its place in sessionStorage and asks for a fresh H.264
// start, having no decoder any more), and a new world at once after a server restart; fullscreen, keyboard help, and a
// download of what you played. Frames arrive as H.264 (played through Media Source
// Extensions, see "H.264 playback" below), or JPEG where the browser cannot;
// ?media=raw|jpeg|h264 picks one. Plain JS, no build step of its own: an ES module on
// @worldserve/client (clients/ts), the package's built modules as the server serves them (/static/client/):
// its WorldClient (WebRTCWorldClient) speaks the protocol, its H264Player plays H.264; the page plays and steers.
// Protocol: docs/protocol.md; media: docs/media.md.
import { H264Player, WebRTCWorldClient, WorldClient, WorldError, decodeFrame, linkStats, signal } from "./client/index.js";

(() => {
  const $ = (id) => document.getElementById(id);
  const canvas = $("screen");
  const ctx = canvas.getContext("2d");
  const KEY_MAP = {
    KeyW: "W", KeyA: "A", KeyS: "S", KeyD: "D",
    KeyI: "I", KeyJ: "J", KeyK: "K", KeyL: "L", // look keys (ABot-World: I/K up/down, J/L turn)
    KeyZ: "Z", KeyC: "C", // more of a model's own keys (its keys track says which it takes)
  };
  // The arrows look where the model takes the look keys (as ABot-World's own page maps them), else move.
  const ARROWS = { ArrowUp: ["I", "W"], ArrowDown: ["K", "S"], ArrowLeft: ["J", "A"], ArrowRight: ["L", "D"] };
  const MOVE_KEYS = ["W", "A", "S", "D"];
  const LOOK_KEYS = ["I", "J", "K", "L"];
  const MAX_PAN = 4; // px per frame, the camera schema's bound
  const BACKOFF_MS = [250, 500, 1000, 2000, 4000, 5000]; // then 5 s between tries
  const RESTART_GIVE_UP_MS = 10 * 60 * 1000; // after a server restart, wait this long for it at most
  const PHOTON_LOG_MAX = 1000; // key-to-photon figures kept for window.worldserve.keyToPhotonLog

  // chunk.skipped's reason, as the log says it (docs/protocol.md).
  const SKIPPED_BECAUSE = {
    lagged: "this view lagged",
    keyframe: "waiting for the stream's next keyframe",
    resume: "made while this view was away",
  };

  // The server's routes below the page's own path: "/" at the root, "/fe/2/" for a page a balancer serves
  // under a front-end's path (its socket and requests then reach that front-end, not the balancer's choice).
  const BASE = location.pathname.replace(/[^/]*$/, "");
  // ?transport=webrtc: the session over WebRTC (POST /v1/webrtc; a viewer's link: WHEP), where the browser has it.
  const RTC_WANTED = new URLSearchParams(location.search).get("transport") === "webrtc" && Boolean(window.RTCPeerConnection);
  // JPEG and raw: take each chunk's frames in parts as the model makes them (chunk.part), and play them as they
  // come (a model whose spec says frame_parts; others send chunks whole anyway); ?parts=0 takes chunks whole.
  const PARTS_WANTED = new URLSearchParams(location.search).get("parts") !== "0";
  const state = {
    client: null, // the session's WorldClient (over WebRTC: WebRTCWorldClient), while it has one
    spec: null,
    sessionId: null,
    role: null, // "host", "controller" or "viewer"
    resumeToken: null,
    resumeGraceS: null, // how long the server keeps our place after a drop (session.started)
    leadChunks: 0, // whole chunks the server makes ahead of playback, by design queued here (session.started)
    lastSeq: -1, // the last chunk received: what a resume asks to go on from
    join: null, // {session, token, role} from a share link, until it has been joined
    started: null, // {prompt, seed}: what this page's world was started with (a restart starts it again)
    status: "idle",
    statusLog: [], // every status this page took, in order (for tests and curious users)
    epoch: 0,
    nextEventId: 1,
    held: { keys: new Set(), touch: new Set(), pad: new Set() }, // held movement keys, by source
    sentAt: new Map(), // event_id -> when its input happened (performance.now() time base)
    header: null, // chunk header waiting for its binary frames
    frames: [], // frames received for the header so far
    queue: [], // {image, seq, epoch, first, chunk, photon?} to play, in order (the jitter buffer plays it)
    displayed: 0,
    chunkIndex: -1,
    lastChunkMs: null,
    serverAppliedMs: null, // the server's figure: acceptance -> commit of the chunk that applied our event
    photonMs: null, // this page's figure: input -> first frame on screen that applied it
    photonParts: null, // and its parts (photonParts()), where the chunk told the server's instants
    decoding: Promise.resolve(), // the chunks being decoded, chained so that they queue in arrival order
    photonLog: [], // the last PHOTON_LOG_MAX figures with their parts, oldest first (bench/page_latency.py reads it)
    fpsTimes: [],
    nextFrameAt: 0,
    media: null, // what this session's frames arrive as
    forceMedia: null, // "jpeg" after H.264 failed to play here
    frameInChunk: -1, // the frame of its chunk shown last
    camera: { dragging: false, x: 0, y: 0, dx: 0, dy: 0, last: { dx: 0, dy: 0 } },
    served: null, // the served model's spec (GET /v1/models), known before a world starts
    startImage: null, // base64 PNG of the chosen start image, at the model's frame size
    startImageProblem: null, // why the chosen file cannot be the start image (yet), said on Start
    references: null, // {slot: base64 JPEG} of the chosen reference images, one per slot of the model's
    referencesProblem: null, // why the chosen files cannot be the reference images (yet), said on Start
    referencesPick: 0, // counts the choices of reference files: a later choice outdates an earlier one's reads
    mouse: { dx: 0, dy: 0, last: { yaw: 0, pitch: 0 } }, // pointer-locked movement since the last send
    reconnect: null, // {mode: "resume"|"restart", attempt, deadline, timer} while reconnecting
    reloaded: false, // this page was reloaded in a world: its resume asks for a keyframe and enters it anew
    share: null,
    resumes: 0,
    restarts: 0,
    shownSeq: -1,
    superseded: 0, // chunks a preemption replaced (the server made them again with newer input)
    supersededSeqs: new Set(), // their seqs: frames of theirs still decoding are never queued
    chunkOf: new Map(), // seq -> {shown, skip, applied: [[event id, input instant]]}, for the last chunks
    rtcShown: [], // over WebRTC, the last PHOTON_LOG_MAX frames shown: {rtp, seq, chunk, epoch}
    received: [], // the seqs of the last PHOTON_LOG_MAX chunks received whole, in order (resumes included)
    // seq -> a chunk taken in parts: {received, decoded} of its first part, when its first frame was on screen
    // (firstShownAt), and, once the chunk itself came (chunkIn), its key->screen figure's start (photon)
    partsOf: new Map(),
    parts: 0, // chunk parts received
  };
  // A read-only window for tests and curious users.
  window.worldserve = {
    get status() { return state.status; },
    get statusLog() { return state.statusLog.slice(); },
    get sessionId() { return state.sessionId; },
    get worldUrl() { return state.worldUrl || null; }, // where a session.moved sent this page's resume or join
    get transport() { return rtc.pc || rtc.client ? "webrtc" : "websocket"; },
    get webrtc() { return rtc.stats; }, // a WebRTC peer's last getStats() figures
    // Messages of this WebRTC connection read from the server's fast copies (their main copy passed over).
    get webrtcCopiesTaken() { return rtc.client && rtc.client.merge ? rtc.client.merge.taken : 0; },
    // Frames shown over WebRTC told their chunk when their hold ran out (no mark at or after them came in time).
    get webrtcLabelsGuessed() { return rtc.client ? rtc.client.labels.guessed : 0; },
    // Times this H.264 video stood still with frames buffered ahead and was nudged on (H264Player.nudges).
    get h264Nudges() { return mse.player ? mse.player.nudges : 0; },
    // Lose the WebRTC session's peer connection as a network failure would (no DELETE): the page resumes.
    loseWebRTC() { loseWebRTC(); },
    // Over WebRTC, each frame shown (its RTP timestamp) and the chunk it was told to be (seq, chunk index, epoch).
    get webrtcShown() { return state.rtcShown.map((frame) => ({ ...frame })); },
    get receivedSeqs() { return state.received.slice(); }, // chunks received whole, whether or not shown
    get role() { return state.role; },
    get shareLinks() { return { viewer: $("share-viewer").value, controller: $("share-controller").value }; },
    get epoch() { return state.epoch; },
    get chunkIndex() { return state.chunkIndex; },
    get displayed() { return state.displayed; },
    get spec() { return state.spec; },
    get keyToPhotonMs() { return state.photonMs; },
    get keyToPhotonParts() { return state.photonParts && { ...state.photonParts }; },
    get keyToPhotonLog() { return state.photonLog.map((entry) => ({ ...entry })); },
    get jitter() {
      const { target, underruns, most, playing, takenBack } = jitter;
      return { target, underruns, most, playing, takenBack, changes: jitter.changes.map((change) => change.slice()) };
    },
    get serverAppliedMs() { return state.serverAppliedMs; },
    get resumes() { return state.resumes; },
    get restarts() { return state.restarts; },
    get superseded() { return state.superseded; },
    get parts() { return state.parts; }, // chunk parts received (a chunk's frames as the model made them)
    get seq() { return state.shownSeq; }, // the chunk of the frame shown last (its seq)
    get recordedBytes() { return recording.bytes; },
    get media() { return state.media; },
    get frameInChunk() { return state.frameInChunk; },
    get kbps() { return meter.kbps; },
    get allowedKeys() { return modelKeys().keys; },
    get pointerLocked() { return document.pointerLockElement === canvas; },
    get startImageReady() { return state.startImage !== null; },
    get referencesReady() { return state.references !== null; },
  };

  function log(text, kind) {
    const item = document.createElement("li");
    item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
    if (kind) item.className = kind;
    const list = $("log");
    list.prepend(item);
    while (list.children.length > 60) list.lastChild.remove();
  }

  function notice(text, kind) {
    const box = $("notice");
    box.textContent = text || "";
    box.dataset.kind = kind || "error";
    box.hidden = !text;
  }

  function setStatus(status, text) {
    state.status = status;
    state.statusLog.push(status);
    if (state.statusLog.length > 200) state.statusLog.shift();
    const badge = $("status");
    badge.dataset.state = status;
    badge.textContent = text || status;
    const inWorld = ["live", "failed", "resetting"].includes(status);
    const steering = inWorld && state.role !== "viewer";
    $("close").disabled = !inWorld && status !== "queued"; // Close also leaves the waiting line
    $("reset").disabled = !steering;
    $("apply-prompt").disabled = status !== "live" || state.role === "viewer";
    showStartControls();
  }

  // A page that joined a world by a share link plays the host's world: no Start (which would leave it
  // without a word), only an explicit leave. A link not yet joined offers Join, without a new world's fields.
  function showStartControls() {
    const joined = state.role === "viewer" || state.role === "controller";
    $("start-controls").hidden = joined;
    $("joined").hidden = !joined;
    if (joined) $("joined-role").textContent = state.role;
    $("new-world-fields").hidden = Boolean(state.join);
    $("seed").hidden = Boolean(state.join);
    $("start").textContent = state.join ? "Join" : "Start";
    $("join-pending").hidden = !state.join || joined;
  }

  // -- worlds: enter, leave --------------------------------------------------------------

  function enterWorld(message, role) {
    state.spec = message.model;
    state.sessionId = message.session_id;
    state.role = role;
    state.resumeToken = message.resume_token || null;
    state.resumeGraceS = message.resume_grace_s || null;
    state.epoch = 0;
    state.queue = [];
    state.photonMs = null;
    state.photonParts = null;
    state.serverAppliedMs = null;
    state.media = message.media;
    state.leadChunks = message.lead_chunks ?? 1; // a server before the field made a chunk ahead
    jitterReset();
    mseClose();
    canvas.width = message.model.width;
    canvas.height = message.model.height;
    $("screen-box").style.aspectRatio = `${message.model.width} / ${message.model.height}`;
    document.body.dataset.role = role;
    showModel(message.model);
    setStatus("live", role === "host" ? "live" : `live (${role})`);
    notice("");
    if (message.model.description) log(message.model.description);
    startRecording();
    canvas.focus();
  }

  // The model's name in the header, its warning, presets, prompt field and controls' hints: from the
  // served model's spec when the page loads (GET /v1/models), from the world's when one is entered.
  function showModel(spec) {
    $("model-name").textContent = `${spec.name} · ${spec.width}×${spec.height} · ${spec.fps} fps`;
    $("model-name").title = spec.description || "";
    $("weights-warning").hidden = !/random weights/i.test(spec.description || "");
    $("prompt-controls").hidden = !takesPrompt();
    renderPresets(spec.styles || []);
    renderControls();
  }

  function leaveWorld() {
    state.sessionId = null;
    state.resumeToken = null;
    state.role = null;
    delete document.body.dataset.role;
    showShare(null);
    showStartControls();
  }

  // -- share links ------------------------------------------------------------------------

  function tokenValue() {
    return $("token").value.trim();
  }

  function shareLink(token, role) {
    if (!token) return "";
    const url = new URL(location.href);
    url.search = new URLSearchParams({ join: state.sessionId, token, role }).toString();
    // The server's own token rides in the fragment (never sent to a server), only if the host says so.
    url.hash = $("share-token").checked && tokenValue() ? new URLSearchParams({ auth: tokenValue() }).toString() : "";
    return url.toString();
  }

  function showShare(share) {
    state.share = share || null;
    $("share-viewer").value = shareLink(share && share.viewer, "viewer");
    $("share-controller").value = shareLink(share && share.controller, "controller");
    $("share").hidden = !(share && (share.viewer || share.controller));
    $("share-token-row").hidden = !tokenValue();
  }

  function copyLink(role) {
    const field = $(`share-${role}`);
    const link = field.value;
    if (!link) return;
    field.select();
    const said = $("copied");
    const done = (text) => {
      said.textContent = text;
      clearTimeout(copyLink.timer);
      copyLink.timer = setTimeout(() => { said.textContent = ""; }, 2500);
    };
    const label = role === "viewer" ? "viewer" : "controller";
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(link).then(
        () => done(`${label} link copied ✓`),
        () => done(`${label} link selected: press Ctrl+C (or ⌘C) to copy`),
      );
    } else {
      done(`${label} link selected: press Ctrl+C (or ⌘C) to copy`);
    }
  }

  // -- the session: the package's WorldClient (over WebRTC: WebRTCWorldClient) ----------------
  // The package speaks the protocol: the socket (or data channel) and its subprotocols, requests matched to
  // their replies, the moves to the front-end where a world lives or where the service's line placed a start,
  // the waiting line. The page hears its session as it happens (listen: chunk headers, each frame as it comes,
  // notices, the connection's end) and keeps a player's policy: when to resume, restart or give up, and what
  // to tell the person.

  function live() {
    return Boolean(state.client) && state.client.connected;
  }

  // A verb the server refused: its error code decides what the page does. A connection lost meanwhile is
  // heard where the connection's end is (onSocketClosed), so that rejection is nothing to do here.
  function refusedBy(error) {
    if (!(error instanceof WorldError)) return;
    if (error.failed) sessionFailed(error.code, error.detail);
    else onError(error.code, error.detail);
  }

  // at: when the input behind it happened (an event's timeStamp), for the key->screen figure.
  function sendEvent(fields, at) {
    if (state.status !== "live" || state.role === "viewer" || !live()) return;
    const eventId = state.nextEventId++;
    state.sentAt.set(eventId, at === undefined ? performance.now() : at);
    state.client.sendEvent({ ...fields, eventId }).then((accepted) => {
      if (accepted.status === "duplicate") log(`event ${accepted.event_id} was a duplicate`);
    }, refusedBy);
  }

  function heldKeys() {
    const { keys, oneAtATime } = modelKeys();
    const all = [...state.held.keys, ...state.held.touch, ...state.held.pad].filter((key) => keys.includes(key));
    if (oneAtATime) return all.length ? [all[all.length - 1]] : []; // the latest pressed
    return keys.filter((key) => all.includes(key));
  }

  // The model's key a keyboard code stands for (undefined: none).
  function keyOf(code) {
    const arrow = ARROWS[code];
    if (arrow) return modelKeys().keys.includes(arrow[0]) ? arrow[0] : arrow[1];
    return KEY_MAP[code];
  }

  // What the arrow keys do for this model: "look", "move" or "" (nothing).
  function arrowsDo(keys) {
    if (keys.some((key) => LOOK_KEYS.includes(key))) return "look";
    return keys.some((key) => MOVE_KEYS.includes(key)) ? "move" : "";
  }

  function sendKeys(at) {
    if (!modelTrack("keys")) return;
    sendEvent({ controls: [{ track: "keys", schema: "worldserve.keys.v1", data: { held: heldKeys() } }] }, at);
  }

  function sendCamera(dx, dy, at) {
    if (!modelTrack("camera")) return; // a model without a camera pan (one with a mouse track instead)
    const last = state.camera.last;
    if (Math.abs(dx - last.dx) < 0.05 && Math.abs(dy - last.dy) < 0.05) return;
    state.camera.last = { dx, dy };
    sendEvent({ controls: [{ track: "camera", schema: "worldserve.camera.v1", data: { dx, dy } }] }, at);
  }

  // Let this page's connection go. code 1000 (a clean leave) ends a host's world on the server; any other
  // parks it for its resume grace (a reload's 4001).
  function closeSocket(code = 1000, reason = "new session") {
    const client = state.client;
    state.client = null;
    if (!client) return;
    client.listen(null);
    client.drop(code, reason);
    rtcDone();
  }

  // mode: "start" a new world, "join" the share link's, or "resume" ours after a drop.
  async function connect(mode) {
    closeSocket();
    whepLeave();
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const url = movedWorldUrl(mode) || `${scheme}${location.host}${BASE}v1/world`;
    const token = tokenValue() || undefined;
    const client = RTC_WANTED ? new WebRTCWorldClient(url, { token }) : new WorldClient(url, { token, autoAck: false });
    state.client = client;
    state.header = null; // a chunk cut off by a drop is re-sent whole
    state.frames = [];
    let opened = false;
    const mine = (heard) => (...args) => { if (state.client === client) heard(...args); };
    client.listen({
      opened: mine(() => {
        opened = true;
        if (RTC_WANTED) rtcOpened(client);
      }),
      message: mine(onMessage),
      frame: mine(onFrame),
      closed: mine((code) => {
        state.client = null;
        rtcDone();
        onSocketClosed({ code }, true);
      }),
    });
    if (!state.reconnect) setStatus("connecting", RTC_WANTED ? "connecting (WebRTC)…" : "connecting…");
    let reply;
    try {
      if (mode === "resume") {
        reply = await client.resume(
          { sessionId: state.sessionId, resumeToken: state.resumeToken }, state.lastSeq,
          { keyframe: state.reloaded }, // no decoder after a reload: the stream must start again
        );
      } else {
        await client.connect();
        if (state.client !== client) return;
        reply = mode === "join" ? (await joinWorld(client)).reply : (await client.start(startOptions())).reply;
      }
    } catch (error) {
      if (state.client !== client) return; // its end was heard already, or the page moved on
      if (error instanceof WorldError) {
        refusedBy(error);
      } else if (error.name === "SyntaxError") { // e.g. a token with characters a subprotocol cannot carry
        closeSocket();
        setStatus("error", "cannot connect");
        notice(`cannot open the connection: ${error.message}`);
      } else if (client.connected) { // open, but the verb went nowhere (moved too often, no reply)
        setStatus("error", "cannot reach the world");
        notice(error.message);
      } else { // it never opened (a refusal, no server, a failed peer): onSocketClosed tells which
        closeSocket(3000, "never opened"); // not a clean leave: nothing of the world is ended by it
        if (RTC_WANTED) log(`WebRTC: ${error.message}`, "error");
        onSocketClosed({ code: 1006 }, opened);
      }
      return;
    }
    if (state.client !== client) return;
    if (client.url !== url) { // a session.moved sent this page to the front-end where the world lives
      state.worldUrl = client.url;
      log(`session ${reply.session_id.slice(0, 8)}… lives at ${client.url}: moved there`);
    }
    if (reply.type === "session.started") started(reply);
    else if (reply.type === "session.joined") joined(reply);
    else resumed(reply);
    if (RTC_WANTED) {
      state.media = "webrtc";
      if (state.status === "live") setStatus("live", rtcLive());
    }
  }

  // The /v1/world URL of the front-end a connection for `mode` goes to, where session.moved named one behind a
  // balancer: a resume or join goes where the world lives. null: here (a start, which forgets where an earlier
  // world lived; the client follows a start that the service's line places on another front-end itself).
  function movedWorldUrl(mode) {
    if (mode === "start") state.worldUrl = null;
    return state.worldUrl || null;
  }

  function joinWorld(client) {
    const { session, token, role } = state.join;
    // No MSE here: this viewer asks for its own media (JPEG).
    return client.join(session, token, role, H264Player.playable() ? undefined : chooseMedia());
  }

  function startOptions() {
    const prompt = takesPrompt() ? $("prompt").value.trim() : ""; // a model without prompts is sent none
    const started = state.started || { prompt, seed: Number($("seed").value) || 0 };
    state.started = started;
    state.lastSeq = -1;
    const media = chooseMedia();
    return {
      seed: started.seed,
      media,
      ...(PARTS_WANTED && media !== "h264" ? { parts: true } : {}),
      shareViewers: true,
      shareControllers: true,
      queue: true, // a full server puts this start in line (session.queued) instead of refusing it
      ...(started.prompt ? { prompt: started.prompt } : {}),
      ...(state.startImage ? { image: state.startImage } : {}),
      ...(state.references ? { references: state.references } : {}),
    };
  }

  function started(reply) {
    stopReconnecting();
    state.lastSeq = -1;
    enterWorld(reply, "host");
    showShare(reply.share);
    log(`session ${reply.session_id.slice(0, 8)}… started`);
  }

  function joined(reply) {
    stopReconnecting();
    state.join = null; // joined: a later Start makes a world of its own
    state.started = null;
    state.lastSeq = reply.seq;
    enterWorld(reply, reply.role);
    log(`joined session ${reply.session_id.slice(0, 8)}… as ${reply.role}`);
  }

  function resumed(reply) {
    stopReconnecting();
    if (state.reloaded) { // a new page: enter the world as a new player would, keeping our place
      const { resumeToken, resumeGraceS, lastSeq, share, epoch } = state;
      state.reloaded = false;
      enterWorld(reply, reply.role);
      Object.assign(state, { resumeToken, resumeGraceS, lastSeq, epoch });
      showShare(share);
    }
    state.role = reply.role;
    state.leadChunks = reply.lead_chunks ?? state.leadChunks;
    state.resumes += 1;
    setStatus("live", reply.role === "host" ? "live" : `live (${reply.role})`);
    notice("");
    log(`resumed (${reply.replayed} chunks re-sent)`);
  }

  // Leave the world (a host's ends for everyone in it; a start waiting in line leaves the line): the page
  // lets the connection go at once, and the server's session.closed reply says why, as any close does.
  function closeWorld() {
    const client = state.client;
    if (!live()) return false;
    state.client = null; // nothing more of this connection is played
    rtcDone();
    client.close().then((reason) => sessionClosed(reason || "closed"));
    return true;
  }

  // -- a viewer over WebRTC (WHEP: POST an SDP offer with the share token, the answer back) ---------------
  // The world's frames come as a video track (played in a <video> over the canvas); the overlay's transport
  // shows the round trip and the packets lost, from getStats(). Steering stays on the WebSocket.

  // pc, resource: a WHEP viewer's peer and its WHEP resource; client: a whole session over WebRTC (its
  // WebRTCWorldClient); video, timer, stats, chunks: either's.
  const rtc = { pc: null, client: null, video: null, resource: null, timer: null, stats: null, chunks: new Map() };

  async function whepWatch(join) {
    whepLeave();
    setStatus("connecting", "connecting (WebRTC)…");
    const pc = new RTCPeerConnection();
    rtc.pc = pc;
    pc.addTransceiver("video", { direction: "recvonly" });
    const video = rtcVideo();
    rtc.video = video;
    pc.ontrack = (event) => {
      rtcPlay(video, event.streams[0] || new MediaStream([event.track]));
      rtcWatch(video, false);
    };
    pc.onconnectionstatechange = () => {
      if (rtc.pc !== pc || !["failed", "closed"].includes(pc.connectionState)) return;
      whepLeave();
      leaveWorld();
      setStatus("idle", "disconnected");
      notice("The WebRTC connection ended (the world ended, or the network dropped it).");
    };
    try {
      rtc.resource = await signal(pc, `${BASE}v1/whep/${encodeURIComponent(join.session)}`, join.token);
    } catch (error) {
      whepLeave();
      setStatus("error", "cannot watch");
      notice(`cannot watch this world over WebRTC: ${error.message}`);
      return;
    }
    const spec = state.served || state.spec;
    if (spec) {
      state.spec = spec;
      canvas.width = spec.width;
      canvas.height = spec.height;
      $("screen-box").style.aspectRatio = `${spec.width} / ${spec.height}`;
    }
    state.sessionId = join.session;
    state.role = "viewer";
    state.join = null;
    document.body.dataset.role = "viewer";
    state.media = "webrtc";
    setStatus("live", "live (viewer, WebRTC)");
    log(`watching session ${join.session.slice(0, 8)}… over WebRTC`);
    startRecording();
    rtc.timer = setInterval(whepStats, 1000);
  }

  async function whepStats() {
    const found = rtc.pc ? await linkStats(rtc.pc) : rtc.client ? await rtc.client.stats() : null;
    if (!found) return;
    rtc.stats = { transport: "webrtc", ...found };
    $("stat-transport").textContent = `webrtc · rtt ${found.rttMs ?? "–"} ms · loss ${found.lossPercent} %`;
    $("stat-media").textContent = found.codec || "webrtc";
    $("stat-fps").textContent = rtc.lastFrames === undefined ? "–" : String(found.framesDecoded - rtc.lastFrames);
    rtc.lastFrames = found.framesDecoded;
  }

  // A WHEP viewer leaves: its resource is DELETEd, its peer closed.
  function whepLeave() {
    if (rtc.resource) fetch(rtc.resource, { method: "DELETE", keepalive: true }).catch(() => {});
    if (rtc.pc) rtc.pc.close();
    rtc.pc = rtc.resource = null;
    rtcDone();
  }

  // Whatever played a WebRTC track goes: its <video>, its figures' timer.
  function rtcDone() {
    if (rtc.video) rtc.video.remove();
    if (rtc.timer) clearInterval(rtc.timer);
    Object.assign(rtc, { client: null, video: null, timer: null });
  }

  // The <video> a WebRTC track plays in, over the canvas.
  function rtcVideo() {
    const video = document.createElement("video");
    video.className = "mse rtc";
    video.muted = true;
    video.playsInline = true;
    video.autoplay = true;
    canvas.parentElement.prepend(video);
    return video;
  }

  function rtcPlay(video, stream) {
    video.srcObject = stream;
    video.play().catch(() => {});
  }

  // -- a whole session over WebRTC (?transport=webrtc: POST /v1/webrtc) ---------------------------------------
  // The package's WebRTCWorldClient: the session's messages travel on a data channel, exactly as on the socket;
  // its frames on a video track, shown by a <video> over the canvas. A frame's chunk comes from its RTP
  // timestamp (chunk.track {seq, frame, rtp} names the timestamp of a chunk's first frame on the track; the
  // client keeps them), and the <video>'s requestVideoFrameCallback tells each frame's as it is shown. A chunk is
  // acked, and its inputs' key->screen figure taken, when its first frame is shown. A peer connection lost is a
  // dropped socket: the page resumes its world on a new one.

  // A peer connection is up (the first, or one on the front-end a move went to): its track plays here.
  function rtcOpened(client) {
    rtcDone();
    const video = rtcVideo();
    Object.assign(rtc, { client, video, chunks: new Map(), timer: setInterval(whepStats, 1000) });
    rtcPlay(video, client.stream);
    rtcWatch(video, true);
  }

  // A chunk's header: its inputs' figures wait for its first frame on the track.
  function rtcChunk(header) {
    if (header.supersedes != null) supersede(header.supersedes, header.seq);
    if (header.epoch > state.epoch) newEpoch(header.epoch); // another controller reset the world
    state.lastSeq = Math.max(state.lastSeq, header.seq);
    state.lastChunkMs = header.timings.tick_ms;
    rtc.chunks.set(header.seq, { header, photon: inputsApplied(header), shown: false });
    for (const seq of rtc.chunks.keys()) { if (seq < header.seq - 16) rtc.chunks.delete(seq); }
    if (state.status === "resetting" && header.epoch >= state.epoch) setStatus("live", rtcLive()); // the new world
  }

  function rtcLive() {
    return state.role === "host" ? "live (WebRTC)" : `live (${state.role}, WebRTC)`;
  }

  // Each frame the <video> shows is drawn to the canvas too (what the download records); a session's frames are
  // also told their chunks (a WHEP viewer's are acked by the server as they go out).
  function rtcWatch(video, session) {
    if (!video.requestVideoFrameCallback) return;
    const shown = (now, meta) => {
      if (rtc.video !== video) return;
      ctx.drawImage(video, 0, 0, canvas.width, canvas.height);
      recordFrame();
      if (session && meta.rtpTimestamp !== undefined && rtc.client) {
        state.displayed += 1;
        rtc.client.frameShown(meta.rtpTimestamp, meta.expectedDisplayTime || now, rtcShown); // on screen then
      }
      video.requestVideoFrameCallback(shown);
    };
    video.requestVideoFrameCallback(shown);
  }

  // A frame was on screen at `at`: its chunk is the one whose first frame's RTP timestamp is the latest at or
  // before its own, told once that is sure (the client's frameShown: a chunk's chunk.track can come after its first
  // frame is shown). That chunk's first frame shown acks it and gives its figures.
  function rtcShown(seq, rtp, at) {
    const chunk = seq === null ? undefined : rtc.chunks.get(seq);
    if (!chunk) return;
    state.rtcShown.push({ rtp: rtp >>> 0, seq, chunk: chunk.header.chunk_index, epoch: chunk.header.epoch });
    if (state.rtcShown.length > PHOTON_LOG_MAX) state.rtcShown.shift();
    state.shownSeq = seq;
    state.chunkIndex = chunk.header.chunk_index;
    if (chunk.shown || state.supersededSeqs.has(seq)) return;
    chunk.shown = true;
    const info = state.chunkOf.get(seq);
    if (info) info.shown = 1;
    ack(seq);
    if (chunk.photon) {
      chunk.photon.received = chunk.photon.decoded = at; // the track's frames: decoded by the <video>
      photonShown(chunk.photon, at);
    }
  }

  // Lose the session's peer connection as a network failure would (no DELETE): the page resumes.
  function loseWebRTC() {
    const client = rtc.client;
    if (!client || state.client !== client) return;
    closeSocket(3001, "lost (test)");
    onSocketClosed({ code: 1006 }, true);
  }

  // -- losing the socket: resume, restart, or say why ----------------------------------------

  function onSocketClosed(event, opened) {
    const reconnecting = state.reconnect;
    if (reconnecting && reconnecting.mode === "restart") {
      nextAttempt(); // the server is not back yet
      return;
    }
    if (!opened) { // the handshake failed: a refusal (browsers say only 1006) or no server
      diagnose().then((cause) => {
        if ((cause === "down" || cause === "transient") && reconnecting) nextAttempt(); // within the grace
        else refused(cause);
      });
      return;
    }
    if (event.code === 4000) {
      stopReconnecting();
      leaveWorld();
      setStatus("idle", "taken over");
      notice("This world was resumed in another tab or window; this one let it go.", "info");
      return;
    }
    if (state.sessionId && state.resumeToken && event.code !== 1000) {
      // A lost connection (or the server going away without a notice): take the world back.
      beginReconnect("resume", [1001, 1012].includes(event.code));
      return;
    }
    stopReconnecting();
    if (["live", "failed", "resetting", "connecting", "queued"].includes(state.status)) setStatus("idle", "disconnected");
  }

  // Tell a refused handshake from a server that is down, or a handshake that just failed (the browser says
  // only 1006 for each): /healthz needs no token, /v1/models does, and POST /v1/origin says whether the
  // server takes this page's origin (a POST carries the Origin header the socket's handshake did). Only
  // what the server says is a refusal: anything else is "transient" (retried while resuming).
  async function diagnose() {
    try {
      const health = await fetch(`${BASE}healthz`, { cache: "no-store" });
      if (!health.ok) return "down";
    } catch (error) {
      return "down";
    }
    try {
      const token = tokenValue();
      const models = await fetch(`${BASE}v1/models`, {
        cache: "no-store", headers: token ? { Authorization: `Bearer ${token}` } : {},
      });
      if (models.status === 401) return token ? "wrong-token" : "needs-token";
      const origin = await fetch(`${BASE}v1/origin`, { method: "POST", cache: "no-store" });
      if (origin.ok && (await origin.json()).allowed === false) return "origin";
    } catch (error) {
      return "transient";
    }
    return "transient";
  }

  function refused(cause) {
    stopReconnecting();
    const joining = state.join ? "Join" : "Start";
    const said = {
      "needs-token": [`this server needs a token`, `This server needs a token: type it in the Token field and press ${joining}.`],
      "wrong-token": [`wrong token`, `The server refused this token: check it in the Token field and press ${joining} again.`],
      origin: [`refused (origin)`, "The server refused this page's origin (the server's --allow-origin lists the pages it takes)."],
      down: [`cannot reach the server`, "The server does not answer: is it running?"],
      transient: [`connection failed`, `The connection did not open, though the server answers: press ${joining} to try again.`],
    }[cause];
    setStatus("error", said[0]);
    notice(said[1]);
    log(said[1], "error");
    if (cause.endsWith("token")) $("token").focus();
  }

  // mode "resume": after a drop, until the server's grace ends; "restart": after a shutdown notice.
  function beginReconnect(mode, serverWentAway) {
    if (state.reconnect && state.reconnect.mode === mode) return;
    stopReconnecting();
    const graceMs = (state.resumeGraceS || 30) * 1000;
    state.reconnect = {
      mode,
      attempt: 0,
      timer: null,
      serverWentAway: Boolean(serverWentAway),
      deadline: performance.now() + (mode === "resume" ? graceMs : RESTART_GIVE_UP_MS),
    };
    if (mode === "resume") {
      setStatus("reconnecting", "reconnecting…");
      log(state.reloaded ? "page reloaded; resuming…" : "connection lost; resuming…", state.reloaded ? "" : "error");
    } else {
      setStatus("restarting", "server restarting…");
    }
    nextAttempt();
  }

  function nextAttempt() {
    const reconnect = state.reconnect;
    if (!reconnect || reconnect.timer) return; // none, or one already due
    const delay = BACKOFF_MS[Math.min(reconnect.attempt, BACKOFF_MS.length - 1)];
    reconnect.attempt += 1;
    if (performance.now() + delay > reconnect.deadline) {
      if (reconnect.mode === "resume") worldLost("the server did not come back within its resume grace");
      else { stopReconnecting(); setStatus("error", "server gone"); notice("The server did not come back."); }
      return;
    }
    reconnect.timer = setTimeout(attempt, delay);
  }

  async function attempt() {
    const reconnect = state.reconnect;
    if (!reconnect) return;
    reconnect.timer = null;
    if (reconnect.mode === "restart") {
      try { // wait for the new server to answer before opening a socket
        const health = await fetch(`${BASE}healthz`, { cache: "no-store" });
        if (!health.ok) throw new Error(String(health.status));
      } catch (error) {
        nextAttempt();
        return;
      }
      if (state.reconnect !== reconnect) return;
      connect("start");
    } else {
      connect("resume");
    }
  }

  function stopReconnecting() {
    if (state.reconnect && state.reconnect.timer) clearTimeout(state.reconnect.timer);
    state.reconnect = null;
  }

  // The server ended our world (it stopped): when it is back, start the same world again, no click.
  function serverStopped() {
    const wasHost = state.role === "host";
    leaveWorld(); // its share links lead nowhere now
    state.queue = [];
    mseClose();
    if (!wasHost) {
      setStatus("idle", "server stopped");
      notice("The server stopped, and the shared world with it. Press Start for a world of your own.", "info");
      return;
    }
    state.restarts += 1;
    notice("The server is restarting; a new world starts as soon as it is back.", "info");
    beginReconnect("restart");
  }

  // Our place is gone (the grace ran out, or the server forgot us): offer a new world.
  function worldLost(why) {
    stopReconnecting();
    leaveWorld();
    setStatus("lost", "world lost");
    notice(`Your world is gone (${why}). Press Start for a new one.`);
    log(`world lost: ${why}`, "error");
  }

  // -- messages ---------------------------------------------------------------------------

  // What the server sends unasked (the verbs' replies are handled where each verb is sent).
  function onMessage(message) {
    switch (message.type) {
      case "session.queued":
        showQueued(message);
        break;
      case "chunk.skipped":
        state.lastSeq = Math.max(state.lastSeq, message.to_seq);
        log(`chunks ${message.from_seq}–${message.to_seq} skipped (${SKIPPED_BECAUSE[message.reason] || message.reason})`);
        break;
      case "chunk":
        if (rtc.client) { // over WebRTC its frames are the track's
          rtcChunk(message);
          break;
        }
        if (message.supersedes != null) supersede(message.supersedes, message.seq);
        if (!message.frames.sent && state.partsOf.delete(message.seq)) jitterDropSeq(message.seq); // made again: whole
        state.header = message;
        state.frames = [];
        if (message.epoch > state.epoch) newEpoch(message.epoch); // another controller reset the world
        if (message.frames.sizes.length === 0) finishChunk();
        break;
      case "chunk.part": // frames of a chunk still being made: they play as they come
        if (rtc.client) break;
        state.header = message;
        state.frames = [];
        if (message.frames.sizes.length === 0) finishPart();
        break;
      case "input.dropped":
        // A superseded held key/camera event is routine (a newer one replaced it), not worth a log line.
        if (message.reason !== "superseded") log(`events ${message.event_ids.join(", ")} dropped (${message.reason})`);
        message.event_ids.forEach((id) => state.sentAt.delete(id));
        break;
      case "session.failed":
        sessionFailed(message.code, message.message);
        break;
      case "session.reset": // our reset's reply, come after its request timed out (resetWorld hears it otherwise)
        newEpoch(message.epoch);
        log(`reset (epoch ${message.epoch})`);
        break;
      case "session.closed":
        sessionClosed(message.reason);
        break;
      case "error":
        onError(message.code, message.message);
        break;
      default:
        break;
    }
  }

  function sessionFailed(code, detail) {
    setStatus("failed", `failed: ${code}`);
    log(`session failed (${code}): ${detail} — press Reset`, "error");
  }

  function sessionClosed(reason) {
    log(`session closed (${reason})`);
    if (reason === "shutdown") {
      serverStopped();
    } else {
      leaveWorld();
      setStatus("idle", "closed");
    }
  }

  function resetWorld() {
    const client = state.client;
    if (!live()) return;
    setStatus("resetting", "resetting…");
    client.reset().then((epoch) => {
      if (state.client !== client) return;
      newEpoch(epoch);
      log(`reset (epoch ${epoch})`);
    }, refusedBy);
  }

  function onError(code, detail) {
    log(`error ${code}: ${detail}`, "error");
    if (code === "resume_refused") {
      const restarted = state.reconnect && state.reconnect.serverWentAway;
      if (restarted && state.role === "host") { // the server restarted without a notice: start again
        leaveWorld();
        state.restarts += 1;
        stopReconnecting();
        beginReconnect("restart");
      } else {
        worldLost("the server no longer holds it");
      }
    } else if (code === "join_refused") {
      state.join = null;
      leaveWorld();
      setStatus("error", "cannot join");
      notice("Cannot join: that world has ended, or the link is not valid. Press Start for a world of your own.");
    }
  }

  // A reset (ours, or another controller's, seen as a chunk of a new epoch): the world starts over.
  function newEpoch(epoch) {
    if (epoch <= state.epoch && state.status !== "resetting") return;
    state.epoch = Math.max(state.epoch, epoch);
    state.queue = state.queue.filter((item) => item.epoch >= state.epoch);
    $("prompt").value = ""; // the world is back at its start prompt, shown as the placeholder
    $("prompt").placeholder = (state.started && state.started.prompt) || "islands";
    if (state.status !== "resetting") setStatus("resetting", "resetting…");
  }

  // -- frames -----------------------------------------------------------------------------

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
    meterAdd(buffer.byteLength);
    const { width, height, media } = header.frames;
    if (media === "h264") { // the chunk's one fragment: to the H.264 player
      state.header = null;
      state.lastSeq = Math.max(state.lastSeq, header.seq);
      const photon = inputsApplied(header);
      if (photon) photon.received = photon.decoded = performance.now(); // the <video> decodes it: in "buffer"
      state.lastChunkMs = header.timings.tick_ms;
      mseChunk(header, buffer, photon);
      chunkReceived(header.seq);
      return;
    }
    state.frames.push(decodeFrame(new Uint8Array(buffer), media, width, height)); // the package's decoding
    if (state.frames.length === header.frames.sizes.length) {
      if (header.type === "chunk.part") finishPart();
      else finishChunk();
    }
  }

  // A part of a chunk is in: its frames queue behind the chunk's frames before them, and play as they come.
  function finishPart() {
    const header = state.header;
    const pending = state.frames;
    state.header = null;
    state.frames = [];
    state.parts += 1;
    const first = header.first === 0;
    if (first) state.partsOf.set(header.seq, { received: performance.now(), decoded: null, firstShownAt: null, chunkIn: false, photon: null });
    const part = state.partsOf.get(header.seq);
    if (!part) return; // its first part was not ours (a resume between parts): the chunk comes with the rest
    const decoded = Promise.all(pending);
    state.decoding = state.decoding.then(() => decoded).then((images) => {
      if (first) {
        part.decoded = performance.now();
        if (images.length) jitterChunkStarts(); // its wait weighed as a whole chunk's is
      }
      queueParted(header, images, header.first);
    }).catch((error) => console.error("a chunk part's frames could not be decoded", error));
  }

  // Frames of a chunk taken in parts, from its frame `from` on, into the jitter buffer's queue.
  function queueParted(header, images, from) {
    images.forEach((image, offset) => {
      const index = from + offset;
      state.queue.push({ image, seq: header.seq, epoch: header.epoch, first: index === 0, parted: true, chunk: header.chunk_index, index });
    });
    if (images.length) jitterArrived(performance.now());
  }

  // The chunk of parts whose first frame is on screen (at) has come: ack it now (the server knows its seq from
  // then) and take its key->screen figure from its first part's instants.
  function partsDone(seq, part, at) {
    state.partsOf.delete(seq);
    ack(seq);
    if (part.photon) {
      part.photon.received = part.received;
      part.photon.decoded = part.decoded;
      photonShown(part.photon, at);
    }
  }

  function chunkReceived(seq) {
    state.received.push(seq);
    if (state.received.length > PHOTON_LOG_MAX) state.received.shift();
  }

  function finishChunk() {
    const header = state.header;
    state.lastSeq = Math.max(state.lastSeq, header.seq);
    chunkReceived(header.seq);
    const pending = state.frames;
    state.header = null;
    state.frames = [];
    const photon = inputsApplied(header);
    if (photon) photon.received = performance.now(); // its last binary message is in
    state.lastChunkMs = header.timings.tick_ms;
    const info = state.chunkOf.get(header.seq);
    for (const seq of state.partsOf.keys()) { if (seq < header.seq - 8) state.partsOf.delete(seq); }
    const sent = header.frames.sent || 0;
    const part = sent ? state.partsOf.get(header.seq) : undefined;
    if (part) { // its first frames came in parts (queued already): the rest queues behind them
      const rest = Promise.all(pending);
      state.decoding = state.decoding.then(() => rest).then((images) => {
        queueParted(header, images, sent);
        part.chunkIn = true;
        part.photon = photon;
        if (part.firstShownAt !== null) partsDone(header.seq, part, part.firstShownAt);
      }).catch((error) => console.error("a chunk's frames could not be decoded", error));
      return;
    }
    // Queued in the order the chunks came, whichever decodes first (a burst after a stall decodes at once).
    const decoded = Promise.all(pending);
    state.decoding = state.decoding.then(() => decoded).then((images) => {
      if (state.supersededSeqs.has(header.seq)) return; // replaced while it was decoding
      if (photon) photon.decoded = performance.now();
      if (images.length) jitterChunkStarts();
      // A replacement plays from where the chunk it replaces was (its frames shown are not shown again).
      const from = Math.min(info ? info.skip : 0, images.length);
      images.forEach((image, index) => {
        if (index < from) return;
        const item = { image, seq: header.seq, epoch: header.epoch, first: index === from, chunk: header.chunk_index, index };
        if (index === from && photon) item.photon = photon;
        state.queue.push(item);
      });
      if (images.length === from) ack(header.seq);
      else jitterArrived(performance.now());
    }).catch((error) => console.error("a chunk's frames could not be decoded", error));
  }

  // A preemption: input came before chunk `seq` began to play, so the server made it again with that
  // input (chunk `by`, same chunk index). What is left of the old one is never shown: its queued frames
  // go, and the new one takes its place; its inputs' key->screen figures are measured on the new one.
  // (JPEG and raw only: the server never replaces a chunk sent to an H.264 member, whose fragment the
  // <video> may have decoded already.)
  function supersede(seq, by) {
    const old = state.chunkOf.get(seq);
    state.superseded += 1;
    state.supersededSeqs.add(seq);
    jitterDropSeq(seq);
    const shownOld = old ? old.shown : 0;
    state.chunkOf.set(by, { shown: 0, skip: shownOld, applied: [] });
    if (old && shownOld === 0) old.applied.forEach(([id, at]) => { if (!state.sentAt.has(id)) state.sentAt.set(id, at); });
    log(`chunk ${seq} replaced by ${by} (input came before it played; ${shownOld} of its frames were shown, ${state.queue.length} queued)`);
  }

  // The chunk applied our events: the server's figure now, and when our earliest input behind them
  // happened (its first frame on screen gives the key->screen figure), with the server's instants
  // for it (the chunk's times: when it accepted that event, ticked, stepped, encoded, handed it over).
  // null: none of ours.
  function inputsApplied(header) {
    let photon = null;
    const info = state.chunkOf.get(header.seq) || { shown: 0, skip: 0, applied: [] };
    state.chunkOf.set(header.seq, info);
    for (const seq of state.chunkOf.keys()) { if (seq < header.seq - 8) state.chunkOf.delete(seq); }
    for (const seq of state.supersededSeqs) { if (seq < header.seq - 8) state.supersededSeqs.delete(seq); }
    header.applied_event_ids.forEach((id, index) => {
      const at = state.sentAt.get(id);
      if (at !== undefined) {
        if (photon === null || at < photon.from) {
          const accepted = header.times ? header.times.accepted_ms[index] : undefined;
          photon = { from: at, times: accepted === undefined ? null : { ...header.times, accepted_ms: accepted } };
        }
        state.sentAt.delete(id);
        info.applied.push([id, at]);
      }
      const latency = (header.applied_latency_ms || [])[index];
      if (latency !== undefined) state.serverAppliedMs = latency;
    });
    return photon;
  }

  // The first frame that applied our input is on screen (at: then, on performance.now()'s clock): key->screen, and its
  // parts as docs/latency.md splits it, each ending where the next begins, so they sum to the total:
  // wait_tick (accepted -> tick), step (tick -> stepped: the step's queue and the model), encode
  // (stepped -> encoded) on the server's clock; decode (received -> decoded) and buffer (decoded ->
  // on screen: the jitter buffer's wait) on ours; transfer is the rest (the way up, the handoff to the
  // connection, the way back): the only part that spans both clocks, so it needs no offset between them.
  function photonShown(photon, at) {
    state.photonMs = at - photon.from;
    const t = photon.times;
    if (!t) {
      state.photonParts = null;
      logPhoton({ total: state.photonMs });
      return;
    }
    // A chunk in parts: the frame left with its first part (part_ms), made and encoded before the step ended.
    const stepped = t.part_ms ?? t.stepped_ms;
    const encoded = t.part_ms ?? t.encoded_ms;
    const parts = {
      wait_tick: t.tick_ms - t.accepted_ms,
      step: stepped - t.tick_ms,
      encode: encoded - stepped,
      transfer: 0,
      decode: photon.decoded - photon.received,
      buffer: at - photon.decoded,
    };
    parts.transfer = state.photonMs - parts.wait_tick - parts.step - parts.encode - parts.decode - parts.buffer;
    state.photonParts = { total: state.photonMs, ...parts };
    logPhoton(state.photonParts);
  }

  function logPhoton(figure) {
    state.photonLog.push({ ...figure, media: state.media });
    if (state.photonLog.length > PHOTON_LOG_MAX) state.photonLog.shift();
  }

  function photonPartsText() {
    const p = state.photonParts;
    if (!p) return "–";
    const ms = (v) => String(Math.round(v));
    return `tick ${ms(p.wait_tick)} · step ${ms(p.step)} · enc ${ms(p.encode)} · net ${ms(p.transfer)}`
      + ` · dec ${ms(p.decode)} · buf ${ms(p.buffer)}`;
  }

  function ack(seq) {
    if (live()) state.client.ack(seq);
  }

  // ---- the jitter buffer (JPEG and raw; its target steers the H.264 player too) ----------
  // The rule of worldserve.tools.jitter (the bench's players follow it, so the bench measures what
  // this page shows; docs/latency.md, "The player's jitter buffer"): the target is the slack, in
  // frames, a chunk that finds playback stopped (the first, or the first after an underrun) waits
  // after it arrives; frames then play one frame period apart. An underrun (a frame due, none queued,
  // the stream live) stops playback and grows the target a frame, up to two chunks; each calm
  // JITTER_SHRINK_AFTER_MS of play shrinks it a frame, taken back by playing the next two frames half
  // a period early each (nothing dropped). And the level (frames still queued when a chunk arrives):
  // when the least of the last JITTER_LEVEL_WINDOW chunks' is above the target and a chunk (a server a
  // chunk ahead keeps one queued by design; more is what a stall's burst left), a frame is taken back
  // the same way, once per chunk, so a stall leaves no lasting delay.
  const JITTER_START_FRAMES = 1;
  const JITTER_SHRINK_AFTER_MS = 3000;
  const JITTER_LEVEL_WINDOW = 4;
  const jitter = {
    target: JITTER_START_FRAMES, most: JITTER_START_FRAMES, underruns: 0,
    playing: false, holdUntil: null, calmSince: null, earlyMs: 0,
    changes: [], // [["grow"|"shrink", target], ...]: each change of the target, in order (the last 200)
    levels: [], // each of the last chunks' wait as it arrived (ms: the frames queued ahead of it)
    takenBack: 0, // chunks whose arrival took time back (a queue above the target + the server's lead)
  };

  function jitterReset() {
    Object.assign(jitter, {
      target: JITTER_START_FRAMES, most: JITTER_START_FRAMES, underruns: 0,
      playing: false, holdUntil: null, calmSince: null, earlyMs: 0, changes: [], levels: [], takenBack: 0,
    });
  }

  // A chunk's first frames are in (a whole chunk, or its first part): its wait, behind every frame queued, less
  // what is being taken back, weighed by jitterLevel.
  function jitterChunkStarts() {
    const now = performance.now();
    jitter.earlyMs += jitterLevel(state.nextFrameAt - now + state.queue.length * framePeriodMs() - jitter.earlyMs);
  }

  // A chunk arrived and waits `waitMs` before its first frame plays (the frames queued ahead of it, in
  // time): the ms to take back (0: none), at most a frame, when the least wait of the last few chunks is
  // above the target plus what the server's lead queues by design (tools/jitter.py: the same rule).
  function jitterLevel(waitMs) {
    if (!jitter.playing) return 0;
    jitter.levels.push(waitMs);
    if (jitter.levels.length > JITTER_LEVEL_WINDOW) jitter.levels.shift();
    const ahead = state.leadChunks * (state.spec ? state.spec.frames_per_chunk : 4);
    const period = framePeriodMs();
    const excess = Math.min(...jitter.levels) - (jitter.target + ahead) * period;
    if (jitter.levels.length < JITTER_LEVEL_WINDOW || excess <= 0.001) return 0;
    jitter.takenBack += 1;
    return Math.min(excess, period);
  }

  function jitterChanged(kind) {
    jitter.changes.push([kind, jitter.target]);
    if (jitter.changes.length > 200) jitter.changes.shift();
  }

  function framePeriodMs() {
    return state.spec ? 1000 / state.spec.fps : 1000 / 16;
  }

  function jitterCap() {
    return 2 * (state.spec ? state.spec.frames_per_chunk : 4);
  }

  function streamLive() {
    return state.status === "live" && live();
  }

  // A chunk's frames are here (now: performance.now()): if playback is stopped, it starts target frames on.
  function jitterArrived(now) {
    if (!jitter.playing && jitter.holdUntil === null) jitter.holdUntil = now + jitter.target * framePeriodMs();
  }

  // Playback (stopped) may start now: the held chunk has waited the target.
  function jitterStarts(now) {
    if (jitter.playing || jitter.holdUntil === null || now < jitter.holdUntil) return false;
    jitter.playing = true;
    if (jitter.calmSince === null) jitter.calmSince = now;
    return true;
  }

  // Due, and nothing to play: an underrun if the stream is live (a drop or a reset is not one).
  function jitterDry(now) {
    jitter.playing = false;
    jitter.holdUntil = null;
    jitter.earlyMs = 0;
    if (!streamLive()) return;
    jitter.underruns += 1;
    jitter.levels = [];
    const before = jitter.target;
    jitter.target = Math.min(jitterCap(), jitter.target + 1);
    jitter.most = Math.max(jitter.most, jitter.target);
    jitter.calmSince = now;
    if (jitter.target !== before) jitterChanged("grow");
  }

  // Playing, calm long enough: the target shrinks a frame (true: the caller takes that frame back).
  function jitterShrinks(now) {
    if (now - jitter.calmSince < JITTER_SHRINK_AFTER_MS || jitter.target <= JITTER_START_FRAMES) return false;
    jitter.target = Math.max(JITTER_START_FRAMES, jitter.target - 1);
    jitter.calmSince = now;
    jitterChanged("shrink");
    return true;
  }

  // A frame played at `now`: the wait until the next one (a shrink takes a frame back, half at a time).
  function jitterInterval(now, period) {
    if (jitterShrinks(now)) jitter.earlyMs += period;
    const early = Math.min(jitter.earlyMs, period / 2);
    jitter.earlyMs -= early;
    return period - early;
  }

  // A later chunk takes seq's place (a chunk superseding it): its frames not yet played go; how many.
  function jitterDropSeq(seq) {
    const before = state.queue.length;
    state.queue = state.queue.filter((item) => item.seq !== seq);
    if (!state.queue.length && !jitter.playing) jitter.holdUntil = null;
    return before - state.queue.length;
  }

  // `now`: when what is drawn now reaches the screen (an animation frame's time, a refresh on): frames are due then,
  // so each is drawn by the animation frame whose picture is the first on screen at or after its instant.
  function playQueued(now, period) {
    while (state.queue.length && state.queue[0].epoch < state.epoch) { // made before a reset: not shown
      const old = state.queue.shift();
      if (old.first) ack(old.seq);
    }
    if (!jitter.playing) {
      if (!state.queue.length) jitter.holdUntil = null;
      if (!jitterStarts(now)) return;
      state.nextFrameAt = now;
    }
    if (now < state.nextFrameAt) return;
    const item = state.queue.shift();
    if (!item) {
      jitterDry(now);
      return;
    }
    if (item.image instanceof ImageData) ctx.putImageData(item.image, 0, 0);
    else ctx.drawImage(item.image, 0, 0);
    if (item.photon) photonShown(item.photon, now);
    const part = item.first && item.parted ? state.partsOf.get(item.seq) : undefined;
    if (part && part.chunkIn) partsDone(item.seq, part, now);
    else if (part) part.firstShownAt = now; // acked once the chunk itself comes
    else if (item.first) ack(item.seq);
    const info = state.chunkOf.get(item.seq);
    if (info) info.shown += 1;
    state.shownSeq = item.seq;
    shown(item.chunk, item.index, item.epoch);
    // Catch up if we fell far behind instead of playing in slow motion.
    state.nextFrameAt = Math.max(state.nextFrameAt + jitterInterval(now, period), now - period);
  }

  // The display's refresh interval, from the animation frames' spacing: what an animation frame draws is on screen
  // a refresh after the frame's time (the least of the last gaps: a busy page skips frames, a display never speeds up).
  const refresh = { last: null, gaps: [], ms: 1000 / 60 };

  function refreshSeen(now) {
    if (refresh.last !== null && now > refresh.last && now - refresh.last < 100) {
      refresh.gaps.push(now - refresh.last);
      if (refresh.gaps.length > 30) refresh.gaps.shift();
      refresh.ms = Math.min(Math.max(Math.min(...refresh.gaps), 4), 50);
    }
    refresh.last = now;
  }

  function play(now) {
    const period = framePeriodMs();
    refreshSeen(now);
    pollGamepad(now);
    if (mse.player) mseTick(now);
    else playQueued(now + refresh.ms, period); // what this animation frame draws is on screen then
    while (state.fpsTimes.length && state.fpsTimes[0] < now - 1000) state.fpsTimes.shift();
    const figure = (value, digits) => (value === null ? "–" : value.toFixed(digits));
    $("stat-fps").textContent = String(state.fpsTimes.length);
    $("stat-chunk").textContent = state.chunkIndex >= 0 ? String(state.chunkIndex) : "–";
    $("stat-chunk-ms").textContent = figure(state.lastChunkMs, 1);
    $("stat-photon-ms").textContent = figure(state.photonMs, 0);
    $("stat-photon-parts").textContent = photonPartsText();
    if ((rtc.pc || rtc.client) && rtc.stats) { // Chromium's own WebRTC receiver: its jitter buffer's mean wait and its freezes
      $("stat-jitter").textContent = rtc.stats.jitterBufferMs === null ? "–" : `${rtc.stats.jitterBufferMs} ms`;
      $("stat-underruns").textContent = String(rtc.stats.freezes);
    } else {
      $("stat-jitter").textContent = String(jitter.target);
      $("stat-underruns").textContent = String(jitter.underruns);
    }
    $("stat-applied-ms").textContent = figure(state.serverAppliedMs, 0);
    $("stat-buffered").textContent = String(mse.player ? mseBuffered() : state.queue.length);
    $("stat-media").textContent = state.media || "–";
    $("stat-kbps").textContent = meterUpdate(now);
    requestAnimationFrame(play);
  }

  // A frame is on the canvas (any media): the figures, the recording, and the end of a reset.
  function shown(chunk, frameInChunk, epoch) {
    recordFrame();
    state.chunkIndex = chunk;
    state.frameInChunk = frameInChunk;
    state.displayed += 1;
    state.fpsTimes.push(performance.now());
    if (state.status === "resetting" && epoch >= state.epoch) {
      setStatus("live", state.role === "host" ? "live" : `live (${state.role})`);
    }
  }

  // ---- H.264 playback through Media Source Extensions ---------------------------------
  // The session gets one fMP4 fragment per chunk (docs/media.md), the init segment in front
  // where this connection's stream starts. The package's H264Player (clients/ts/src/h264.ts)
  // appends them in order to one SourceBuffer of a muted <video> under the canvas and trims
  // what was played; each frame the video presents is drawn onto the canvas here, so input,
  // overlay and scaling work as for the other media. The buffer stays short: generation is
  // paced by our acks (sent when a chunk's first frame is shown), and a player that falls
  // behind jumps to the live edge (mseTick).
  const mse = {
    player: null, // the package's H264Player, its <video> as player.video
    chunks: new Map(), // seq -> {epoch, chunk, photon?}: what the page knows of each chunk pushed
    fastUntil: 0, // a shrink plays at 1.5x until then (performance.now())
  };

  function chooseMedia() {
    const asked = state.forceMedia || new URLSearchParams(location.search).get("media");
    if (asked === "raw" || asked === "jpeg") return asked;
    if (H264Player.playable()) return "h264";
    log("this browser cannot play H.264 (Media Source Extensions); frames come as JPEG");
    return "jpeg";
  }

  function mseClose() {
    if (!mse.player) return;
    mse.player.close();
    mse.player.video.remove();
    Object.assign(mse, { player: null, chunks: new Map(), fastUntil: 0 });
  }

  function mseOpen() {
    mseClose();
    const video = document.createElement("video");
    video.className = "mse";
    video.addEventListener("waiting", mseWaiting);
    canvas.parentElement.prepend(video);
    const player = new H264Player(video, state.spec.fps, undefined, {
      autoplay: false, // the jitter buffer plays and pauses it (mseTick)
      onChunkShown(seq, at) { // a chunk is played once its first frame is shown (or passed); at: on screen then
        ack(seq);
        const known = mse.chunks.get(seq);
        if (known && known.photon) photonShown(known.photon, at);
      },
      onFrame(seq, index) {
        if (mse.player === player) mseShow(seq, index);
      },
      onFailure(reason) {
        if (mse.player === player) mseFail(reason);
      },
    });
    mse.player = player;
  }

  function mseFail(reason) {
    log(`cannot play H.264 here (${reason})`, "error");
    mseClose();
    if (state.role === "host") { // start over with JPEG
      state.forceMedia = "jpeg";
      log("starting again with JPEG");
      connect("start");
    }
  }

  // photon: our earliest input this chunk applied (inputsApplied; null: none of ours).
  function mseChunk(header, buffer, photon) {
    if (!mse.player) {
      if (!header.frames.init_bytes) return ack(header.seq); // nothing to start from (the server sends the init first)
      mseOpen();
    }
    const count = header.frames.count;
    const back = count ? jitterLevel(mse.player.bufferedMs()) : 0; // played at 1.5x for twice as long takes it back
    if (back > 0) mse.fastUntil = performance.now() + 2 * back;
    const known = { epoch: header.epoch, chunk: header.chunk_index };
    if (photon) known.photon = photon;
    mse.chunks.set(header.seq, known);
    for (const seq of mse.chunks.keys()) { // what is kept: the last few seconds' chunks
      if (seq < header.seq - 64) mse.chunks.delete(seq);
    }
    mse.player.push({ seq: header.seq, media: "h264", header, payloads: [new Uint8Array(buffer)] });
    jitterArrived(performance.now());
  }

  function mseBuffered() { // in frames
    return Math.round((mse.player.bufferedMs() * state.spec.fps) / 1000);
  }

  // A frame the video presents: drawn, unless its chunk was made before a reset.
  function mseShow(seq, index) {
    const known = mse.chunks.get(seq);
    if (!known || known.epoch < state.epoch) return;
    ctx.drawImage(mse.player.video, 0, 0, canvas.width, canvas.height);
    state.shownSeq = seq;
    shown(known.chunk, index, known.epoch);
  }

  // The <video> under the jitter buffer's rule (see "the jitter buffer"): it starts (and, after an
  // underrun, starts again) once the chunk that found it stopped has waited the target; a shrink plays
  // two frames' time at 1.5x (a frame taken back, none dropped); and it stays near the live edge: when
  // more is buffered ahead than the target and four chunks (a lead chunk, chunks in flight and a busy
  // machine's bunching are normal), it jumps to the newest chunk plus the target.
  function mseTick(now) {
    const video = mse.player.video;
    const fps = state.spec.fps;
    const chunk = state.spec.frames_per_chunk / fps; // seconds
    mse.player.jumpToLiveEdge(chunk * 4 + jitter.target / fps, chunk + jitter.target / fps);
    if (!jitter.playing) {
      if (!video.paused) video.pause();
      // Frames in that no arrival started the wait for: a fragment still being appended when the video ran dry
      // (its arrival came while it played). They wait the target from now; else the video stays paused.
      if (jitter.holdUntil === null && mse.player.hasFrameAhead()) jitterArrived(now);
      if (video.readyState >= 2 && jitterStarts(now)) video.play().catch(() => {});
    } else {
      if (video.paused && video.readyState >= 2) video.play().catch(() => {});
      const period = 1000 / fps;
      if (jitterShrinks(now)) mse.fastUntil = now + 2 * period; // a frame taken back at 1.5x
      const rate = now < mse.fastUntil ? 1.5 : 1;
      if (video.playbackRate !== rate) video.playbackRate = rate;
    }
    mse.player.poll(now); // and a video stuck with frames ahead is nudged on (STUCK_MS)
  }

  // The <video> ran out of frames while playing: the jitter buffer's underrun (when the stream is live).
  function mseWaiting() {
    if (!jitter.playing || !mse.player) return;
    if (mse.player.hasFrameAhead()) return; // a seek or a hiccup with frames to play
    jitterDry(performance.now());
    mse.player.video.pause();
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
      button.addEventListener("click", (event) => {
        $("prompt").value = style;
        sendEvent({ prompt: style }, event.timeStamp);
        canvas.focus();
      });
      box.append(button);
    }
  }

  // -- keyboard ---------------------------------------------------------------------------

  function typing(event) {
    return event.target instanceof HTMLInputElement;
  }
  document.addEventListener("keydown", (event) => {
    if (typing(event)) return;
    const key = keyOf(event.code);
    if (key && modelKeys().keys.includes(key)) {
      event.preventDefault();
      if (!state.held.keys.has(key)) {
        state.held.keys.add(key);
        sendKeys(event.timeStamp);
      }
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey || event.repeat) return;
    if (event.code === "KeyF") toggleFullscreen();
    else if (event.code === "KeyO") toggleOverlay();
    else if (event.code === "KeyH" || event.key === "?") toggleHelp();
    else if (event.code === "Escape") toggleHelp(false);
  });
  document.addEventListener("keyup", (event) => {
    const key = keyOf(event.code);
    if (!key || typing(event)) return;
    event.preventDefault();
    if (state.held.keys.delete(key)) sendKeys(event.timeStamp);
  });
  window.addEventListener("blur", () => {
    if (state.held.keys.size || state.held.touch.size) {
      state.held.keys.clear();
      state.held.touch.clear();
      sendKeys();
    }
  });

  // -- mouse (and touch) drag pans the camera ("grab" the world: it follows the pointer) -----

  canvas.addEventListener("pointerdown", (event) => {
    if (modelTrack("mouse")) { // a mouse model: capture the pointer instead of dragging
      captureMouse();
      return;
    }
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

  // -- touch pad: hold a button to hold its key ---------------------------------------------

  for (const button of document.querySelectorAll("#touchpad button")) {
    const key = button.dataset.key;
    const release = (event) => {
      button.classList.remove("held");
      if (state.held.touch.delete(key)) sendKeys(event.timeStamp);
    };
    button.addEventListener("pointerdown", (event) => {
      event.preventDefault();
      if (button.setPointerCapture && event.pointerId !== undefined) {
        try { button.setPointerCapture(event.pointerId); } catch (error) { /* a synthetic pointer */ }
      }
      button.classList.add("held");
      if (!state.held.touch.has(key)) {
        state.held.touch.add(key);
        sendKeys(event.timeStamp);
      }
    });
    for (const name of ["pointerup", "pointercancel", "lostpointercapture"]) button.addEventListener(name, release);
    button.addEventListener("contextmenu", (event) => event.preventDefault());
  }

  // -- gamepad (standard mapping): left stick or d-pad moves, right stick pans ---------------

  const STICK_DEAD = 0.5; // a stick this far over holds the key
  const PAN_DEAD = 0.15;
  const gamepad = { camera: { dx: 0, dy: 0 } };

  function pollGamepad() {
    const pads = navigator.getGamepads ? Array.from(navigator.getGamepads()) : [];
    const pad = pads.find((p) => p && p.connected && p.mapping === "standard");
    const held = new Set();
    let dx = 0;
    let dy = 0;
    if (pad) {
      const [lx = 0, ly = 0, rx = 0, ry = 0] = pad.axes;
      const pressed = (index) => Boolean(pad.buttons[index] && pad.buttons[index].pressed);
      if (ly < -STICK_DEAD || pressed(12)) held.add("W");
      if (ly > STICK_DEAD || pressed(13)) held.add("S");
      if (lx < -STICK_DEAD || pressed(14)) held.add("A");
      if (lx > STICK_DEAD || pressed(15)) held.add("D");
      const pan = (value) => (Math.abs(value) < PAN_DEAD ? 0 : Math.round(value * MAX_PAN * 100) / 100);
      dx = pan(rx);
      dy = pan(ry);
    }
    const before = [...state.held.pad].sort().join();
    if ([...held].sort().join() !== before) {
      state.held.pad = held;
      sendKeys();
    }
    if (dx !== gamepad.camera.dx || dy !== gamepad.camera.dy) {
      gamepad.camera = { dx, dy };
      if (modelTrack("mouse")) sendMouse(dx / MAX_PAN * MOUSE_TURN_LIMIT, -dy / MAX_PAN * MOUSE_TURN_LIMIT);
      else if (!state.camera.dragging) sendCamera(dx, dy);
    }
  }

  // -- the model's own controls: its keys, a captured mouse, a start image ---------------------
  // A model declares its action space in its spec (docs/protocol.md): the keys its keys track takes
  // (Matrix-Game's Temple Run: W S Z C A D, one at a time) and a mouse track for a camera turned by the
  // pointer, captured with pointer lock. An image-to-world model (spec.requires_image) starts from an
  // image, which the page fits to the model's frame size (centre crop, as Matrix-Game's demo does).

  const MOUSE_INTERVAL_MS = 100;
  const MOUSE_SENSITIVITY = 0.004; // turn per video frame per pixel per frame (25 px a frame: 0.1, the reference's key turn)
  const MOUSE_TURN_LIMIT = 1.0; // the mouse schema's bound

  function currentSpec() {
    return state.spec || state.served;
  }

  function modelTrack(track) {
    const spec = currentSpec();
    if (!spec) return track === "keys" || track === "camera"; // before anything is known: the default model's
    return (spec.controls || []).find((control) => control.track === track) || null;
  }

  function modelKeys() {
    const track = modelTrack("keys");
    const held = track && track.json_schema && track.json_schema.properties && track.json_schema.properties.held;
    const keys = held && held.items && held.items.enum ? held.items.enum : MOVE_KEYS;
    return { keys, oneAtATime: Boolean(held && held.maxItems === 1) };
  }

  function takesPrompt() {
    const spec = currentSpec();
    return !spec || spec.takes_prompt !== false; // a spec without the field: a model that takes prompts
  }

  // The hints under the view, the canvas's label and the H help follow the model's controls: its keys,
  // and a captured mouse (click, Esc) or a dragged camera.
  function renderControls() {
    const mouse = Boolean(modelTrack("mouse"));
    const camera = Boolean(modelTrack("camera"));
    const { keys, oneAtATime } = modelKeys();
    const standard = !mouse && keys.join() === MOVE_KEYS.join() && camera;
    const legend = $("controls-legend");
    legend.hidden = Boolean(standard);
    $("default-hint").hidden = !standard;
    canvas.classList.toggle("mouse-look", mouse);
    const arrows = arrowsDo(keys);
    const look = mouse ? "click to capture the mouse, which turns the camera; Esc frees it"
      : camera ? "drag to pan" : "";
    const arrowsSay = arrows === "look" ? ", arrows to look" : arrows ? " or arrows" : "";
    canvas.setAttribute("aria-label", `world view: ${keys.join("/")}${arrowsSay}${look ? `, ${look}` : ""}`);
    renderHelp(keys, oneAtATime, arrows, mouse, camera);
    if (standard) return;
    const keysTrack = modelTrack("keys");
    legend.replaceChildren();
    const line = document.createElement("span");
    line.append("Click the view, then hold ");
    for (const key of keys) line.append(kbdOf(key));
    line.append(oneAtATime ? " (one at a time)" : "");
    line.append(mouse ? "; the mouse turns the camera (the click captures it, Esc frees it)." : ".");
    legend.append(line);
    if (keysTrack && keysTrack.description) {
      const meaning = document.createElement("span");
      meaning.className = "muted";
      meaning.textContent = ` ${keysTrack.description}`;
      legend.append(meaning);
    }
  }

  function kbdOf(key) {
    const kbd = document.createElement("kbd");
    kbd.textContent = key;
    kbd.dataset.key = key;
    return kbd;
  }

  function renderHelp(keys, oneAtATime, arrows, mouse, camera) {
    const row = (what, does) => {
      const tr = document.createElement("tr");
      const left = document.createElement("td");
      const right = document.createElement("td");
      left.append(...what);
      right.textContent = does;
      tr.append(left, right);
      return tr;
    };
    const arrowsSay = arrows === "look" ? " (arrows: I J K L)" : arrows ? " or arrows" : "";
    const does = oneAtATime ? "act (hold; one at a time)" : arrows === "look" ? "move and look (hold)" : "move (hold)";
    const rows = [row([...keys.map(kbdOf), arrowsSay], does)];
    if (mouse) {
      rows.push(row(["click the view"], "capture the mouse: moving it turns the camera"));
      rows.push(row([kbdOf("Esc")], "free the mouse"));
    } else if (camera) {
      rows.push(row(["drag the view"], "pan the camera"));
    }
    $("help-model").replaceChildren(...rows);
    const stick = mouse || camera ? "; right stick: camera" : "";
    $("help-gamepad").lastElementChild.textContent = `left stick or d-pad: move${stick}`;
    $("help-touch").lastElementChild.textContent = `the arrow pad: move${camera ? "; drag the view: pan" : ""}`;
  }

  function captureMouse() {
    if (document.pointerLockElement === canvas || !canvas.requestPointerLock) return;
    const asked = canvas.requestPointerLock();
    if (asked && asked.catch) asked.catch((error) => log(`mouse capture refused: ${error.message}`, "error"));
  }

  function sendMouse(yaw, pitch, at) {
    if (!modelTrack("mouse")) return;
    const clamp = (v) => Math.max(-MOUSE_TURN_LIMIT, Math.min(MOUSE_TURN_LIMIT, Math.round(v * 1000) / 1000));
    const turn = { yaw: clamp(yaw), pitch: clamp(pitch) };
    const last = state.mouse.last;
    if (turn.yaw === last.yaw && turn.pitch === last.pitch) return;
    state.mouse.last = turn;
    sendEvent({ controls: [{ track: "mouse", schema: "worldserve.mouse.v1", data: turn }] }, at);
  }

  document.addEventListener("mousemove", (event) => {
    if (document.pointerLockElement !== canvas) return;
    state.mouse.dx += event.movementX;
    state.mouse.dy += event.movementY;
  });
  document.addEventListener("pointerlockchange", () => {
    const locked = document.pointerLockElement === canvas;
    canvas.classList.toggle("captured", locked);
    if (!locked) sendMouse(0, 0); // freed: stop turning
  });
  setInterval(() => {
    if (document.pointerLockElement !== canvas || !currentSpec()) return;
    const framesPerInterval = (currentSpec().fps * MOUSE_INTERVAL_MS) / 1000;
    // Pixels per frame -> the model's turn per frame; right turns right, up looks up.
    sendMouse(
      (state.mouse.dx / framesPerInterval) * MOUSE_SENSITIVITY,
      (-state.mouse.dy / framesPerInterval) * MOUSE_SENSITIVITY,
    );
    state.mouse.dx = 0;
    state.mouse.dy = 0;
  }, MOUSE_INTERVAL_MS);

  // The served model, known before a world starts: its spec (GET /v1/models, which may need the token),
  // or at least its name (GET /healthz needs none) while the token is missing.
  async function learnServedModel() {
    try {
      const token = tokenValue();
      const reply = await fetch(`${BASE}v1/models`, {
        cache: "no-store", headers: token ? { Authorization: `Bearer ${token}` } : {},
      });
      if (!reply.ok) {
        const health = await fetch(`${BASE}healthz`, { cache: "no-store" });
        const name = health.ok ? (await health.json()).model : null;
        if (name && !state.served && !state.spec) $("model-name").textContent = name;
        return;
      }
      const models = (await reply.json()).data || [];
      state.served = models[0] || null;
    } catch (error) {
      return;
    }
    if (state.served && !state.spec) showModel(state.served);
    const needed = Boolean(state.served && state.served.requires_image);
    $("start-image-row").dataset.required = String(needed);
    $("start-image-label").textContent = needed ? "Start image (this model starts from one)" : "Start image (optional)";
    const slots = referenceSlots();
    $("references-row").hidden = slots.length === 0;
    $("references-label").textContent = `Reference images (optional; one per view, named ${slots.join(", ")})`;
  }

  function referenceSlots() {
    const spec = currentSpec() || state.served;
    return (spec && spec.reference_slots) || [];
  }

  // The chosen files as the model's reference images: each file named after its slot (head.jpg, left.png, ...,
  // as the model's own folder of views), all of the slots or none; each scaled to the slot's square (the
  // server scales any size the same way; scaling here keeps the start message small), as base64 JPEG.
  function chooseReferences(files) {
    state.references = null;
    state.referencesProblem = null;
    const list = Array.from(files || []);
    if (!list.length) return;
    const slots = referenceSlots();
    const spec = currentSpec() || state.served;
    const side = (spec && spec.reference_size) || 0;
    const bySlot = {};
    const unknown = [];
    for (const file of list) {
      const name = file.name.replace(/\.[^.]*$/, "").toLowerCase();
      if (slots.includes(name)) bySlot[name] = file;
      else unknown.push(file.name);
    }
    const missing = slots.filter((slot) => !bySlot[slot]);
    if (unknown.length || missing.length) {
      const parts = [];
      if (missing.length) parts.push(`missing ${missing.join(", ")}`);
      if (unknown.length) parts.push(`${unknown.join(", ")} named after no view`);
      state.referencesProblem = `Reference images are one file per view, named ${slots.join(", ")} (all or none): ${parts.join("; ")}.`;
      notice(state.referencesProblem);
      return;
    }
    state.referencesProblem = "The reference images are still being read: press Start again in a moment.";
    const pick = ++state.referencesPick; // a newer choice wins
    const chosen = {};
    let left = slots.length;
    let failed = false;
    for (const slot of slots) {
      const file = bySlot[slot];
      const url = URL.createObjectURL(file);
      const image = new Image();
      image.onload = () => {
        URL.revokeObjectURL(url);
        if (pick !== state.referencesPick || failed) return;
        const fit = document.createElement("canvas");
        fit.width = side;
        fit.height = side;
        fit.getContext("2d").drawImage(image, 0, 0, side, side);
        chosen[slot] = fit.toDataURL("image/jpeg", 0.95).split(",")[1];
        left -= 1;
        if (left > 0) return;
        state.references = chosen;
        state.referencesProblem = null;
        log(`reference images ${slots.join(", ")} scaled to ${side}×${side}`);
      };
      image.onerror = () => {
        URL.revokeObjectURL(url);
        if (pick !== state.referencesPick) return;
        failed = true;
        state.referencesProblem = `${file.name} is not an image this browser can read: choose PNG or JPEG files.`;
        notice(state.referencesProblem);
      };
      image.src = url;
    }
  }

  // The chosen file, fitted to the model's frame size (centre crop, then scaled), as base64 PNG.
  function chooseStartImage(file) {
    state.startImage = null;
    state.startImageProblem = null;
    if (!file) return;
    state.startImageProblem = `${file.name} is still being read: press Start again in a moment.`;
    const spec = currentSpec();
    const url = URL.createObjectURL(file);
    const image = new Image();
    image.onload = () => {
      const width = spec ? spec.width : image.naturalWidth;
      const height = spec ? spec.height : image.naturalHeight;
      const scale = Math.max(width / image.naturalWidth, height / image.naturalHeight);
      const cropW = width / scale;
      const cropH = height / scale;
      const fit = document.createElement("canvas");
      fit.width = width;
      fit.height = height;
      const g = fit.getContext("2d");
      g.drawImage(image, (image.naturalWidth - cropW) / 2, (image.naturalHeight - cropH) / 2, cropW, cropH, 0, 0, width, height);
      state.startImage = fit.toDataURL("image/png").split(",")[1];
      state.startImageProblem = null;
      URL.revokeObjectURL(url);
      log(`start image ${file.name} fitted to ${width}×${height}`);
    };
    image.onerror = () => {
      URL.revokeObjectURL(url);
      state.startImageProblem = `${file.name} is not an image this browser can read: choose a PNG or JPEG file.`;
      notice(state.startImageProblem);
    };
    image.src = url;
  }

  // A chosen start image that cannot be used (not an image, still being read), or an image-to-world model
  // without one: say so here instead of asking the server (or starting without the file chosen).
  function needsStartImage() {
    if (state.referencesProblem) {
      notice(state.referencesProblem);
      $("references").focus();
      return true;
    }
    if (state.startImageProblem) {
      notice(state.startImageProblem);
      $("start-image").focus();
      return true;
    }
    if (!(state.served && state.served.requires_image) || state.startImage) return false;
    notice(`${state.served.name} starts a world from an image: choose a start image first.`, "info");
    $("start-image").focus();
    return true;
  }

  // -- view tools: fullscreen, figures, help ------------------------------------------------

  function toggleFullscreen() {
    const box = $("screen-box");
    if (document.fullscreenElement) {
      document.exitFullscreen().catch(() => {});
    } else if (box.requestFullscreen) {
      box.requestFullscreen().then(() => canvas.focus()).catch((error) => log(`fullscreen refused: ${error.message}`, "error"));
    }
  }

  function toggleOverlay(show) {
    const overlay = $("overlay");
    overlay.hidden = show === undefined ? !overlay.hidden : !show;
    $("toggle-overlay").setAttribute("aria-pressed", String(!overlay.hidden));
  }

  function toggleHelp(show) {
    const help = $("help");
    help.hidden = show === undefined ? !help.hidden : !show;
    $("toggle-help").setAttribute("aria-pressed", String(!help.hidden));
  }

  $("fullscreen").addEventListener("click", toggleFullscreen);
  $("toggle-overlay").addEventListener("click", () => toggleOverlay());
  $("toggle-help").addEventListener("click", () => toggleHelp());
  $("help").addEventListener("click", () => toggleHelp(false));

  // -- download what you played: the canvas, scaled up, recorded as WebM -----------------------

  const recording = { recorder: null, parts: [], bytes: 0, canvas: null, ctx: null, type: "", session: null };

  function startRecording() {
    if (recording.session === state.sessionId) return; // a resume goes on with the same recording
    stopRecording();
    const MediaRecorderClass = window.MediaRecorder;
    const big = document.createElement("canvas");
    if (!MediaRecorderClass || !big.captureStream) {
      $("download").title = "this browser cannot record the view";
      return;
    }
    const scale = Math.max(1, Math.floor(512 / Math.max(canvas.width, canvas.height)));
    big.width = canvas.width * scale;
    big.height = canvas.height * scale;
    const bigCtx = big.getContext("2d");
    bigCtx.imageSmoothingEnabled = false;
    const type = ["video/webm;codecs=vp9", "video/webm;codecs=vp8", "video/webm"].find(
      (candidate) => MediaRecorderClass.isTypeSupported(candidate),
    );
    if (!type) return;
    const recorder = new MediaRecorderClass(big.captureStream(state.spec ? state.spec.fps : 16), { mimeType: type });
    Object.assign(recording, { recorder, parts: [], bytes: 0, canvas: big, ctx: bigCtx, type, session: state.sessionId });
    recorder.ondataavailable = (event) => {
      if (event.data && event.data.size) {
        recording.parts.push(event.data);
        recording.bytes += event.data.size;
      }
    };
    recorder.start(1000);
    $("download").disabled = false;
  }

  function stopRecording() {
    if (recording.recorder && recording.recorder.state !== "inactive") recording.recorder.stop();
    Object.assign(recording, { recorder: null, parts: [], bytes: 0, session: null });
  }

  function recordFrame() {
    if (recording.ctx) recording.ctx.drawImage(canvas, 0, 0, recording.canvas.width, recording.canvas.height);
  }

  async function download() {
    const recorder = recording.recorder;
    if (!recorder) return;
    if (recorder.state === "recording") { // what has been recorded up to now
      await new Promise((resolve) => {
        recorder.addEventListener("dataavailable", resolve, { once: true });
        recorder.requestData();
      });
    }
    const blob = new Blob(recording.parts, { type: recording.type.split(";")[0] });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `worldserve-${(state.sessionId || recording.session || "world").slice(0, 8)}.webm`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 60000);
    log(`saved what you played (${Math.round(blob.size / 1024)} KiB WebM)`);
  }
  $("download").addEventListener("click", download);

  // -- the form -------------------------------------------------------------------------------

  $("start-form").addEventListener("submit", (event) => {
    event.preventDefault();
    stopReconnecting();
    notice("");
    if (state.join) {
      connect("join");
    } else if (!needsStartImage()) {
      state.started = null; // this press's prompt and seed
      connect("start");
    }
  });
  $("forget-join").addEventListener("click", (event) => {
    event.preventDefault();
    state.join = null;
    history.replaceState(null, "", location.pathname);
    setStatus(state.status, $("status").textContent);
  });
  for (const role of ["viewer", "controller"]) {
    $(`copy-${role}`).addEventListener("click", () => copyLink(role));
  }
  $("share-token").addEventListener("change", () => showShare(state.share));
  $("token").addEventListener("input", () => showShare(state.share));
  $("token").addEventListener("change", () => { if (!state.served) learnServedModel(); }); // a token server's spec
  $("start-image").addEventListener("change", (event) => chooseStartImage(event.target.files[0]));
  $("references").addEventListener("change", (event) => chooseReferences(event.target.files));
  $("apply-prompt").addEventListener("click", (event) => {
    const prompt = $("prompt").value.trim();
    if (prompt && takesPrompt()) sendEvent({ prompt }, event.timeStamp);
    canvas.focus();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && state.status === "live" && state.role !== "viewer") {
      event.preventDefault();
      $("apply-prompt").click();
    }
  });
  $("reset").addEventListener("click", () => {
    resetWorld();
    canvas.focus();
  });
  $("close").addEventListener("click", () => {
    stopReconnecting();
    closeWorld();
  });
  $("leave-shared").addEventListener("click", () => { // leaves our membership only (the host's world goes on)
    stopReconnecting();
    if (rtc.pc) { // a WHEP viewer: its peer and its WHEP resource go
      whepLeave();
      leaveWorld();
      setStatus("idle", "left");
      notice("You left the shared world. Choose a seed (and a start image) and press Start for a world of your own.", "info");
      return;
    }
    if (!closeWorld()) { // no connection now (e.g. reconnecting): let the world go here
      closeSocket();
      leaveWorld();
      setStatus("idle", "left");
    }
    notice("You left the shared world. Choose a seed (and a start image) and press Start for a world of your own.", "info");
  });

  setStatus("idle", "not connected");
  requestAnimationFrame(play);

  // A reload keeps this tab's world: on the way out the page closes its socket with a code of
  // its own (4001, not a clean 1000/1001), so the server parks our place for its resume grace
  // instead of ending the world, and notes where it was; the new page resumes from there. A
  // closed tab leaves the world parked the same way until the grace ends (a parked world is
  // the first a full server evicts).
  const KEPT = "worldserve.world";
  window.addEventListener("pagehide", () => {
    if (!state.sessionId || !state.resumeToken || !live()) return;
    try {
      sessionStorage.setItem(KEPT, JSON.stringify({
        sessionId: state.sessionId, resumeToken: state.resumeToken, resumeGraceS: state.resumeGraceS,
        lastSeq: state.lastSeq, epoch: state.epoch, started: state.started, share: state.share,
        token: tokenValue(), at: Date.now(),
      }));
    } catch (error) {
      return; // no storage here: the close below is then a clean one, as before
    }
    closeSocket(4001, "page reloading");
  });
  let kept = null;
  try {
    kept = JSON.parse(sessionStorage.getItem(KEPT) || "null");
    sessionStorage.removeItem(KEPT);
  } catch (error) {
    kept = null;
  }

  // A share link opens that world at once: ?join=SESSION&token=TOKEN&role=viewer|controller, and the
  // server's token (if the host put it in) in the fragment: #auth=TOKEN.
  const params = new URLSearchParams(location.search);
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.get("auth")) {
    $("token").value = fragment.get("auth");
    history.replaceState(null, "", location.pathname + location.search); // not left in the address bar
  }
  learnServedModel(); // with the link's token, if it brought one
  if (kept && Date.now() - kept.at < (kept.resumeGraceS || 30) * 1000) {
    if (kept.token && !tokenValue()) $("token").value = kept.token;
    Object.assign(state, {
      sessionId: kept.sessionId, resumeToken: kept.resumeToken, resumeGraceS: kept.resumeGraceS,
      lastSeq: kept.lastSeq, epoch: kept.epoch || 0, started: kept.started, share: kept.share, reloaded: true,
    });
    beginReconnect("resume");
  } else if (params.get("join") && params.get("token")) {
    const role = params.get("role") === "controller" ? "controller" : "viewer";
    state.join = { session: params.get("join"), token: params.get("token"), role };
    // A viewer may watch over WebRTC (?transport=webrtc, where the browser has it); controllers steer over the socket.
    if (role === "viewer" && params.get("transport") === "webrtc" && window.RTCPeerConnection) whepWatch(state.join);
    else connect("join");
  }
  window.addEventListener("pagehide", () => whepLeave());
})();
