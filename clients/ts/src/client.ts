// WorldClient: worldserve's session protocol (WS /v1/world, docs/protocol.md) for a web page or Node.
//
// Owns: the connection, requests and their replies (matched by `id`), the chunk stream (a `chunk`
// header, then one binary message per frame, or one fMP4 fragment for H.264), acks, and the notices
// a session hears (input.dropped, chunk.skipped, session.queued). Frames are handed over as the bytes
// that came (raw RGB, JPEG, or an H.264 fragment): whole chunks by `nextChunk`, or, to a player that
// `listen`s, each message as it comes. `decodeFrame` turns a JPEG or raw frame into a picture where the
// platform has one (a browser). Must not know: pages, canvases, players.

import type { ClientMessages, ServerMessages } from "./messages.js";

export type ServerMessage = ServerMessages.ServerMessage;
export type ClientMessage = ClientMessages.ClientMessage;
export type SessionStarted = ServerMessages.SessionStarted;
export type SessionJoined = ServerMessages.SessionJoined;
export type SessionResumed = ServerMessages.SessionResumed;
export type SessionQueued = ServerMessages.SessionQueued;
export type InputAccepted = ServerMessages.InputAccepted;
export type InputDropped = ServerMessages.InputDropped;
export type ChunkSkipped = ServerMessages.ChunkSkipped;
export type ChunkHeader = ServerMessages.ChunkMessage;
/** Frames of a chunk still being made (`parts: true` at start): its binary messages follow, as a chunk's do. */
export type ChunkPartHeader = ServerMessages.ChunkPartMessage;
export type Media = "raw" | "jpeg" | "h264";

/** One control of an input event: a track, its schema and its data (docs/protocol.md, "Controls"). */
export interface ControlInput {
  track: string;
  schema: string;
  data: Record<string, unknown>;
}

/** The movement keys held now (held-key state: it lasts until the next keys event). */
export function keys(...held: string[]): ControlInput {
  return { track: "keys", schema: "worldserve.keys.v1", data: { held } };
}

/** A camera pan velocity, px per frame (it lasts until the next camera event). */
export function camera(dx: number, dy: number): ControlInput {
  return { track: "camera", schema: "worldserve.camera.v1", data: { dx, dy } };
}

/** An `error` message from the server, or a `session.failed` (`failed`: the session takes only reset or close
 * now): `code` is stable (docs/protocol.md, "Errors"), `detail` the server's own words. */
export class WorldError extends Error {
  constructor(
    readonly code: string,
    readonly detail: string,
    readonly eventId?: number | null,
    readonly retryAfterMs?: number | null,
    readonly failed = false,
  ) {
    super(`${code}: ${detail}`);
    this.name = "WorldError";
  }
}

/** The connection or the protocol broke (not a server-reported error). */
export class WorldClientError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WorldClientError";
  }
}

/** One chunk as it came: its header and its frames' bytes (one per frame; H.264: one fragment). */
export interface Chunk {
  seq: number;
  epoch: number;
  chunkIndex: number;
  appliedEventIds: number[];
  media: Media;
  width: number;
  height: number;
  /** The chunk this one replaces (a preemption): drop what is left of it and play this instead. */
  supersedes: number | null;
  payloads: Uint8Array[];
  header: ChunkHeader;
}

/** What the client knows of its session: the server's reply to start, join or resume. */
export interface SessionInfo {
  sessionId: string;
  role: "host" | "viewer" | "controller";
  media: Media;
  model: Record<string, unknown>;
  resumeToken: string | null;
  viewerToken: string | null;
  controllerToken: string | null;
  leadChunks: number;
  /** The server's reply as it came: `session.started`, `session.joined` or (the last) `session.resumed`. */
  reply: SessionStarted | SessionJoined | SessionResumed;
}

export interface ResumeOptions {
  /** The stream must start again at a keyframe (a player that lost its H.264 decoder, e.g. a reloaded page). */
  keyframe?: boolean;
}

export interface StartOptions {
  prompt?: string;
  seed?: number;
  media?: Media;
  quality?: number;
  /** Base64 PNG, JPEG or raw RGB of the model's frame size. */
  image?: string;
  /** A model's reference images by slot name (its spec's `reference_slots`), base64: all or none. */
  references?: Record<string, string>;
  shareViewers?: boolean;
  shareControllers?: boolean;
  /** When the server is full, wait in line (each `session.queued` goes to `onQueued`). */
  queue?: boolean;
  onQueued?: (queued: SessionQueued) => void;
  /** JPEG and raw: take each chunk's frames in parts as the model makes them (`chunk.part`, ahead of the chunk;
   * a model whose spec says `frame_parts`). A listener hears each part's header and frames; `nextChunk` still
   * hands over whole chunks. */
  parts?: boolean;
}

export interface EventOptions {
  prompt?: string;
  controls?: ControlInput[];
  /** The event's id (default: the next of this client's). */
  eventId?: number;
}

/** The WebSocket the client speaks through: the browser's, or `ws`'s in Node. */
export interface SocketLike {
  binaryType: string;
  readyState: number;
  send(data: string): void;
  close(code?: number, reason?: string): void;
  onopen: ((event: unknown) => void) | null;
  onclose: ((event: unknown) => void) | null;
  onerror: ((event: unknown) => void) | null;
  onmessage: ((event: { data: unknown }) => void) | null;
}

export type SocketFactory = (url: string, protocols?: string[]) => SocketLike;

/** What a player hears of its session as it happens (`listen`), beside the replies its verbs resolve with. */
export interface SessionListener {
  /** A connection is open: after `connect()`, and after each move to the front-end where a world lives. */
  opened?(): void;
  /** A message the server sent unasked: a chunk's header (its frames follow), `session.reset`, `input.dropped`,
   * `chunk.skipped`, `session.queued`, `session.closed`, `session.failed`, an `error` that answers no request. */
  message?(message: ServerMessage): void;
  /** One binary message of the chunk (or chunk part) whose header came last (a frame; H.264: the chunk's fragment),
   * as it comes; `index` counts from the header's first binary message. */
  frame?(payload: ArrayBuffer, header: ChunkHeader | ChunkPartHeader, index: number): void;
  /** The connection ended, not by this client's own `drop` or a move: the WebSocket's close code (1006: none
   * came, as when the network or the handshake failed). */
  closed?(code: number): void;
}

export interface ClientOptions {
  /** A server started with --token: sent as the `bearer.<token>` subprotocol, as the page does. */
  token?: string;
  /** How to open a socket (default: the global WebSocket). In Node 20: `(url, p) => new WebSocket(url, p)` of `ws`. */
  socket?: SocketFactory;
  /** Acknowledge each chunk as it is handed over (a player acks as its first frame shows instead). */
  autoAck?: boolean;
  replyTimeoutMs?: number;
}

type Waiter<T> = { resolve: (value: T) => void; reject: (error: Error) => void };

const OPEN = 1;
const MAX_MOVES = 3;
/** The subprotocol the server answers with (a browser refuses a socket whose offered protocols get none back). */
export const PROTOCOL = "worldserve.v1";

export class WorldClient {
  session: SessionInfo | null = null;
  /** The last chunk seq received (for resume). */
  lastSeq = -1;
  readonly dropped: InputDropped[] = [];
  readonly skipped: ChunkSkipped[] = [];
  readonly queued: SessionQueued[] = [];
  protected socket: SocketLike | null = null;
  private nextId = 1;
  private nextEventId = 1;
  private epoch = 0;
  private readonly replies = new Map<string, Waiter<ServerMessage>>();
  private readonly ready: (Chunk | Error)[] = [];
  private readonly takers: Waiter<Chunk>[] = [];
  private partial: { header: ChunkHeader | ChunkPartHeader; payloads: Uint8Array[] } | null = null;
  /** Parts of chunks not come yet, by seq: their payloads in order (`parts: true`, without a listener). */
  private readonly parts = new Map<number, Uint8Array[]>();
  private onQueued: ((queued: SessionQueued) => void) | null = null;
  private closed: Error | null = null;
  private listener: SessionListener | null = null;

  constructor(
    /** Where the socket goes; a resume or join told `session.moved` goes on to the world's front-end and keeps its URL. */
    public url: string,
    protected readonly options: ClientOptions = {},
  ) {}

  /** Open the socket, offering the `worldserve.v1` subprotocol (a token travels as `bearer.<token>` beside it). */
  async connect(): Promise<void> {
    this.closed = null;
    this.ready.length = 0;
    const socket = await this.open();
    let ended = false;
    socket.onmessage = (event) => this.receive(event.data);
    socket.onclose = (event) => {
      this.lost(new WorldClientError("connection closed."));
      if (ended) return;
      ended = true;
      const code = (event as { code?: number } | null)?.code;
      this.listener?.closed?.(typeof code === "number" && code > 0 ? code : 1006);
    };
    socket.onerror = () => this.lost(new WorldClientError("connection failed."));
    this.socket = socket;
    this.listener?.opened?.();
  }

  /** Hear the session as it happens (a player): each unasked message, each frame as it comes, the connection's
   * end. Chunks then go to the listener only: `nextChunk` and `chunks` have none to give. */
  listen(listener: SessionListener | null): void {
    this.listener = listener;
  }

  /** Whether the connection is open now (a verb sent now reaches the server). */
  get connected(): boolean {
    return this.socket !== null && this.socket.readyState === OPEN;
  }

  /** A new socket to the server, open (a WebRTC client opens a data channel instead). */
  protected async open(): Promise<SocketLike> {
    const protocols = [PROTOCOL, ...(this.options.token ? [`bearer.${this.options.token}`] : [])];
    const open = this.options.socket ?? ((url: string, p?: string[]) => new WebSocket(url, p) as unknown as SocketLike);
    const socket = open(this.url, protocols);
    socket.binaryType = "arraybuffer";
    await new Promise<void>((resolve, reject) => {
      socket.onopen = () => resolve();
      socket.onerror = () => reject(new WorldClientError(`could not connect to ${this.url}`));
      socket.onclose = () => reject(new WorldClientError(`${this.url} closed before it opened`));
    });
    return socket;
  }

  /** Start this connection's session. */
  async start(options: StartOptions = {}): Promise<SessionInfo> {
    const message: Record<string, unknown> = {
      type: "session.start",
      seed: options.seed ?? 0,
      options: {
        media: options.media ?? "raw",
        ...(options.quality !== undefined ? { quality: options.quality } : {}),
        ...(options.parts ? { parts: true } : {}),
      },
    };
    if (options.prompt !== undefined) message.prompt = options.prompt;
    if (options.image !== undefined) message.image = options.image;
    if (options.references !== undefined) message.references = options.references;
    if (options.shareViewers || options.shareControllers) {
      message.share = { viewers: Boolean(options.shareViewers), controllers: Boolean(options.shareControllers) };
    }
    if (options.queue) message.queue = true;
    this.onQueued = options.onQueued ?? null;
    try {
      let answer = await this.request(message, !options.queue);
      for (let moves = 0; answer.type === "session.moved"; moves += 1) {
        // The service's line placed this start on another front-end: start there with the reservation.
        if (moves === MAX_MOVES) throw new WorldClientError(`the start moved more than ${MAX_MOVES} times in a row.`);
        this.drop();
        this.url = answer.url;
        await this.connect();
        answer = await this.request({ ...message, reservation: answer.reservation }, !options.queue);
      }
      const reply = answer as SessionStarted;
      this.session = {
        sessionId: reply.session_id,
        role: "host",
        media: reply.media,
        model: reply.model,
        resumeToken: reply.resume_token ?? null,
        viewerToken: reply.share?.viewer ?? null,
        controllerToken: reply.share?.controller ?? null,
        leadChunks: reply.lead_chunks,
        reply,
      };
      return this.session;
    } finally {
      this.onQueued = null;
    }
  }

  /** Open a shared world with a token from its host (`role`: viewer or controller). */
  async join(sessionId: string, token: string, role: "viewer" | "controller" = "viewer", media?: Media): Promise<SessionInfo> {
    const reply = (await this.follow({
      type: "session.join",
      session_id: sessionId,
      token,
      role,
      ...(media ? { media } : {}),
    })) as SessionJoined;
    this.lastSeq = reply.seq;
    this.session = {
      sessionId: reply.session_id,
      role: reply.role,
      media: reply.media,
      model: reply.model,
      resumeToken: reply.resume_token ?? null,
      viewerToken: null,
      controllerToken: null,
      leadChunks: reply.lead_chunks,
      reply,
    };
    return this.session;
  }

  /** Reconnect and take the session back after a lost connection (or `drop()`): chunks after `lastSeq` follow. */
  async resume(
    session: Pick<SessionInfo, "sessionId" | "resumeToken"> | null = this.session,
    lastSeq: number = this.lastSeq,
    options: ResumeOptions = {},
  ): Promise<SessionResumed> {
    if (!session || !session.resumeToken) throw new WorldClientError("no resumable session (start or join one first).");
    this.drop();
    await this.connect();
    const reply = (await this.follow({
      type: "session.resume",
      session_id: session.sessionId,
      token: session.resumeToken,
      last_seq: lastSeq,
      ...(options.keyframe ? { keyframe: true } : {}),
    })) as SessionResumed;
    const known = this.session?.sessionId === session.sessionId ? this.session : null;
    this.session = {
      viewerToken: null,
      controllerToken: null,
      ...known,
      sessionId: reply.session_id,
      resumeToken: session.resumeToken,
      role: reply.role,
      media: reply.media,
      model: reply.model,
      leadChunks: reply.lead_chunks,
      reply,
    };
    this.lastSeq = lastSeq;
    return reply;
  }

  /** Send one event; resolves once the server accepted it (it is applied at a later chunk boundary). */
  async sendEvent(options: EventOptions): Promise<InputAccepted> {
    const eventId = options.eventId ?? this.nextEventId;
    this.nextEventId = Math.max(this.nextEventId, eventId + 1);
    const message: Record<string, unknown> = { type: "input.event", event_id: eventId, controls: options.controls ?? [] };
    if (options.prompt !== undefined) message.prompt = options.prompt;
    return (await this.request(message)) as InputAccepted;
  }

  /** Reset the world; resolves with the new epoch (chunks of the old one are passed over). */
  async reset(): Promise<number> {
    const reply = (await this.request({ type: "session.reset" })) as ServerMessages.SessionResetDone;
    this.epoch = reply.epoch;
    return reply.epoch;
  }

  /** Cancel the chunk being made; resolves with its index (the next chunk sent has it). */
  async cancelChunk(): Promise<number> {
    const reply = (await this.request({ type: "chunk.cancel" })) as ServerMessages.ChunkCancelled;
    return reply.chunk_index;
  }

  /** Tell the server chunk `seq` is playing (its first frame shown). */
  ack(seq: number): void {
    if (this.socket && this.socket.readyState === OPEN) this.socket.send(JSON.stringify({ type: "chunk.ack", seq }));
  }

  /** The next chunk of the current epoch (acked when `autoAck` is on, the default). */
  async nextChunk(timeoutMs?: number): Promise<Chunk> {
    for (;;) {
      const chunk = await this.take(timeoutMs);
      if (this.options.autoAck ?? true) this.ack(chunk.seq);
      if (chunk.epoch >= this.epoch) return chunk;
    }
  }

  /** Chunks as they come, until the connection closes. */
  async *chunks(): AsyncIterableIterator<Chunk> {
    for (;;) {
      try {
        yield await this.nextChunk();
      } catch (error) {
        if (error instanceof WorldClientError) return;
        throw error;
      }
    }
  }

  /** Close the session (a host's world ends for everyone in it; a member leaves it; a start waiting in line
   * leaves the line), then the socket. Resolves with the server's reason (`closed`, `left_queue`), or null when
   * there was nothing to close. */
  async close(): Promise<string | null> {
    let reason: string | null = null;
    if (this.connected) {
      try {
        reason = ((await this.request({ type: "session.close" })) as ServerMessages.SessionClosed).reason;
      } catch {
        // already gone: nothing to close
      }
    }
    this.session = null;
    this.drop();
    return reason;
  }

  /** Lose the connection without closing the session: it waits out the server's resume grace. A close `code` of
   * 1000 or 1001 is a clean leave instead: the server ends a host's world, or a member's place in one. */
  drop(code?: number, reason?: string): void {
    const socket = this.socket;
    this.socket = null;
    if (socket) {
      socket.onclose = socket.onerror = socket.onmessage = null;
      socket.close(code, reason);
    }
    this.lost(new WorldClientError("connection dropped."));
  }

  // -- the wire ---------------------------------------------------------------------------

  /** A resume or join: where the world lives on another front-end of the service (`session.moved`), connect
   * there and send it again (at most three moves in a row). */
  private async follow(message: Record<string, unknown>): Promise<ServerMessage> {
    let reply = await this.request(message);
    for (let moves = 0; reply.type === "session.moved"; moves += 1) {
      if (moves === MAX_MOVES) throw new WorldClientError(`session ${String(message.session_id)} moved more than ${MAX_MOVES} times in a row.`);
      this.drop();
      this.url = reply.url;
      await this.connect();
      reply = await this.request(message);
    }
    return reply;
  }

  private request(message: Record<string, unknown>, timed = true): Promise<ServerMessage> {
    const socket = this.socket;
    if (!socket || socket.readyState !== OPEN) return Promise.reject(new WorldClientError("not connected."));
    const id = `t${this.nextId++}`;
    return new Promise<ServerMessage>((resolve, reject) => {
      const timeout = timed ? this.options.replyTimeoutMs ?? 30_000 : 0;
      const timer = timeout ? setTimeout(() => {
        this.replies.delete(id);
        reject(new WorldClientError(`no reply to ${String(message.type)} in ${timeout} ms.`));
      }, timeout) : null;
      this.replies.set(id, {
        resolve: (reply) => {
          if (timer) clearTimeout(timer);
          if (reply.type === "error") {
            reject(new WorldError(reply.code, reply.message, reply.event_id, reply.retry_after_ms));
          } else if (reply.type === "session.failed") {
            reject(new WorldError(reply.code, reply.message, null, null, true));
          } else {
            resolve(reply);
          }
        },
        reject: (error) => {
          if (timer) clearTimeout(timer);
          reject(error);
        },
      });
      socket.send(JSON.stringify({ ...message, id }));
    });
  }

  protected receive(data: unknown): void {
    if (typeof data !== "string") {
      const partial = this.partial;
      if (!partial) return this.lost(new WorldClientError("binary message without a chunk header."));
      if (this.listener) { // a player takes each frame as it comes
        const index = partial.payloads.length;
        partial.payloads.push(EMPTY);
        if (partial.payloads.length === partial.header.frames.sizes.length) this.partial = null;
        this.listener.frame?.(data as ArrayBuffer, partial.header, index);
        return;
      }
      partial.payloads.push(new Uint8Array(data as ArrayBuffer));
      if (partial.payloads.length === partial.header.frames.sizes.length) {
        this.partial = null;
        this.complete(partial.header, partial.payloads);
      }
      return;
    }
    const message = JSON.parse(data) as ServerMessage;
    const listener = this.listener;
    switch (message.type) {
      case "chunk":
      case "chunk.part":
        this.partial = { header: message, payloads: [] };
        if (listener) {
          if (message.type === "chunk") this.lastSeq = Math.max(this.lastSeq, message.seq);
          if (message.frames.sizes.length === 0) this.partial = null;
          listener.message?.(message);
        } else if (message.frames.sizes.length === 0) {
          this.partial = null;
          this.complete(message, []);
        }
        return;
      case "chunk.skipped":
        this.lastSeq = Math.max(this.lastSeq, message.to_seq);
        return this.notice(message, this.skipped);
      case "input.dropped":
        return this.notice(message, this.dropped);
      case "session.queued":
        this.notice(message, this.queued);
        this.onQueued?.(message);
        return;
    }
    const waiter = typeof message.id === "string" ? this.replies.get(message.id) : undefined;
    if (waiter) {
      this.replies.delete(message.id as string);
      waiter.resolve(message);
    } else if (listener) {
      if (message.type === "session.closed") this.session = null;
      listener.message?.(message);
    } else if (message.type === "session.closed") {
      this.session = null;
      this.deliver(new WorldClientError(`session closed (${message.reason}).`));
    } else if (message.type === "session.failed" || message.type === "error") {
      this.deliver(new WorldError(message.code, message.message));
    }
  }

  /** A chunk's or a part's frames are all in (no listener): a part is kept until its chunk, which takes them. */
  private complete(header: ChunkHeader | ChunkPartHeader, payloads: Uint8Array[]): void {
    if (header.type === "chunk.part") {
      const held = header.first === 0 ? [] : this.parts.get(header.seq);
      if (!held || held.length !== header.first) {
        return this.lost(new WorldClientError(`chunk ${header.seq}'s part from frame ${header.first} follows none.`));
      }
      this.parts.set(header.seq, [...held, ...payloads]);
      return;
    }
    const held = this.parts.get(header.seq) ?? [];
    for (const seq of this.parts.keys()) if (seq <= header.seq) this.parts.delete(seq);
    const sent = header.frames.sent ?? 0;
    if (sent && held.length !== sent) {
      return this.lost(new WorldClientError(`chunk ${header.seq} says ${sent} frames came in parts; they did not.`));
    }
    this.deliver(toChunk(header, sent ? [...held, ...payloads] : payloads));
  }

  /** A notice to the listener, or, with none, kept in its list (`skipped`, `dropped`, `queued`). */
  private notice<T extends ServerMessage>(message: T, kept: T[]): void {
    if (this.listener) this.listener.message?.(message);
    else kept.push(message);
  }

  protected deliver(item: Chunk | Error): void {
    if (!(item instanceof Error)) this.lastSeq = Math.max(this.lastSeq, item.seq);
    if (this.listener) { // a player hears a chunk as its header (an error came to it as its message)
      if (!(item instanceof Error)) this.listener.message?.(item.header);
      return;
    }
    const taker = this.takers.shift();
    if (!taker) {
      this.ready.push(item);
    } else if (item instanceof Error) {
      taker.reject(item);
    } else {
      taker.resolve(item);
    }
  }

  private take(timeoutMs?: number): Promise<Chunk> {
    const item = this.ready.shift();
    if (item instanceof Error) return Promise.reject(item);
    if (item) return Promise.resolve(item);
    if (this.closed) return Promise.reject(this.closed);
    return new Promise<Chunk>((resolve, reject) => {
      const timer = timeoutMs === undefined ? null : setTimeout(() => {
        const index = this.takers.indexOf(waiter);
        if (index >= 0) this.takers.splice(index, 1);
        reject(new WorldClientError(`no chunk in ${timeoutMs} ms.`));
      }, timeoutMs);
      const waiter: Waiter<Chunk> = {
        resolve: (chunk) => { if (timer) clearTimeout(timer); resolve(chunk); },
        reject: (error) => { if (timer) clearTimeout(timer); reject(error); },
      };
      this.takers.push(waiter);
    });
  }

  private lost(error: Error): void {
    if (this.closed) return;
    this.closed = error;
    this.partial = null;
    for (const waiter of this.replies.values()) waiter.reject(new WorldClientError("connection closed before the reply."));
    this.replies.clear();
    for (const taker of this.takers.splice(0)) taker.reject(error);
  }
}

const EMPTY = new Uint8Array(0);

export function toChunk(header: ChunkHeader, payloads: Uint8Array[]): Chunk {
  return {
    seq: header.seq,
    epoch: header.epoch,
    chunkIndex: header.chunk_index,
    appliedEventIds: header.applied_event_ids,
    media: header.frames.media,
    width: header.frames.width,
    height: header.frames.height,
    supersedes: header.supersedes ?? null,
    payloads,
    header,
  };
}

/** A JPEG frame as an ImageBitmap, where the platform decodes images (a browser). */
export async function decodeJpeg(payload: Uint8Array): Promise<ImageBitmap> {
  return createImageBitmap(new Blob([payload as BlobPart], { type: "image/jpeg" }));
}

/** A raw frame's RGB bytes (row-major, 3 a pixel) as RGBA, opaque: what ImageData and a canvas take. */
export function rgbToRgba(rgb: Uint8Array): Uint8ClampedArray<ArrayBuffer> {
  if (rgb.length % 3) throw new WorldClientError(`a raw frame is 3 bytes a pixel; got ${rgb.length} bytes.`);
  const rgba = new Uint8ClampedArray(new ArrayBuffer((rgb.length / 3) * 4));
  for (let i = 0, j = 0; i < rgb.length; i += 3, j += 4) {
    rgba[j] = rgb[i];
    rgba[j + 1] = rgb[i + 1];
    rgba[j + 2] = rgb[i + 2];
    rgba[j + 3] = 255;
  }
  return rgba;
}

/** A JPEG or raw frame as a picture a canvas draws (drawImage an ImageBitmap, putImageData an ImageData), where
 * the platform has them (a browser); H.264 is played as a stream instead (H264Player). */
export async function decodeFrame(payload: Uint8Array, media: Media, width: number, height: number): Promise<ImageBitmap | ImageData> {
  if (media === "jpeg") return decodeJpeg(payload);
  if (media !== "raw") throw new WorldClientError(`${media} frames are a stream: play them with H264Player.`);
  if (payload.length !== width * height * 3) {
    throw new WorldClientError(`a raw ${width}x${height} frame is ${width * height * 3} bytes; got ${payload.length}.`);
  }
  return new ImageData(rgbToRgba(payload), width, height);
}
