// The data channel as WebRTCWorldClient's socket: each short message goes first as a copy on the fast channel,
// prefixed with its index among the main channel's messages (pieces of a long one counted one by one), as the
// server's merge (webrtc_session.py) reads it; and the server's copies are merged back the same way (ChannelMerge).
// Fake channels: only what the socket touches.
import { test } from "node:test";
import assert from "node:assert/strict";

import { ChannelMerge, FAST_COPY_CHARS, FAST_HELD, PIECE_BYTES, channelSocket } from "../src/index.js";

type Sent = { on: string; data: string | Uint8Array };

function channels(fastOpen = true) {
  const sent: Sent[] = [];
  const channel = { readyState: "open", send: (data: string | Uint8Array) => sent.push({ on: "main", data }) };
  const fast = {
    readyState: fastOpen ? "open" : "connecting",
    send: (data: string | Uint8Array) => sent.push({ on: "fast", data }),
  };
  const pc = {};
  return { sent, channel, fast, pc };
}

test("a short message goes as a copy first, at its index among the main channel's messages", () => {
  const { sent, channel, fast, pc } = channels();
  const socket = channelSocket(channel as never, fast as never, pc as never, () => undefined);
  socket.send('{"type":"chunk.ack","seq":0}');
  const long = JSON.stringify({ type: "session.start", image: "x".repeat(PIECE_BYTES + 10) }); // two pieces + end
  socket.send(long);
  socket.send('{"type":"input.event","event_id":1}');
  assert.deepEqual(
    sent.map(({ on, data }) => [on, typeof data === "string" ? data.slice(0, 40) : `${data.length} bytes`]),
    [
      ["fast", '0:{"type":"chunk.ack","seq":0}'],
      ["main", '{"type":"chunk.ack","seq":0}'],
      ["main", `${PIECE_BYTES} bytes`],
      ["main", `${long.length - PIECE_BYTES} bytes`], // (ASCII: as many bytes as characters)
      ["main", ""],
      ["fast", '4:{"type":"input.event","event_id":1}'], // after 0, the long one's 3: index 4
      ["main", '{"type":"input.event","event_id":1}'],
    ],
  );
});

test("no copy while the fast channel is not open, or of a message over FAST_COPY_CHARS; the count goes on", () => {
  const { sent, channel, fast, pc } = channels(false);
  const socket = channelSocket(channel as never, fast as never, pc as never, () => undefined);
  socket.send("{}");
  fast.readyState = "open";
  socket.send(JSON.stringify({ pad: "y".repeat(FAST_COPY_CHARS) }));
  socket.send("{}");
  assert.deepEqual(sent.filter(({ on }) => on === "fast").map(({ data }) => data), ["2:{}"]);
  assert.equal(sent.filter(({ on }) => on === "main").length, 3);
});

test("the socket reads the server's stream once, in order, whichever copy comes first", () => {
  const { channel, fast, pc } = channels();
  const merge = new ChannelMerge();
  const socket = channelSocket(channel as never, fast as never, pc as never, () => undefined, merge);
  const read: unknown[] = [];
  socket.onmessage = ({ data }) => read.push(data);
  const main = (data: string) => (channel as { onmessage?: (event: { data: string }) => void }).onmessage?.({ data });
  const copy = (data: string) => (fast as { onmessage?: (event: { data: string }) => void }).onmessage?.({ data });
  copy('0:{"type":"event.accepted","event_id":1}'); // first, by its copy
  main('{"type":"event.accepted","event_id":1}'); // passed over
  copy('2:{"type":"chunk.track","seq":3}'); // ahead of a gap: waits for message 1
  assert.equal(read.length, 1);
  main('{"type":"chunk","seq":3}'); // the gap closes: 1 then 2
  main('{"type":"chunk.track","seq":3}'); // passed over
  copy('1:{"type":"chunk","seq":3}'); // late: not used
  copy("x:{}"); // malformed: not used
  assert.deepEqual(read, [
    '{"type":"event.accepted","event_id":1}',
    '{"type":"chunk","seq":3}',
    '{"type":"chunk.track","seq":3}',
  ]);
  assert.deepEqual([merge.taken, merge.unused, merge.held], [2, 2, 0]);
});

test("whatever copies come, in whatever order, the merge reads the main stream once, in order", () => {
  let seed = 7; // a small linear congruential generator: the same cases on every run
  const random = (n: number) => {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    return seed % n;
  };
  for (let round = 0; round < 400; round++) {
    const count = 1 + random(40);
    const messages = Array.from({ length: count }, (_, i) => `{"type":"input.event","event_id":${i}}`);
    const copies = Array.from({ length: random(3 * count + 1) }, () => random(count));
    const arrivals: [string, number][] = [
      ...messages.map((_, i): [string, number] => ["main", i]),
      ...copies.map((i): [string, number] => ["fast", i]),
    ];
    for (let i = arrivals.length - 1; i > 0; i--) { // shuffled, the main channel's own order kept below
      const j = random(i + 1);
      [arrivals[i], arrivals[j]] = [arrivals[j], arrivals[i]];
    }
    const merge = new ChannelMerge<string>();
    const read: string[] = [];
    let nextMain = 0;
    for (const [kind, index] of arrivals) {
      if (kind === "main") read.push(...merge.main(messages[nextMain++]));
      else read.push(...merge.copy(`${index}:${messages[index]}`));
      assert.ok(merge.held <= FAST_HELD);
    }
    assert.deepEqual(read, messages);
    assert.equal(merge.held, 0);
    assert.equal(merge.taken + merge.unused, copies.length); // each copy taken or passed over, once
  }
});
