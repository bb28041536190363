// H264Player's watch over a video that stands still while it should play (STUCK_MS): it is nudged on, to the next
// buffered range across a hole, else a frame on, and the player fails after NUDGES_IN_ROW nudges that did not help.
// A stand-in for the <video> (Node has none): the player reads only its time, state and buffered ranges.
import { test } from "node:test";
import assert from "node:assert/strict";

import { H264Player, NUDGES_IN_ROW, STUCK_MS } from "../src/index.js";

const FPS = 16;
const FRAME = 1 / FPS;

class StandInVideo {
  muted = false;
  playsInline = false;
  paused = false;
  seeking = false;
  ended = false;
  error = null;
  currentTime = 0;
  ranges: [number, number][] = [];
  seeks: number[] = [];

  get buffered() {
    const ranges = this.ranges;
    return { length: ranges.length, start: (i: number) => ranges[i][0], end: (i: number) => ranges[i][1] };
  }

  addEventListener(): void {}

  pause(): void {
    this.paused = true;
  }
}

function player(video: StandInVideo, failures: string[] = []): H264Player {
  const seen = new Proxy(video, {
    set(target, name, value) {
      if (name === "currentTime") target.seeks.push(value as number);
      return Reflect.set(target, name, value);
    },
  });
  return new H264Player(seen as unknown as HTMLVideoElement, FPS, undefined, {
    onFailure: (reason) => failures.push(reason),
  });
}

test("a playing video that stands still with frames ahead is nudged a frame on, not before STUCK_MS", () => {
  const video = new StandInVideo();
  video.ranges = [[0, 2]];
  video.currentTime = 0.5;
  const watcher = player(video);
  watcher.poll(0);
  watcher.poll(100);
  watcher.poll(STUCK_MS + 99);
  assert.equal(watcher.nudges, 0); // seen still since 100 ms only
  watcher.poll(STUCK_MS + 100);
  assert.equal(watcher.nudges, 1);
  assert.deepEqual(video.seeks, [0.5 + FRAME]);
});

test("a video stuck at a hole in what was buffered goes to where the next range starts", () => {
  const video = new StandInVideo();
  video.ranges = [[0, 1], [1.3, 3]];
  video.currentTime = 1 - FRAME / 2; // within a frame of its range's end
  const watcher = player(video);
  watcher.poll(0);
  watcher.poll(1);
  watcher.poll(STUCK_MS + 1);
  assert.deepEqual(video.seeks, [1.3]);
});

test("a paused video, one run dry, and one that moves are never nudged", () => {
  const paused = new StandInVideo();
  paused.ranges = [[0, 2]];
  paused.paused = true; // the jitter buffer holds it
  const dry = new StandInVideo();
  dry.ranges = [[0, 1]];
  dry.currentTime = 1 - FRAME / 2; // less than a frame ahead: an underrun, the jitter buffer's to handle
  const moving = new StandInVideo();
  moving.ranges = [[0, 10]];
  const watchers = [player(paused), player(dry), player(moving)];
  for (let now = 0; now <= 5 * STUCK_MS; now += 50) {
    moving.currentTime += 0.05;
    for (const watcher of watchers) watcher.poll(now);
  }
  assert.deepEqual(watchers.map((watcher) => watcher.nudges), [0, 0, 0]);
  assert.deepEqual([paused.seeks, dry.seeks, moving.seeks], [[], [], []]);
});

test("nudges that do not get the video going fail the player; one that moves again starts the count over", () => {
  const video = new StandInVideo();
  video.ranges = [[0, 5]];
  video.currentTime = 1;
  const failures: string[] = [];
  const watcher = player(video, failures);
  let now = 0;
  const standStill = () => {
    for (const end = now + STUCK_MS + 100; now <= end; now += 50) watcher.poll(now);
  };
  standStill();
  standStill();
  assert.equal(watcher.nudges, 2);
  video.currentTime += 0.2; // it played on
  watcher.poll((now += 50));
  for (let round = 0; round < NUDGES_IN_ROW; round++) standStill();
  assert.equal(watcher.nudges, 2 + NUDGES_IN_ROW);
  assert.deepEqual(failures, []);
  standStill(); // one more: it fails instead
  assert.equal(watcher.nudges, 2 + NUDGES_IN_ROW);
  assert.equal(failures.length, 1);
  assert.match(failures[0], /stood still/);
  assert.match(watcher.failure ?? "", /nudged 3 times/);
});
