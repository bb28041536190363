// The typed client against a real worldserve server (the procedural model, raw frames, a bearer token),
// in Node with `ws`: the protocol doc's example exchange, resume after a drop, a share link, cancel,
// and the errors a client is told. Run by `npm test` (make test runs it); WORLDSERVE_PYTHON names the
// Python that has worldserve installed (default: the repository's .venv).
import { once } from "node:events";
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import WebSocket from "ws";

import {
  WorldClient, WorldClientError, WorldError, camera, iceServersOf, keys, parseIceLinks, rgbToRgba, type SocketLike,
} from "../src/index.js";
import { serve, type Served } from "./serve.js";

const TOKEN = "ts-client-test-token";
const socket = (url: string, protocols?: string[]) => new WebSocket(url, protocols) as unknown as SocketLike;

let served: Served;
let url = "";

before(async () => {
  served = await serve(["--model", "procedural", "--token", TOKEN, "--ice-server", "stun:127.0.0.1:3478",
    "--ice-server", "turn:ana:s3%22cr%5Cet@127.0.0.1:3478?transport=tcp"]);
  url = served.url;
});

after(() => {
  served.stop();
  assert.ok(!served.log().includes("Traceback"), served.log());
});

function client(at: string = url): WorldClient {
  return new WorldClient(at, { token: TOKEN, socket });
}

test("the protocol doc's exchange: start, an event accepted then applied at a chunk boundary, reset, close", async () => {
  const world = client();
  await world.connect();
  const info = await world.start({ prompt: "islands", seed: 3, media: "raw" });
  assert.equal(info.role, "host");
  assert.equal((info.model as { name: string }).name, "procedural");
  const accepted = await world.sendEvent({ controls: [keys("W", "D")] });
  assert.equal(accepted.status, "accepted");
  const seen = [];
  for (;;) {
    const chunk = await world.nextChunk(30_000);
    seen.push(chunk);
    assert.equal(chunk.media, "raw");
    assert.equal(chunk.payloads.length, chunk.header.frames.count);
    for (const frame of chunk.payloads) assert.equal(frame.byteLength, chunk.width * chunk.height * 3);
    if (chunk.appliedEventIds.includes(accepted.event_id)) break;
    assert.ok(seen.length < 8, "the event was not applied within 8 chunks");
  }
  assert.deepEqual(seen.map((c) => c.chunkIndex), seen.map((_, i) => i));
  assert.equal(await world.reset(), 1);
  const fresh = await world.nextChunk(30_000);
  assert.equal(fresh.epoch, 1);
  assert.equal(fresh.chunkIndex, 0);
  await world.close();
});

test("a dropped connection resumes with every chunk after the last one received, none twice", async () => {
  const world = client();
  await world.connect();
  await world.start({ seed: 5 });
  const before = [await world.nextChunk(30_000), await world.nextChunk(30_000)];
  world.drop();
  await new Promise((resolve) => setTimeout(resolve, 600)); // chunks made meanwhile wait for the resume
  const resumed = await world.resume();
  assert.equal(resumed.session_id, world.session?.sessionId);
  const next = [await world.nextChunk(30_000), await world.nextChunk(30_000)];
  assert.deepEqual(
    [...before, ...next].map((c) => c.seq),
    [0, 1, 2, 3].map((i) => before[0].seq + i),
  );
  await world.close();
});

test("a player listens: each chunk's header, then its frames one by one as they come; notices; the close code", async () => {
  const world = client();
  const heard: string[] = [];
  const frames = new Map<number, number[]>(); // seq -> the frame indexes heard, in order
  let opened = 0;
  let size = 0;
  let closedWith = (_code: number) => undefined as void;
  const closed = new Promise<number>((resolve) => { closedWith = resolve; });
  world.listen({
    opened: () => { opened += 1; },
    message: (message) => {
      heard.push(message.type === "chunk" ? `chunk ${message.seq}` : message.type);
      if (message.type === "chunk") frames.set(message.seq, []);
    },
    frame: (payload, header, index) => {
      assert.ok(heard.includes(`chunk ${header.seq}`), "a frame before its chunk's header");
      assert.equal(payload.byteLength, header.frames.sizes[index]);
      size = header.frames.width * header.frames.height * 3;
      assert.equal(payload.byteLength, size);
      frames.get(header.seq)?.push(index);
    },
    closed: (code) => closedWith(code),
  });
  await world.connect();
  const info = await world.start({ seed: 4, media: "raw" });
  assert.equal(info.reply.type, "session.started");
  const count = (info.model as { frames_per_chunk: number }).frames_per_chunk;
  const deadline = Date.now() + 30_000;
  while ([...frames.values()].filter((got) => got.length === count).length < 3) {
    assert.ok(Date.now() < deadline, `3 whole chunks not heard in 30 s: ${heard.join(", ")}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  for (const got of [...frames.values()].slice(0, 3)) assert.deepEqual(got, [...Array(count).keys()]);
  assert.ok(world.lastSeq >= 2);
  await assert.rejects(world.nextChunk(200), /no chunk in 200 ms/); // a listener's chunks are its own
  // Another connection takes the session over with its resume token: this one is closed with 4000.
  const thief = client();
  const resumed = await thief.resume({ sessionId: info.sessionId, resumeToken: info.resumeToken }, world.lastSeq);
  assert.equal(resumed.role, "host");
  assert.equal(await closed, 4000);
  assert.equal(opened, 1);
  assert.equal(thief.session?.sessionId, info.sessionId);
  assert.equal(await thief.close(), "closed");
  assert.equal(await world.close(), null); // its connection is gone: nothing to close
});

test("a share link: a viewer sees the host's world and may not steer it; a controller may", async () => {
  const host = client();
  await host.connect();
  const info = await host.start({ seed: 9, shareViewers: true, shareControllers: true });
  assert.ok(info.viewerToken && info.controllerToken);
  const viewer = client();
  await viewer.connect();
  const joined = await viewer.join(info.sessionId, info.viewerToken, "viewer");
  assert.equal(joined.role, "viewer");
  const seen = await viewer.nextChunk(30_000);
  assert.ok(seen.seq >= 0);
  await assert.rejects(viewer.sendEvent({ controls: [keys("W")] }), (error: unknown) =>
    error instanceof WorldError && error.code === "not_controller");
  const controller = client();
  await controller.connect();
  await controller.join(info.sessionId, info.controllerToken, "controller");
  const steered = await controller.sendEvent({ controls: [camera(1.5, 0)] });
  assert.equal(steered.status, "accepted");
  for (let i = 0; ; i++) {  // each member hears its own events' ids in the chunks that applied them
    const chunk = await controller.nextChunk(30_000);
    await host.nextChunk(30_000);  // the host plays on (its acks pace the world)
    if (chunk.appliedEventIds.includes(steered.event_id)) break;
    assert.ok(i < 8, "the controller's event was not applied within 8 chunks");
  }
  await host.close();
  const ended = async () => {  // the chunks it still holds, then the world's end
    for (let i = 0; i < 50; i++) await viewer.nextChunk(30_000);
  };
  await assert.rejects(ended(), (error: unknown) => error instanceof WorldClientError && /session closed/.test(error.message));
  viewer.drop();
  controller.drop();
});

test("chunk.cancel answers the chunk's index or nothing_to_cancel, and the world goes on", async () => {
  const world = client();
  await world.connect();
  await world.start({ seed: 2 });
  await world.nextChunk(30_000);
  const codes = new Set<string>();
  let cancelled: number | null = null;
  for (let i = 0; i < 200 && cancelled === null; i++) {
    try {
      cancelled = await world.cancelChunk();
    } catch (error) {
      assert.ok(error instanceof WorldError);
      codes.add(error.code);
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
  }
  for (const code of codes) assert.equal(code, "nothing_to_cancel");
  const later = await world.nextChunk(30_000);
  assert.ok(later.chunkIndex >= 1);
  await world.close();
});

test("bad input gets a clear error: a bad image, a wrong token; the server stays healthy", async () => {
  const world = client();
  await world.connect();
  await assert.rejects(world.start({ image: "bm90IGFuIGltYWdl" }), (error: unknown) =>
    error instanceof WorldError && error.code === "invalid_image");
  await world.start({ seed: 1 });
  await world.nextChunk(30_000);
  await world.close();
  const stranger = new WorldClient(url, { token: "wrong", socket });
  await assert.rejects(stranger.connect(), (error: unknown) => error instanceof WorldClientError);
  const health = await fetch(url.replace("ws://", "http://").replace("/v1/world", "/healthz"));
  assert.equal(health.status, 200);
});

test("a join told session.moved goes on to the world's front-end by itself, with its token", async () => {
  // The other door: a socket server that, as a front-end of a service whose directory knows the world lives
  // elsewhere, answers every join with session.moved (the server side is tested with two real front-ends
  // in tests/test_front_ends.py; this checks the package follows it).
  const { WebSocketServer } = await import("ws");
  const door = new WebSocketServer({ host: "127.0.0.1", port: 0, handleProtocols: (offered) => offered.has("worldserve.v1") ? "worldserve.v1" : false });
  await once(door, "listening");
  const address = door.address();
  if (address === null || typeof address === "string") throw new Error("no port");
  const offered: string[] = [];
  door.on("connection", (peer, request) => {
    offered.push(String(request.headers["sec-websocket-protocol"]).replace(/\s+/g, ""));
    peer.on("message", (data) => {
      const message = JSON.parse(String(data));
      peer.send(JSON.stringify({ type: "session.moved", id: message.id, session_id: message.session_id, url }));
    });
  });
  try {
    const host = client();
    await host.connect();
    const info = await host.start({ seed: 4, shareViewers: true });
    assert.ok(info.viewerToken);
    const viewer = client(`ws://127.0.0.1:${address.port}/v1/world`);
    await viewer.connect();
    const joined = await viewer.join(info.sessionId, info.viewerToken, "viewer");
    assert.equal(joined.sessionId, info.sessionId);
    assert.equal(viewer.url, url);  // it went where the world lives, and stays there
    assert.ok((await viewer.nextChunk(30_000)).seq >= 0);
    assert.deepEqual(offered, [`worldserve.v1,bearer.${TOKEN}`]);
    viewer.drop();
    await host.close();
  } finally {
    door.close();
  }
});

test("the ICE servers a WebRTC endpoint tells in its Link headers, for its token only", async () => {
  const endpoint = url.replace("ws://", "http://").replace("/v1/world", "/v1/webrtc");
  assert.deepEqual(await iceServersOf(endpoint, TOKEN), [
    { urls: "stun:127.0.0.1:3478" },
    { urls: "turn:127.0.0.1:3478?transport=tcp", username: "ana", credential: 's3"cr\\et' },
  ]);
  assert.deepEqual(await iceServersOf(endpoint, "not-the-token"), []); // 401: no credentials for anyone
});

test("Link headers: rel=ice-server links only, quoted strings unescaped, commas inside them kept", () => {
  const header = '<stun:a.example>; rel="ice-server", <https://x.example/doc>; rel="help", '
    + '<turns:b.example:5349?transport=tcp>; rel="ice-server"; username="u,1"; credential="p\\"q"; '
    + 'credential-type="password"';
  assert.deepEqual(parseIceLinks(header), [
    { urls: "stun:a.example" },
    { urls: "turns:b.example:5349?transport=tcp", username: "u,1", credential: 'p"q' },
  ]);
  assert.deepEqual(parseIceLinks(null), []);
});

test("a raw frame's RGB bytes become opaque RGBA, pixel for pixel; a length not of whole pixels is refused", () => {
  assert.deepEqual([...rgbToRgba(new Uint8Array([1, 2, 3, 250, 251, 252]))], [1, 2, 3, 255, 250, 251, 252, 255]);
  assert.equal(rgbToRgba(new Uint8Array(0)).length, 0);
  assert.throws(() => rgbToRgba(new Uint8Array(4)), /3 bytes a pixel; got 4/);
});
