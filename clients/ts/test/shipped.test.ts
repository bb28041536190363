// The copy of the package that the server serves to the bundled player (/static/client/) is this build's, file
// for file: a change to src/ not shipped with `npm run ship` fails here.
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import assert from "node:assert/strict";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url)); // dist/test
const built = join(here, "..", "src");
const served = join(here, "..", "..", "..", "..", "src", "worldserve", "server", "static", "client");

test("the player's served copy of the package is this build, file for file", () => {
  const modules = (folder: string) => readdirSync(folder).filter((name) => name.endsWith(".js")).sort();
  assert.deepEqual(modules(served), modules(built), "run `npm run ship` in clients/ts");
  for (const name of modules(built)) {
    const same = readFileSync(join(built, name), "utf8") === readFileSync(join(served, name), "utf8");
    assert.ok(same, `static/client/${name} is not this build's: run \`npm run ship\` in clients/ts`);
  }
});
