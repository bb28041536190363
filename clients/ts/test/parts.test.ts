// A chunk's frames in parts (`parts: true` at start) against a real server whose model makes each chunk
// in parts (tests/runtime_models.py's PartsModel: the procedural world handed on a frame at a time): without
// a listener, nextChunk still hands over whole chunks, byte for byte what a client that did not ask gets;
// a listener hears each part's header and frames before its chunk, which says how many it already sent.
import { join } from "node:path";
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import WebSocket from "ws";

import { WorldClient, type SocketLike } from "../src/index.js";
import { root, serve, type Served } from "./serve.js";
const socket = (url: string, protocols?: string[]) => new WebSocket(url, protocols) as unknown as SocketLike;

let served: Served;
let url = "";

before(async () => {
  const env = { ...process.env, PYTHONPATH: [join(root, "tests"), process.env.PYTHONPATH].filter(Boolean).join(":") };
  served = await serve(["--model", "runtime_models:PartsModel", "--model-option", "part=1",
    "--model-option", "pause_s=0.02", "--workers", "1"], env);
  url = served.url;
});

after(() => {
  served.stop();
  assert.ok(!served.log().includes("Traceback"), served.log());
});

test("nextChunk hands over whole chunks taken in parts, byte for byte what a client that did not ask gets", async () => {
  const parted = new WorldClient(url, { socket });
  const whole = new WorldClient(url, { socket });
  await parted.connect();
  await whole.connect();
  const info = await parted.start({ seed: 6, media: "raw", parts: true });
  assert.equal((info.model as { frame_parts: boolean }).frame_parts, true);
  await whole.start({ seed: 6, media: "raw" });
  for (let index = 0; index < 3; index++) {
    const [mine, theirs] = [await parted.nextChunk(30_000), await whole.nextChunk(30_000)];
    assert.equal(mine.chunkIndex, index);
    assert.equal(mine.header.frames.sent, 4); // all four came in parts
    assert.equal(theirs.header.frames.sent ?? 0, 0);
    assert.equal(mine.payloads.length, 4);
    assert.deepEqual(mine.payloads.map((p) => Buffer.from(p).toString("hex")), theirs.payloads.map((p) => Buffer.from(p).toString("hex")));
  }
  await parted.close();
  await whole.close();
});

test("a listener hears each part's header and frames, in order, before its chunk", async () => {
  const world = new WorldClient(url, { socket, autoAck: false });
  const heard: string[] = [];
  world.listen({
    message: (message) => {
      if (message.type === "chunk.part") heard.push(`part ${message.seq}:${message.first}`);
      if (message.type === "chunk") heard.push(`chunk ${message.seq} sent ${message.frames.sent ?? 0} rest ${message.frames.sizes.length}`);
    },
    frame: (payload, header, index) => {
      assert.equal(header.type, "chunk.part"); // every frame came in a part
      assert.equal(index, 0);
      assert.equal(payload.byteLength, header.frames.sizes[0]);
      heard.push(`frame ${header.seq}:${header.type === "chunk.part" ? header.first : -1}`);
    },
  });
  await world.connect();
  await world.start({ seed: 2, media: "raw", parts: true });
  const deadline = Date.now() + 30_000;
  while (!heard.includes("chunk 1 sent 4 rest 0")) {
    assert.ok(Date.now() < deadline, `chunk 1 not heard in 30 s: ${heard.join(", ")}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  const seq1 = heard.slice(heard.indexOf("chunk 0 sent 4 rest 0") + 1, heard.indexOf("chunk 1 sent 4 rest 0") + 1);
  assert.deepEqual(seq1, [0, 1, 2, 3].flatMap((i) => [`part 1:${i}`, `frame 1:${i}`]).concat(["chunk 1 sent 4 rest 0"]));
  await world.close();
});
