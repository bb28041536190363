// @worldserve/client: worldserve's session protocol, typed from docs/protocol.schema.json.
export * from "./client.js";
export * from "./webrtc.js";
export * from "./h264.js";
