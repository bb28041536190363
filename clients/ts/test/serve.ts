// A real worldserve server for the client's tests: `python -m worldserve serve ARGS` on a free port, handed
// over once /healthz answers. WORLDSERVE_PYTHON names the Python that has worldserve installed (default: the
// repository's .venv).
import { spawn } from "node:child_process";
import { once } from "node:events";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

export const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");
const python = process.env.WORLDSERVE_PYTHON ?? join(root, ".venv", "bin", "python");

export interface Served {
  /** Its /v1/world URL. */
  url: string;
  port: number;
  /** What it printed so far. */
  log(): string;
  stop(): void;
}

async function freePort(): Promise<number> {
  const probe = createServer();
  probe.listen(0, "127.0.0.1");
  await once(probe, "listening");
  const address = probe.address();
  probe.close();
  if (address === null || typeof address === "string") throw new Error("no port");
  return address.port;
}

export async function serve(args: string[], env: NodeJS.ProcessEnv = process.env): Promise<Served> {
  const port = await freePort();
  const server = spawn(python, ["-m", "worldserve", "serve", "--port", String(port), "--log-level", "warning", ...args],
    { cwd: root, env, stdio: ["ignore", "pipe", "pipe"] });
  let log = "";
  server.stdout?.on("data", (data) => { log += data; });
  server.stderr?.on("data", (data) => { log += data; });
  const deadline = Date.now() + 120_000;
  for (;;) {
    if (server.exitCode !== null) throw new Error(`server exited: ${log}`);
    try {
      const reply = await fetch(`http://127.0.0.1:${port}/healthz`);
      if (reply.ok) break;
    } catch {
      // not up yet
    }
    if (Date.now() > deadline) throw new Error(`server not healthy: ${log}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  return { url: `ws://127.0.0.1:${port}/v1/world`, port, log: () => log, stop: () => { server.kill("SIGTERM"); } };
}
