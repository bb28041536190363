// The data channel as WebRTCWorldClient's socket: each short message goes first as a copy on the fast channel,
// prefixed with its index among the main channel's messages (pieces of a long one counted one by one), as the
// server's merge (webrtc_session.py) reads it. Fake channels: only what the socket touches.
import { test } from "node:test";
import assert from "node:assert/strict";

import { FAST_COPY_CHARS, PIECE_BYTES, channelSocket } from "../src/index.js";

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
