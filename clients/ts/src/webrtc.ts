// WebRTCWorldClient: the same client over WebRTC (POST /v1/webrtc), in a browser. The session's messages travel
// on a data channel, exactly as on the socket, so every verb of WorldClient works unchanged; the frames come on a
// video track (`stream`, for a <video>), and `chunk.track {seq, frame, rtp}` names the RTP timestamp of each
// chunk's first frame on it. A chunk is handed over (nextChunk) as its header comes, with no payloads: its frames
// are the track's. `show(video)` plays the track and acks each chunk as its first frame is shown
// (requestVideoFrameCallback's rtpTimestamp), as a player does; `chunkOf(rtp)` tells any shown frame's chunk.
import { WorldClient, WorldClientError, toChunk, type ChunkHeader, type ClientOptions, type SocketLike } from "./client.js";

/** The `/v1/webrtc` endpoint of the front-end whose `/v1/world` URL is `worldUrl`. */
export function webrtcUrl(worldUrl: string): string {
  return worldUrl.replace(/^ws/, "http").replace(/\/v1\/world$/, "/v1/webrtc");
}

/** WHEP's signalling: the offer (not trickled: it waits for every candidate, 3 s at most) POSTed to `url` with
 * the bearer token, and the answer set. A peer connection made without ICE servers first takes those the endpoint
 * tells (iceServersOf: its STUN and TURN servers, for a real network). Returns the peer's resource (Location:
 * DELETE it to leave), or null. A refusal throws WorldClientError with its HTTP status and the server's message. */
export async function signal(pc: RTCPeerConnection, url: string, token?: string | null): Promise<string | null> {
  if (!pc.getConfiguration().iceServers?.length) {
    const told = await iceServersOf(url, token);
    if (told.length) pc.setConfiguration({ ...pc.getConfiguration(), iceServers: told });
  }
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise<void>((resolve) => {
    if (pc.iceGatheringState === "complete") resolve();
    pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") resolve(); };
    setTimeout(resolve, 3000);
  });
  const headers: Record<string, string> = { "Content-Type": "application/sdp" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const reply = await fetch(url, { method: "POST", headers, body: pc.localDescription?.sdp ?? "" });
  if (reply.status !== 201) {
    const text = await reply.text();
    let said = text;
    try {
      said = (JSON.parse(text) as { error: { message: string } }).error.message;
    } catch {
      // not the server's JSON error: its text as it is
    }
    throw new WorldClientError(`HTTP ${reply.status}: ${said}`);
  }
  const location = reply.headers.get("Location");
  const base = new URL(url, globalThis.location?.href);
  await pc.setRemoteDescription({ type: "answer", sdp: await reply.text() });
  return location ? new URL(location, base).href : null;
}

/** The ICE servers in a WHIP/WHEP endpoint's `Link` headers (RFC 9725, 4.6: `<URL>; rel="ice-server"`, a TURN
 * server's `username` and `credential` as quoted strings), as RTCIceServer; links of other relations are left. */
export function parseIceLinks(header: string | null): RTCIceServer[] {
  const found: RTCIceServer[] = [];
  // link-values, comma-separated; a comma inside <...> or a quoted string is not a separator
  const values = header?.match(/<[^>]*>(?:\s*;\s*[\w-]+\s*=\s*(?:"(?:[^"\\]|\\.)*"|[^;,]*))*/g) ?? [];
  for (const value of values) {
    const url = value.slice(1, value.indexOf(">"));
    const params = new Map<string, string>();
    for (const [, name, quoted, bare] of value.matchAll(/;\s*([\w-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;,]*))/g)) {
      params.set(name.toLowerCase(), quoted !== undefined ? quoted.replace(/\\(.)/g, "$1") : bare.trim());
    }
    if (params.get("rel") !== "ice-server") continue;
    const server: RTCIceServer = { urls: url };
    if (params.has("username")) server.username = params.get("username");
    if (params.has("credential")) server.credential = params.get("credential");
    found.push(server);
  }
  return found;
}

/** The ICE servers the endpoint at `url` tells (an OPTIONS before the offer, as WHEP clients ask; a WHEP viewer
 * sends its share token): none when it tells none, or cannot be asked. */
export async function iceServersOf(url: string, token?: string | null): Promise<RTCIceServer[]> {
  try {
    const reply = await fetch(url, { method: "OPTIONS", headers: token ? { Authorization: `Bearer ${token}` } : {} });
    return reply.ok ? parseIceLinks(reply.headers.get("Link")) : [];
  } catch {
    return [];
  }
}

/** RTP timestamps this close are one frame's (a decoder may give one back a tick off). */
const SAME_TICKS = 90;
/** Marks kept behind the newest: a frame shown this late has no chunk to ack any more. */
const MARKS_KEPT = 32;

/** Which chunk each frame on the track is: `chunk.track {seq, rtp}` names the RTP timestamp of a chunk's first
 * frame, and every frame from there up to the next chunk's is that chunk's. */
export class TrackMarks {
  private readonly told = new Map<number, number>(); // seq -> the RTP timestamp of its first frame

  /** Chunk `seq`'s first frame on the track has this RTP timestamp. */
  tell(seq: number, rtp: number): void {
    this.told.set(seq, rtp >>> 0);
    for (const old of this.told.keys()) if (old < seq - MARKS_KEPT) this.told.delete(old);
  }

  /** The chunk (seq) of the frame with this RTP timestamp: the latest chunk whose first frame is at or before it
   * (wrapping at 2^32); null before any mark. */
  chunkOf(rtpTimestamp: number): number | null {
    let found: number | null = null;
    let behind = 0;
    for (const [seq, first] of this.told) {
      const since = ((rtpTimestamp >>> 0) - first + SAME_TICKS) >>> 0;
      if (since < 2 ** 31 && (found === null || since < behind)) [found, behind] = [seq, since];
    }
    return found;
  }

  /** Whether the chunk of the frame with this RTP timestamp is sure: a mark at or after it is told (marks come in
   * the order of their frames, so no later one can name a chunk that starts at or before this frame). */
  settled(rtpTimestamp: number): boolean {
    for (const first of this.told.values()) {
      if (((first - (rtpTimestamp >>> 0) + SAME_TICKS) >>> 0) < 2 ** 31) return true;
    }
    return false;
  }

  /** The RTP timestamp of chunk `seq`'s first frame, if told and still kept. */
  get(seq: number): number | undefined {
    return this.told.get(seq);
  }

  clear(): void {
    this.told.clear();
  }
}

/** A frame shown whose chunk could still be a later one waits this long for a mark at or after it: `chunk.track`
 * comes on the data channel, the frame on the video track, and a frame can be shown before the mark of its chunk is
 * in (on a loaded box, seen more than 250 ms before). A chunk's first frame is sure as its own mark comes; the
 * frames after it, as the next chunk's comes (a chunk later): only a stream that stops waits this long. */
export const HOLD_MS = 1000;

/** A shown frame's chunk (null: no mark yet), its RTP timestamp and when it was shown. */
export type FrameLabelled = (seq: number | null, rtpTimestamp: number, at: number) => void;

/** Frames shown, each told its chunk once that is sure (TrackMarks.settled) or once it has waited HOLD_MS, in the
 * order they were shown. Call `settle()` when a mark is told. */
export class FrameLabels {
  private readonly held: { rtp: number; at: number; since: number; then: FrameLabelled }[] = [];
  private timer: ReturnType<typeof setTimeout> | null = null;
  /** Frames told the chunk known when their hold ran out, not a sure one (the stream stopped, or a mark was late). */
  guessed = 0;

  constructor(
    readonly marks: TrackMarks,
    private readonly holdMs = HOLD_MS,
    private readonly clock: () => number = () => performance.now(),
  ) {}

  /** A frame with this RTP timestamp was shown at `at`: `then` hears its chunk, now or once sure. */
  shown(rtpTimestamp: number, at: number, then: FrameLabelled): void {
    this.held.push({ rtp: rtpTimestamp >>> 0, at, since: this.clock(), then });
    this.settle();
  }

  /** Tell every frame whose chunk is now sure, or that has waited long enough, in order. */
  settle(): void {
    const now = this.clock();
    while (this.held.length) {
      const frame = this.held[0];
      const sure = this.marks.settled(frame.rtp);
      if (!sure && now - frame.since < this.holdMs) break;
      if (!sure) this.guessed += 1;
      this.held.shift();
      frame.then(this.marks.chunkOf(frame.rtp), frame.rtp, frame.at);
    }
    if (this.held.length && this.timer === null) {
      this.timer = setTimeout(() => {
        this.timer = null;
        this.settle();
      }, Math.max(0, this.holdMs - (now - this.held[0].since)) + 1);
    }
  }

  /** How many frames wait for their chunk. */
  get waiting(): number {
    return this.held.length;
  }

  /** Forget the frames held (a new connection: its track starts anew). */
  clear(): void {
    this.held.length = 0;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
  }
}

/** A peer connection's video link, from getStats(). */
export interface LinkStats {
  rttMs: number | null; // the nominated candidate pair's current round trip
  packetsLost: number;
  packetsReceived: number;
  lossPercent: number; // lost of all sent, one decimal
  framesDecoded: number;
  codec: string | null; // the inbound video's mime type
  jitterBufferMs: number | null; // the receiver's jitter buffer: its mean wait per frame so far
  freezes: number; // the receiver's video freezes so far (its underruns)
}

/** The figures a player shows of its WebRTC link: round trip, packets lost, frames decoded, codec, and its
 * receiver's jitter buffer (the browser's own: a WebRTC player has no other). */
export async function linkStats(pc: RTCPeerConnection): Promise<LinkStats> {
  const report = await pc.getStats();
  const found: LinkStats = {
    rttMs: null, packetsLost: 0, packetsReceived: 0, lossPercent: 0, framesDecoded: 0, codec: null, jitterBufferMs: null, freezes: 0,
  };
  const codecs = new Map<string, string>();
  report.forEach((item: { type: string; id: string; mimeType?: string }) => {
    if (item.type === "codec" && item.mimeType) codecs.set(item.id, item.mimeType);
  });
  report.forEach((item: Record<string, unknown>) => {
    if (item.type === "inbound-rtp" && item.kind === "video") {
      found.packetsLost = Number(item.packetsLost ?? 0);
      found.packetsReceived = Number(item.packetsReceived ?? 0);
      found.framesDecoded = Number(item.framesDecoded ?? 0);
      found.codec = codecs.get(String(item.codecId)) ?? null;
      found.freezes = Number(item.freezeCount ?? 0);
      const emitted = Number(item.jitterBufferEmittedCount ?? 0);
      if (emitted > 0) found.jitterBufferMs = Math.round((Number(item.jitterBufferDelay ?? 0) / emitted) * 1000);
    } else if (item.type === "candidate-pair" && item.nominated && item.currentRoundTripTime !== undefined) {
      found.rttMs = Math.round(Number(item.currentRoundTripTime) * 1000);
    }
  });
  const sent = found.packetsLost + found.packetsReceived;
  found.lossPercent = sent ? Math.round((found.packetsLost / sent) * 1000) / 10 : 0;
  return found;
}

const OPEN = 1;
const CLOSED = 3;
export class WebRTCWorldClient extends WorldClient {
  /** The world's frames: the video track, once the peer connection is up. */
  stream: MediaStream | null = null;
  private pc: RTCPeerConnection | null = null;
  private resource: string | null = null;
  /** Each recent chunk's first frame on the track, as the server told it (chunk.track). */
  readonly marks = new TrackMarks();
  /** This connection's merge of the server's two channels (its `taken`: messages read from the server's copies). */
  merge: ChannelMerge | null = null;
  /** Frames shown, waiting to be told their chunk (`frameShown`). */
  readonly labels = new FrameLabels(this.marks);
  private readonly shownSeqs = new Set<number>();

  constructor(url: string, options: ClientOptions = {}) {
    super(url, { autoAck: false, ...options });
  }

  protected override async open(): Promise<SocketLike> {
    const pc = new RTCPeerConnection();
    const channel = pc.createDataChannel("worldserve");
    // Copies of the short messages (inputs, acks), unordered and never resent: a lost packet on the main channel
    // does not hold them for its retransmission (FAST_LABEL, docs/protocol.md "WebRTC").
    const fast = pc.createDataChannel(FAST_LABEL, { ordered: false, maxRetransmits: 0 });
    pc.addTransceiver("video", { direction: "recvonly" });
    const track = new Promise<MediaStream>((resolve) => {
      pc.ontrack = (event) => resolve(event.streams[0] ?? new MediaStream([event.track]));
    });
    const opened = new Promise<void>((resolve, reject) => {
      channel.onopen = () => resolve();
      channel.onerror = () => reject(new WorldClientError("the data channel failed before it opened."));
    });
    try {
      this.resource = await signal(pc, webrtcUrl(this.url), this.options.token);
      await opened;
      this.stream = await track;
    } catch (error) {
      pc.close();
      throw error instanceof WorldClientError ? error : new WorldClientError(`cannot connect over WebRTC: ${String(error)}`);
    }
    this.pc = pc;
    this.marks.clear();
    this.labels.clear();
    this.merge = new ChannelMerge();
    return channelSocket(channel, fast, pc, () => this.leave(), this.merge);
  }

  protected override receive(data: unknown): void {
    if (typeof data === "string" && data.startsWith('{"type":"chunk')) {
      const message = JSON.parse(data) as { type: string; seq: number; rtp?: number };
      if (message.type === "chunk.track") {
        this.marks.tell(message.seq, message.rtp ?? 0);
        this.labels.settle();
        return;
      }
      if (message.type === "chunk") { // its frames are the track's: handed over as its header comes
        this.deliver(toChunk(message as unknown as ChunkHeader, []));
        return;
      }
    }
    super.receive(data);
  }

  /** The chunk (seq) of a frame on the track, by its RTP timestamp (TrackMarks.chunkOf), as far as told now. */
  chunkOf(rtpTimestamp: number): number | null {
    return this.marks.chunkOf(rtpTimestamp);
  }

  /** A frame with this RTP timestamp was shown at `at`: `then` hears its chunk once that is sure (FrameLabels), in
   * the order frames were shown. */
  frameShown(rtpTimestamp: number, at: number, then: FrameLabelled): void {
    this.labels.shown(rtpTimestamp, at, then);
  }

  /** The peer connection's figures now (linkStats); null before it is up. */
  async stats(): Promise<LinkStats | null> {
    return this.pc ? linkStats(this.pc) : null;
  }

  /** Play the track in `video` and ack each chunk as its first frame is shown; `onFrame` hears every frame
   * shown with its chunk (once that is sure: `frameShown`). */
  show(video: HTMLVideoElement, onFrame?: (seq: number | null, rtpTimestamp: number) => void): void {
    video.muted = true;
    video.playsInline = true;
    video.srcObject = this.stream;
    void video.play().catch(() => undefined);
    const labelled = (seq: number | null, rtp: number) => {
      if (seq !== null && !this.shownSeqs.has(seq)) {
        this.shownSeqs.add(seq);
        for (const old of this.shownSeqs) if (old < seq - 32) this.shownSeqs.delete(old);
        this.ack(seq);
      }
      onFrame?.(seq, rtp);
    };
    const shown = (now: number, meta: VideoFrameCallbackMetadata) => {
      const at = meta.expectedDisplayTime || now; // when it is on screen
      if (meta.rtpTimestamp !== undefined) this.frameShown(meta.rtpTimestamp, at, labelled);
      if (this.pc) video.requestVideoFrameCallback(shown);
    };
    video.requestVideoFrameCallback(shown);
  }

  /** Lose the peer connection as a network would (no DELETE): the server parks the session for `resume()`. A
   * `code` of 1000 or 1001 leaves cleanly instead (DELETE: the server ends the session as on a socket's clean close). */
  override drop(code?: number, reason?: string): void {
    if (code !== 1000 && code !== 1001) this.resource = null;
    super.drop(code, reason); // its socket's close is leave(): the DELETE, if still due, and the peer closed
    this.leave();
  }

  /** Leave cleanly: DELETE the peer's resource (the server closes the session as on a socket's clean close). */
  private leave(): void {
    const resource = this.resource;
    this.resource = null;
    if (resource) void fetch(resource, { method: "DELETE", keepalive: true }).catch(() => undefined);
    this.pc?.close();
    this.pc = null;
    this.labels.clear();
  }
}

/** A message longer than this goes in pieces of this size (a peer takes 64 KiB at least; Chromium 256 KiB). */
export const PIECE_BYTES = 64 * 1024;
/** The label of the second data channel: unordered, never resent, copies of the main channel's short messages. */
export const FAST_LABEL = "worldserve.fast";
/** A message this long at most is also sent on the fast channel (inputs, acks, resets: not a start's images). */
export const FAST_COPY_CHARS = 1024;
/** Copies that came ahead of a gap wait, this many at most (the farthest beyond goes: its main copy comes). */
export const FAST_HELD = 32;
/** A copy longer than this (characters) is not read: no side sends long messages twice. */
export const FAST_MAX_CHARS = 16 * 1024;

/** One receiver's merge of the main channel and its fast channel into the main channel's stream, in order: a copy
 * ("<index>:<message>") is read once every message before its index was read (from either channel), and a main
 * message already read from its copy is passed over (docs/protocol.md, "The fast channel"). */
export class ChannelMerge<T = unknown> {
  private mainCount = 0; // messages come on the main channel so far
  private nextIndex = 0; // every message of the merged stream before this index was read
  private readonly ahead = new Map<number, string>(); // copies that came ahead of a gap, by index
  /** Messages read from their copy (the main channel's was passed over). */
  taken = 0;
  /** Copies not used: late (the main channel's came first), twice, malformed, or too many ahead of a gap. */
  unused = 0;

  /** Copies waiting for a gap before them to close. */
  get held(): number {
    return this.ahead.size;
  }

  /** The main channel's next message came: what is read now, in order: none (it was read from its copy), or this
   * message first, then the copies that waited for it. */
  main(message: T): (T | string)[] {
    const index = this.mainCount++;
    if (index < this.nextIndex) return [];
    this.nextIndex = index + 1;
    if (this.ahead.delete(index)) this.unused += 1;
    return [message, ...this.takeAhead()];
  }

  /** A copy came on the fast channel: what is read now, in order (none: it waits for a gap, or is not used). */
  copy(raw: unknown): string[] {
    const colon = typeof raw === "string" ? raw.indexOf(":") : -1;
    const indexText = colon > 0 ? (raw as string).slice(0, colon) : "";
    const text = colon > 0 ? (raw as string).slice(colon + 1) : "";
    if (!/^[0-9]+$/.test(indexText) || text.length > FAST_MAX_CHARS) {
      this.unused += 1;
      return [];
    }
    const index = Number(indexText);
    if (index < this.nextIndex || this.ahead.has(index)) {
      this.unused += 1; // its main copy came first (or this copy twice)
      return [];
    }
    this.ahead.set(index, text);
    while (this.ahead.size > FAST_HELD) { // the farthest goes; its main copy will come
      this.ahead.delete(Math.max(...this.ahead.keys()));
      this.unused += 1;
    }
    return this.takeAhead();
  }

  private takeAhead(): string[] {
    const read: string[] = [];
    for (let text = this.ahead.get(this.nextIndex); text !== undefined; text = this.ahead.get(this.nextIndex)) {
      this.ahead.delete(this.nextIndex);
      this.nextIndex += 1;
      this.taken += 1;
      read.push(text);
    }
    return read;
  }
}

/** Send one protocol message on a data channel: as one text message, or, longer than PIECE_BYTES (a start with
 * its images), as its UTF-8 bytes in binary pieces and then an empty text message that ends it, which the server
 * joins into the one message (docs/protocol.md, "WebRTC"). Returns the data channel messages it took. */
export function sendOnChannel(channel: Pick<RTCDataChannel, "send">, text: string): number {
  if (text.length * 3 <= PIECE_BYTES) {
    channel.send(text); // short enough however it encodes
    return 1;
  }
  const bytes = new TextEncoder().encode(text);
  if (bytes.length <= PIECE_BYTES) {
    channel.send(text);
    return 1;
  }
  for (let start = 0; start < bytes.length; start += PIECE_BYTES) channel.send(bytes.slice(start, start + PIECE_BYTES));
  channel.send("");
  return Math.ceil(bytes.length / PIECE_BYTES) + 1; // the pieces and the empty text that ends them
}

/** The data channel as the client's socket. A short message goes first as a copy on the fast channel, prefixed
 * with its index among the main channel's messages (`"17:{...}"`): the server reads whichever copy comes first,
 * in its place, once. The server sends the same way, and `merge` gives the socket's reader the main channel's
 * stream, in order, once, whichever copies came first. */
export function channelSocket(
  channel: RTCDataChannel,
  fast: RTCDataChannel,
  pc: RTCPeerConnection,
  leave: () => void,
  merge: ChannelMerge = new ChannelMerge(),
): SocketLike {
  let sent = 0; // data channel messages sent on the main channel so far
  const socket: SocketLike = {
    binaryType: "arraybuffer",
    get readyState() { return channel.readyState === "open" ? OPEN : CLOSED; },
    send: (data: string) => {
      if (fast.readyState === "open" && data.length <= FAST_COPY_CHARS) {
        try {
          fast.send(`${sent}:${data}`);
        } catch {
          // a copy that cannot go: the main channel's message is the one that counts
        }
      }
      sent += sendOnChannel(channel, data);
    },
    close: () => leave(),
    onopen: null,
    onclose: null,
    onerror: null,
    onmessage: null,
  };
  const read = (messages: unknown[]) => {
    for (const data of messages) socket.onmessage?.({ data });
  };
  channel.onmessage = (event) => read(merge.main(event.data));
  fast.onmessage = (event) => read(merge.copy(event.data));
  channel.onclose = () => socket.onclose?.({});
  pc.onconnectionstatechange = () => { // a failed peer is a dropped socket (1006), whether or not its channel says so
    if (pc.connectionState === "failed") {
      socket.onerror?.({});
      socket.onclose?.({ code: 1006 });
    }
  };
  return socket;
}
