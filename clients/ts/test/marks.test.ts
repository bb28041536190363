// TrackMarks, the rule that tells a frame's chunk on a WebRTC track from its RTP timestamp (the page and
// WebRTCWorldClient both use it): the latest chunk whose first frame is at or before the frame, a tick either
// way the same frame, across the 32-bit wrap.
import { test } from "node:test";
import assert from "node:assert/strict";

import { FrameLabels, TrackMarks, webrtcUrl } from "../src/index.js";

const FRAME = 90_000 / 16; // RTP ticks per frame at 16 frames/s

test("a frame is the chunk whose first frame is the latest at or before it", () => {
  const marks = new TrackMarks();
  assert.equal(marks.chunkOf(1234), null); // nothing told yet
  marks.tell(7, 1000);
  marks.tell(8, 1000 + 4 * FRAME);
  assert.equal(marks.chunkOf(1000), 7);
  assert.equal(marks.chunkOf(1000 + 3 * FRAME), 7);
  assert.equal(marks.chunkOf(1000 + 4 * FRAME), 8);
  assert.equal(marks.chunkOf(1000 + 4 * FRAME - 1), 8); // a decoder's tick off: still chunk 8's first frame
  assert.equal(marks.chunkOf(1000 + 9 * FRAME), 8); // beyond the last mark: the last chunk, until told more
  assert.equal(marks.chunkOf(1000 - FRAME), null); // before every mark kept
  assert.equal(marks.get(8), 1000 + 4 * FRAME);
});

test("the rule holds across the RTP timestamp's 32-bit wrap", () => {
  const marks = new TrackMarks();
  const first = 2 ** 32 - 2 * FRAME;
  marks.tell(1, first);
  marks.tell(2, (first + 4 * FRAME) >>> 0); // wrapped past 0
  assert.equal(marks.chunkOf(first + FRAME), 1);
  assert.equal(marks.chunkOf((first + 5 * FRAME) >>> 0), 2);
  assert.equal(marks.chunkOf(-1), 1); // a negative number is read as its 32-bit timestamp
});

test("marks far behind the newest are forgotten", () => {
  const marks = new TrackMarks();
  for (let seq = 0; seq < 100; seq++) marks.tell(seq, seq * 4 * FRAME);
  assert.equal(marks.get(0), undefined);
  assert.equal(marks.get(99), 99 * 4 * FRAME);
  assert.equal(marks.chunkOf(70 * 4 * FRAME + FRAME), 70);
  marks.clear();
  assert.equal(marks.chunkOf(99 * 4 * FRAME), null);
});

test("a mark at or after a frame settles its chunk; one before it does not", () => {
  const marks = new TrackMarks();
  assert.equal(marks.settled(1000), false);
  marks.tell(7, 1000);
  assert.equal(marks.settled(1000), true); // the chunk's first frame itself
  assert.equal(marks.settled(1000 + 30), true); // a tick off: still that frame
  assert.equal(marks.settled(1000 + FRAME), false); // a later frame: the next chunk may start there
  marks.tell(8, 1000 + 4 * FRAME);
  assert.equal(marks.settled(1000 + 3 * FRAME), true);
  assert.equal(marks.settled(2 ** 32 - FRAME), true); // a frame just before the 32-bit wrap: the marks past 0 follow it
});

test("a frame shown before its chunk's mark came is told that chunk, not the one before", () => {
  let now = 0;
  const marks = new TrackMarks();
  const labels = new FrameLabels(marks, 250, () => now);
  const told: [number | null, number][] = [];
  const then = (seq: number | null, rtp: number) => { told.push([seq, rtp]); };
  marks.tell(7, 1000);
  labels.shown(1000, 0, then); // chunk 7's first frame, its mark in: told at once
  assert.deepEqual(told, [[7, 1000]]);
  labels.shown(1000 + FRAME, 1, then); // chunk 7's, unless chunk 8 starts here: held
  labels.shown(1000 + 2 * FRAME, 2, then);
  assert.deepEqual(told, [[7, 1000]]);
  assert.equal(labels.waiting, 2);
  marks.tell(8, 1000 + 2 * FRAME); // chunk 8's mark comes after its first frame was shown
  labels.settle();
  assert.deepEqual(told, [[7, 1000], [7, 1000 + FRAME], [8, 1000 + 2 * FRAME]]);
  assert.equal(labels.waiting, 0);
  assert.equal(labels.guessed, 0);
  labels.clear();
});

test("a frame held past the hold is told the chunk known then, frames in the order shown", async () => {
  const marks = new TrackMarks();
  const labels = new FrameLabels(marks, 20);
  const told: (number | null)[] = [];
  marks.tell(3, 500);
  labels.shown(500 + FRAME, 0, (seq) => told.push(seq));
  labels.shown(500 + 2 * FRAME, 0, (seq) => told.push(seq));
  assert.equal(told.length, 0);
  await new Promise((resolve) => setTimeout(resolve, 60)); // no later mark: told after the hold, by its timer
  assert.deepEqual([...told], [3, 3]);
  assert.equal(labels.guessed, 2);
  labels.shown(100, 0, (seq) => told.push(seq)); // before every mark: no chunk, but settled by the marks after it
  assert.deepEqual(told, [3, 3, null]);
});

test("webrtcUrl turns a /v1/world URL into its front-end's /v1/webrtc", () => {
  assert.equal(webrtcUrl("ws://127.0.0.1:8000/v1/world"), "http://127.0.0.1:8000/v1/webrtc");
  assert.equal(webrtcUrl("wss://example.test/fe/2/v1/world"), "https://example.test/fe/2/v1/webrtc");
});
