/** The avc1 codec string an init segment declares (its avcC box's profile, compatibility and level). */
export function codecOf(init) {
    for (let i = 0; i + 8 < init.length; i++) {
        if (init[i] === 0x61 && init[i + 1] === 0x76 && init[i + 2] === 0x63 && init[i + 3] === 0x43) { // "avcC"
            const hex = (byte) => byte.toString(16).padStart(2, "0").toUpperCase();
            return `avc1.${hex(init[i + 5])}${hex(init[i + 6])}${hex(init[i + 7])}`;
        }
    }
    return "avc1.42E01E"; // constrained baseline, level 3.0: what worldserve's encoder makes by default
}
export class H264Player {
    video;
    fps;
    client;
    source = null;
    buffer = null;
    appends = [];
    placed = [];
    keys = []; // frame numbers of the keyframes appended
    frames = 0;
    /** Chunks whose first frame was shown, in order. */
    shown = [];
    /** Why playback stopped for good (an unsupported codec, a rejected fragment), or null. */
    failure = null;
    constructor(video, fps, 
    /** Acks each chunk as its first frame is shown (a client made with `autoAck: false`). */
    client) {
        this.video = video;
        this.fps = fps;
        this.client = client;
        video.muted = true;
        video.playsInline = true;
        const watch = (_now, meta) => {
            this.showing(Math.round(meta.mediaTime * this.fps));
            video.requestVideoFrameCallback(watch);
        };
        video.requestVideoFrameCallback(watch);
    }
    /** Play a chunk of an h264 session (chunks in the order they came). */
    push(chunk) {
        if (chunk.media !== "h264" || this.failure)
            return;
        const bytes = chunk.payloads[0] ?? new Uint8Array();
        const initBytes = chunk.header.frames.init_bytes ?? 0;
        if (!this.source) {
            if (!initBytes)
                return this.client?.ack(chunk.seq); // nothing to start from yet: the init comes first
            const type = `video/mp4; codecs="${codecOf(bytes.subarray(0, initBytes))}"`;
            if (typeof MediaSource === "undefined" || !MediaSource.isTypeSupported(type)) {
                this.failure = `${type} cannot be played here`;
                return;
            }
            this.open(type);
        }
        if (chunk.header.frames.keyframe)
            this.keys.push(this.frames);
        this.placed.push({ seq: chunk.seq, start: this.frames, count: chunk.header.frames.count, shown: false });
        this.frames += chunk.header.frames.count;
        this.appends.push(bytes);
        this.feed();
    }
    open(type) {
        const source = new MediaSource();
        this.source = source;
        this.video.src = URL.createObjectURL(source);
        source.addEventListener("sourceopen", () => {
            const buffer = source.addSourceBuffer(type);
            buffer.mode = "sequence"; // fragments one after another, whatever their own timestamps
            buffer.addEventListener("updateend", () => this.feed());
            this.buffer = buffer;
            this.feed();
            void this.video.play().catch(() => undefined);
        }, { once: true });
    }
    feed() {
        const buffer = this.buffer;
        if (!buffer || buffer.updating)
            return;
        const next = this.appends.shift();
        if (next) {
            try {
                buffer.appendBuffer(next);
            }
            catch (error) {
                this.failure = `a fragment was refused: ${String(error)}`;
            }
            return;
        }
        // Trim what was played, up to the last keyframe over a second old (a cut inside a group of pictures would
        // drop the frames that depend on it).
        const cut = this.keys.filter((frame) => frame / this.fps <= this.video.currentTime - 1).pop();
        if (cut !== undefined && buffer.buffered.length && cut / this.fps > buffer.buffered.start(0) + 0.5 / this.fps) {
            this.keys.splice(0, this.keys.indexOf(cut));
            buffer.remove(0, cut / this.fps);
        }
    }
    showing(frame) {
        for (const placed of this.placed) {
            if (!placed.shown && placed.start <= frame) {
                placed.shown = true; // shown, or passed over (the video jumped): either way it is playing no more
                this.shown.push(placed.seq);
                this.client?.ack(placed.seq);
            }
        }
        while (this.placed.length > 64 && this.placed[0].shown)
            this.placed.shift();
    }
}
