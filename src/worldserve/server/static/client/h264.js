/** H.264 constrained baseline, level 3.0: what worldserve's encoder makes by default. */
const BASELINE = "avc1.42E01E";
/** The video playing (not paused, not seeking), frames buffered ahead, and its time standing still this long (at
 * least four frames): it is stuck (a decoder hiccup, a hole in what was buffered), and `poll` nudges it on, as
 * hls.js's gap controller does. Its acks stop with it, so without a nudge the server would hold the stream back.
 * Two seconds: a busy machine's decoder may fall a second behind and catch up, and a nudge (a seek) makes it decode
 * again from the last keyframe. */
export const STUCK_MS = 2000;
/** Nudges in a row that did not get the video going again: playback has stopped for good (the player fails). */
export const NUDGES_IN_ROW = 3;
/** The avc1 codec string an init segment declares (its avcC box's profile, compatibility and level). */
export function codecOf(init) {
    for (let i = 0; i + 8 < init.length; i++) {
        if (init[i] === 0x61 && init[i + 1] === 0x76 && init[i + 2] === 0x63 && init[i + 3] === 0x43) { // "avcC"
            const hex = (byte) => byte.toString(16).padStart(2, "0").toUpperCase();
            return `avc1.${hex(init[i + 5])}${hex(init[i + 6])}${hex(init[i + 7])}`;
        }
    }
    return BASELINE;
}
export class H264Player {
    video;
    fps;
    client;
    options;
    source = null;
    buffer = null;
    url = null;
    appends = [];
    placed = [];
    keys = []; // frame numbers of the keyframes appended
    frames = 0;
    lastFrame = -1;
    closed = false;
    watched; // the video tells each frame it presents (requestVideoFrameCallback)
    stuckAt = -1; // the video's time when it was last seen to move (or was nudged to)
    stuckSince = null; // since when it has stood there while it should play
    nudgesInRow = 0;
    /** Times the video stood still with frames buffered ahead and was nudged on (`STUCK_MS`). */
    nudges = 0;
    /** Chunks whose first frame was shown, in order. */
    shown = [];
    /** Why playback stopped for good (an unsupported codec, a rejected fragment), or null. */
    failure = null;
    constructor(video, fps, 
    /** Acks each chunk as its first frame is shown (a client made with `autoAck: false`). */
    client, options = {}) {
        this.video = video;
        this.fps = fps;
        this.client = client;
        this.options = options;
        video.muted = true;
        video.playsInline = true;
        // A fragment the decoder cannot decode stops the video for good (MEDIA_ERR_DECODE): no frame shows and no chunk
        // is acked again, so the server would wait; the player fails instead (the page starts again in JPEG).
        video.addEventListener("error", () => {
            if (!this.closed && video.error)
                this.fail(`the video stopped: ${video.error.message || `error ${video.error.code}`}`);
        });
        this.watched = typeof video.requestVideoFrameCallback === "function";
        if (this.watched) {
            const watch = (now, meta) => {
                if (this.closed)
                    return;
                this.showing(Math.round(meta.mediaTime * this.fps), meta.expectedDisplayTime || now);
                video.requestVideoFrameCallback(watch);
            };
            video.requestVideoFrameCallback(watch);
        }
    }
    /** Whether this browser can play worldserve's H.264 here (Media Source Extensions and the baseline profile). */
    static playable() {
        return typeof MediaSource !== "undefined" && MediaSource.isTypeSupported(`video/mp4; codecs="${BASELINE}"`);
    }
    /** Play a chunk of an h264 session (chunks in the order they came). */
    push(chunk) {
        if (chunk.media !== "h264" || this.failure || this.closed)
            return;
        const bytes = chunk.payloads[0] ?? new Uint8Array();
        const frames = chunk.header.frames;
        const initBytes = frames.init_bytes ?? 0;
        if (!this.source) {
            if (!initBytes) { // nothing to start from yet: the init comes first
                this.options.onChunkShown?.(chunk.seq, performance.now()); // passed over, never shown
                return this.client?.ack(chunk.seq);
            }
            const type = `video/mp4; codecs="${codecOf(bytes.subarray(0, initBytes))}"`;
            if (typeof MediaSource === "undefined" || !MediaSource.isTypeSupported(type)) {
                return this.fail(`${type} cannot be played here`);
            }
            this.open(type);
        }
        if (frames.keyframe)
            this.keys.push(this.frames);
        this.placed.push({ seq: chunk.seq, start: this.frames, count: frames.count, shown: false });
        this.frames += frames.count;
        this.appends.push(bytes);
        this.feed();
    }
    /** How far the video has buffered ahead of what it shows, in milliseconds. */
    bufferedMs() {
        const { buffered, currentTime } = this.video;
        if (!buffered.length)
            return 0;
        return Math.max(0, (buffered.end(buffered.length - 1) - currentTime) * 1000);
    }
    /** More than a frame is buffered ahead of what the video shows: it has frames to play (one that stops then is
     * stuck, not run dry). */
    hasFrameAhead() {
        return this.bufferedMs() > 1000 / this.fps;
    }
    /** Over `overS` seconds buffered ahead, move the video to `keepS` seconds before the newest frame (a player
     * that fell behind skips what it would show late); whether it moved. */
    jumpToLiveEdge(overS, keepS) {
        const { buffered } = this.video;
        if (!buffered.length)
            return false;
        const end = buffered.end(buffered.length - 1);
        if (end - this.video.currentTime <= overS)
            return false;
        this.video.currentTime = Math.max(0, end - keepS);
        return true;
    }
    /** Call it from the page's animation frame (`now`: performance.now()). A video that stands still while it should
     * play (`STUCK_MS`) is nudged on: to where the next buffered range starts if it stands at a hole, else a frame on;
     * after `NUDGES_IN_ROW` nudges that did not get it going the player fails. Where requestVideoFrameCallback is
     * missing, the frame at the video's current time is taken as shown. */
    poll(now = performance.now()) {
        if (!this.watched)
            this.showing(Math.round(this.video.currentTime * this.fps), now);
        this.unstick(now);
    }
    /** Stop: the video is paused and let go of its source (the caller removes the element). */
    close() {
        if (this.closed)
            return;
        this.closed = true;
        this.video.pause();
        if (this.url)
            URL.revokeObjectURL(this.url);
    }
    fail(reason) {
        if (this.failure)
            return;
        this.failure = reason;
        this.options.onFailure?.(reason);
    }
    open(type) {
        const source = new MediaSource();
        this.source = source;
        this.url = URL.createObjectURL(source);
        this.video.src = this.url;
        source.addEventListener("sourceopen", () => {
            try {
                const buffer = source.addSourceBuffer(type);
                buffer.mode = "sequence"; // fragments one after another, whatever their own timestamps
                buffer.timestampOffset = 0; // the first fragment plays at 0, whatever its decode time
                buffer.addEventListener("updateend", () => this.feed());
                buffer.addEventListener("error", () => this.fail("the SourceBuffer refused a fragment"));
                this.buffer = buffer;
                this.feed();
                if (this.options.autoplay ?? true)
                    void this.video.play().catch(() => undefined);
            }
            catch (error) {
                this.fail(String(error));
            }
        }, { once: true });
    }
    feed() {
        const buffer = this.buffer;
        if (!buffer || buffer.updating || this.closed)
            return;
        const next = this.appends.shift();
        if (next) {
            try {
                buffer.appendBuffer(next);
            }
            catch (error) {
                this.fail(`a fragment was refused: ${String(error)}`);
            }
            return;
        }
        // Trim what was played, up to the last keyframe over a second old (a cut inside a group of pictures would
        // drop the frames that depend on it): the buffer holds at most the current group.
        const cut = this.keys.filter((frame) => frame / this.fps <= this.video.currentTime - 1).pop();
        if (cut !== undefined && buffer.buffered.length && cut / this.fps > buffer.buffered.start(0) + 0.5 / this.fps) {
            this.keys.splice(0, this.keys.indexOf(cut));
            buffer.remove(0, cut / this.fps);
        }
    }
    unstick(now) {
        const video = this.video;
        if (this.closed || this.failure || video.paused || video.seeking || video.ended) {
            this.stuckSince = null; // paused on purpose (the caller's jitter buffer), or nothing to watch
            this.nudgesInRow = 0;
            return;
        }
        const time = video.currentTime;
        if (time !== this.stuckAt) { // it moved by itself
            this.stuckAt = time;
            this.stuckSince = null;
            this.nudgesInRow = 0;
            return;
        }
        if (!this.hasFrameAhead()) { // ran dry: the caller's underrun, not a stuck video
            this.stuckSince = null;
            return;
        }
        if (this.stuckSince === null)
            this.stuckSince = now;
        if (now - this.stuckSince < Math.max(STUCK_MS, 4000 / this.fps))
            return;
        if (this.nudgesInRow >= NUDGES_IN_ROW) {
            return this.fail(`the video stood still at ${time.toFixed(3)} s with frames buffered ahead, nudged ${this.nudgesInRow} times`);
        }
        this.nudgesInRow += 1;
        this.nudges += 1;
        this.stuckSince = now;
        this.stuckAt = this.nudgeTarget(time);
        video.currentTime = this.stuckAt;
    }
    // Where a video stuck at `time` goes: the start of the next buffered range if `time` is in a hole or within a
    // frame of its range's end; else a frame on.
    nudgeTarget(time) {
        const { buffered } = this.video;
        const frame = 1 / this.fps;
        for (let i = 0; i < buffered.length; i++) {
            if (buffered.start(i) > time)
                return buffered.start(i); // a hole before this range
            if (time < buffered.end(i) - frame)
                return time + frame; // inside a range, a frame or more before its end
        }
        return time + frame;
    }
    showing(frame, when) {
        if (frame === this.lastFrame)
            return;
        this.lastFrame = frame;
        let at;
        for (const placed of this.placed) {
            if (placed.start <= frame && frame < placed.start + placed.count)
                at = placed;
            if (!placed.shown && placed.start <= frame) {
                placed.shown = true; // shown, or passed over (the video jumped): either way it is playing no more
                this.shown.push(placed.seq);
                this.options.onChunkShown?.(placed.seq, when);
                this.client?.ack(placed.seq);
            }
        }
        while (this.placed.length > 64 && this.placed[0].shown)
            this.placed.shift();
        if (at)
            this.options.onFrame?.(at.seq, frame - at.start, when);
    }
}
