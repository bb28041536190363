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

const OPEN = 1;
const CLOSED = 3;
/** RTP timestamps this close are one frame's (a decoder may give one back a tick off). */
const SAME_TICKS = 90;

export class WebRTCWorldClient extends WorldClient {
  /** The world's frames: the video track, once the peer connection is up. */
  stream: MediaStream | null = null;
  private pc: RTCPeerConnection | null = null;
  private resource: string | null = null;
  private readonly told = new Map<number, number>(); // seq -> the RTP timestamp of its first frame
  private readonly shownSeqs = new Set<number>();

  constructor(url: string, options: ClientOptions = {}) {
    super(url, { autoAck: false, ...options });
  }

  protected override async open(): Promise<SocketLike> {
    const pc = new RTCPeerConnection();
    const channel = pc.createDataChannel("worldserve");
    pc.addTransceiver("video", { direction: "recvonly" });
    const track = new Promise<MediaStream>((resolve) => {
      pc.ontrack = (event) => resolve(event.streams[0] ?? new MediaStream([event.track]));
    });
    const opened = new Promise<void>((resolve, reject) => {
      channel.onopen = () => resolve();
      channel.onerror = () => reject(new WorldClientError("the data channel failed before it opened."));
    });
    try {
      await pc.setLocalDescription(await pc.createOffer());
      await new Promise<void>((resolve) => { // not trickled: the offer carries every candidate
        if (pc.iceGatheringState === "complete") resolve();
        pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") resolve(); };
        setTimeout(resolve, 3000);
      });
      const url = webrtcUrl(this.url);
      const headers: Record<string, string> = { "Content-Type": "application/sdp" };
      if (this.options.token) headers.Authorization = `Bearer ${this.options.token}`;
      const reply = await fetch(url, { method: "POST", headers, body: pc.localDescription?.sdp ?? "" });
      if (reply.status !== 201) throw new WorldClientError(`cannot connect to ${url}: HTTP ${reply.status}: ${await reply.text()}`);
      const location = reply.headers.get("Location");
      this.resource = location ? new URL(location, url).href : null;
      await pc.setRemoteDescription({ type: "answer", sdp: await reply.text() });
      await opened;
      this.stream = await track;
    } catch (error) {
      pc.close();
      throw error instanceof WorldClientError ? error : new WorldClientError(`cannot connect over WebRTC: ${String(error)}`);
    }
    this.pc = pc;
    this.told.clear();
    return channelSocket(channel, pc, () => this.leave());
  }

  protected override receive(data: unknown): void {
    if (typeof data === "string" && data.startsWith('{"type":"chunk')) {
      const message = JSON.parse(data) as { type: string; seq: number; rtp?: number };
      if (message.type === "chunk.track") {
        this.told.set(message.seq, (message.rtp ?? 0) >>> 0);
        for (const seq of this.told.keys()) if (seq < message.seq - 32) this.told.delete(seq);
        return;
      }
      if (message.type === "chunk") { // its frames are the track's: handed over as its header comes
        this.deliver(toChunk(message as unknown as ChunkHeader, []));
        return;
      }
    }
    super.receive(data);
  }

  /** Each recent chunk's first frame on the track: its RTP timestamp, as the server told it (chunk.track). */
  get marks(): ReadonlyMap<number, number> {
    return this.told;
  }

  /** The chunk (seq) of a frame on the track, by its RTP timestamp: the latest chunk whose first frame is at or
   * before it; null before any chunk.track. */
  chunkOf(rtpTimestamp: number): number | null {
    let found: number | null = null;
    let behind = 0;
    for (const [seq, first] of this.told) {
      const since = ((rtpTimestamp >>> 0) - first + SAME_TICKS) >>> 0;
      if (since < 2 ** 31 && (found === null || since < behind)) [found, behind] = [seq, since];
    }
    return found;
  }

  /** Play the track in `video` and ack each chunk as its first frame is shown; `onFrame` hears every frame
   * shown with its chunk. */
  show(video: HTMLVideoElement, onFrame?: (seq: number | null, rtpTimestamp: number) => void): void {
    video.muted = true;
    video.playsInline = true;
    video.srcObject = this.stream;
    void video.play().catch(() => undefined);
    const shown = (_now: number, meta: VideoFrameCallbackMetadata) => {
      const rtp = meta.rtpTimestamp;
      if (rtp !== undefined) {
        const seq = this.chunkOf(rtp);
        if (seq !== null && !this.shownSeqs.has(seq)) {
          this.shownSeqs.add(seq);
          for (const old of this.shownSeqs) if (old < seq - 32) this.shownSeqs.delete(old);
          this.ack(seq);
        }
        onFrame?.(seq, rtp);
      }
      if (this.pc) video.requestVideoFrameCallback(shown);
    };
    video.requestVideoFrameCallback(shown);
  }

  /** Lose the peer connection as a network would (no DELETE): the server parks the session for `resume()`. */
  override drop(): void {
    this.resource = null;
    this.pc?.close();
    this.pc = null;
    super.drop();
  }

  /** Leave cleanly: DELETE the peer's resource (the server closes the session as on a socket's clean close). */
  private leave(): void {
    const resource = this.resource;
    this.resource = null;
    if (resource) void fetch(resource, { method: "DELETE", keepalive: true }).catch(() => undefined);
    this.pc?.close();
    this.pc = null;
  }
}

/** The data channel as the client's socket. */
function channelSocket(channel: RTCDataChannel, pc: RTCPeerConnection, leave: () => void): SocketLike {
  const socket: SocketLike = {
    binaryType: "arraybuffer",
    get readyState() { return channel.readyState === "open" ? OPEN : CLOSED; },
    send: (data: string) => channel.send(data),
    close: () => leave(),
    onopen: null,
    onclose: null,
    onerror: null,
    onmessage: null,
  };
  channel.onmessage = (event) => socket.onmessage?.({ data: event.data });
  channel.onclose = () => socket.onclose?.({});
  pc.onconnectionstatechange = () => {
    if (pc.connectionState === "failed") socket.onerror?.({});
  };
  return socket;
}
