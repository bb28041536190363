// Copies the built package's modules (dist/src/*.js) to where the server serves them, /static/client/, so the
// bundled player imports the package itself: `npm run ship` after a change to src/ (test/shipped.test.ts fails
// until the served copy is the build's). The copy is committed, so serving the page needs no Node.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const built = join(here, "..", "dist", "src");
const served = join(here, "..", "..", "..", "src", "worldserve", "server", "static", "client");
rmSync(served, { recursive: true, force: true });
mkdirSync(served, { recursive: true });
for (const name of readdirSync(built).filter((name) => name.endsWith(".js"))) {
  copyFileSync(join(built, name), join(served, name));
  console.log(`shipped ${name}`);
}
