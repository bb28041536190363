// Generates src/messages.ts, the wire messages' types, from docs/protocol.schema.json (the server's
// pydantic models are its source: `python -m worldserve.server.messages`), with json-schema-to-typescript.
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { compile } from "json-schema-to-typescript";

const here = dirname(fileURLToPath(import.meta.url));
const schemaPath = join(here, "..", "..", "..", "docs", "protocol.schema.json");
const schema = JSON.parse(readFileSync(schemaPath, "utf8"));
const titles = { client_to_server: "ClientMessage", server_to_client: "ServerMessage" };
const options = { bannerComment: "", additionalProperties: false, ignoreMinAndMaxItems: true, unreachableDefinitions: true };
const parts = [
  "// Generated from docs/protocol.schema.json by scripts/gen-messages.mjs (npm run gen): do not edit.",
  "/* eslint-disable */",
];
for (const [name, title] of Object.entries(titles)) {
  // Each direction is its own namespace: the two halves of the schema reuse definition names.
  const source = await compile({ ...schema[name], title }, title, options);
  parts.push(`export namespace ${title}s {`, source.replace(/^/gm, "  "), "}");
}
writeFileSync(join(here, "..", "src", "messages.ts"), parts.join("\n") + "\n");
