// A client of the official TypeScript SDK (npm @modelcontextprotocol/sdk) running tool calls with progress
// in a loop, its history recorded: the twin of faults/client.py (read its docstring; the records are the
// same, faults/history.py). Run by the campaign as
//   node faults/client.mjs --packages DIR --url URL --out FILE --client ID --loops N --stop-file PATH ...
// where DIR holds node_modules with the pinned SDK and undici (faults/tsclient.py installs them there,
// outside the repository).
//
// Every request opens its own connection (an undici Agent with pipelining 0: no keep-alive), so the
// balancer spreads them all. The SDK reconnects and resumes as it does (GET + Last-Event-ID), with
// --patience attempts instead of its 2. The TS SDK gives a stream up without failing its request (it
// reports "Maximum reconnection attempts exceeded" on the transport's onerror and the request waits for its
// timeout): a call that reaches its deadline after its transport reported such an error is recorded as
// that error, one with no report as a timeout.

import { closeSync, existsSync, openSync, writeSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const DELAY = 0.1;
const INIT_TIMEOUT_MS = 20000;
const ERROR_PAUSE_MS = 500; // after a call's error, before the next call
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function parseArgs(argv) {
  const args = { loops: 2, seed: 0, deadline: 30, patience: 8, maxSeconds: 7200 };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    args[key] = argv[i + 1];
  }
  for (const key of ["loops", "seed", "deadline", "patience", "maxSeconds"]) args[key] = Number(args[key]);
  return args;
}

const started = Date.now() / 1000;
const stopping = () => existsSync(args.stopFile) || Date.now() / 1000 > started + args.maxSeconds;

const args = parseArgs(process.argv.slice(2));
const load = (path) => import(pathToFileURL(join(args.packages, "node_modules", path)).href);
const { Client } = await load("@modelcontextprotocol/sdk/dist/esm/client/index.js");
const { StreamableHTTPClientTransport } = await load("@modelcontextprotocol/sdk/dist/esm/client/streamableHttp.js");
const { McpError } = await load("@modelcontextprotocol/sdk/dist/esm/types.js");
const undiciModule = await load("undici/index.js");
const undici = undiciModule.default ?? undiciModule;
const agent = new undici.Agent({ pipelining: 0 });

const fd = openSync(args.out, "a");
function record(ev, fields = {}) {
  writeSync(fd, JSON.stringify({ ev, t: Date.now() / 1000, client: args.client, ...fields }) + "\n");
}

// A seeded generator (mulberry32) so a replayed run draws the same call sizes.
function rng(seedText) {
  let h = 1779033703 ^ seedText.length;
  for (let i = 0; i < seedText.length; i++) {
    h = Math.imul(h ^ seedText.charCodeAt(i), 3432918353);
    h = (h << 13) | (h >>> 19);
  }
  let a = h >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function reasonOf(body) {
  const data = body?.error?.data;
  return data && typeof data === "object" && "reason" in data ? String(data.reason) : null;
}

function loggingFetch(state) {
  return async (url, init = {}) => {
    const response = await undici.fetch(url, { ...init, dispatcher: agent });
    const sid = response.headers.get("mcp-session-id");
    if (sid && state.sid === null) state.sid = sid;
    if (response.status >= 400) {
      let reason = null;
      let text = "";
      try {
        text = await response.clone().text();
        reason = reasonOf(JSON.parse(text));
      } catch {}
      const asked = new Headers(init.headers ?? {}).get("mcp-session-id");
      const unexplained = reason === null ? { body: text.slice(0, 200) } : {};
      record("http", {
        conn: state.conn, method: init.method ?? "GET", status: response.status, reason, sid: asked, tag: state.tag,
        ...unexplained,
      });
      if (response.status === 404 && asked) state.gone = true;
    }
    return response;
  };
}

// The transport, with every request sent and every response passed on recorded.
class Tap {
  constructor(inner, state) {
    this.inner = inner;
    this.state = state;
    inner.onmessage = (message, extra) => {
      if ("id" in message && ("result" in message || "error" in message)) {
        const kind = "error" in message ? "error" : "result";
        record("response", { conn: state.conn, rid: message.id, kind, sid: state.sid });
      }
      this.onmessage?.(message, extra);
    };
    inner.onerror = (error) => {
      state.transportErrors.push(String(error?.message ?? error));
      if (state.tag !== null) record("transport_error", { conn: state.conn, tag: state.tag, message: String(error?.message ?? error) });
      this.onerror?.(error);
    };
    inner.onclose = () => this.onclose?.();
  }
  get sessionId() { return this.inner.sessionId; }
  setProtocolVersion(version) { this.inner.setProtocolVersion?.(version); }
  start() { return this.inner.start(); }
  close() { return this.inner.close(); }
  send(message, options) {
    if ("method" in message && "id" in message) {
      const tag = message.params?.arguments?.tag ?? null;
      record("sent", { conn: this.state.conn, rid: message.id, method: message.method, tag });
    }
    return this.inner.send(message, options);
  }
}

async function runCall(client, state, tag, steps) {
  state.tag = tag;
  state.transportErrors = [];
  record("call", { conn: state.conn, tag, sid: state.sid, steps });
  try {
    const result = await client.callTool({ name: "work", arguments: { tag, steps, delay: DELAY } }, undefined, {
      onprogress: (p) => record("progress", { tag, p: p.progress }),
      timeout: args.deadline * 1000,
    });
    const text = result.content?.[0]?.text ?? null;
    if (!result.isError) {
      record("result", { tag, text });
      return true;
    }
    record("error", { tag, code: null, message: `tool error: ${text}`, reason: null });
  } catch (error) {
    const timedOut = error instanceof McpError && error.code === -32001;
    if (timedOut && state.transportErrors.length === 0) {
      record("timeout", { tag });
      state.gone = true;
    } else if (timedOut) {
      const message = `transport gave up: ${state.transportErrors.at(-1)}`;
      record("error", { tag, code: null, message, reason: null });
      state.gone = true;
    } else {
      // An HTTP error answer reaches the caller as the SDK's StreamableHTTPError, its body in the message.
      const quoted = String(error?.message ?? "").match(/"reason":"([^"]+)"/);
      const reason = error instanceof McpError ? reasonOf({ error: { data: error.data } }) : (quoted?.[1] ?? null);
      record("error", { tag, code: error?.code ?? null, message: String(error?.message ?? error).slice(0, 300), reason });
    }
  } finally {
    state.tag = null;
  }
  return false;
}

async function sessionLoop(loop) {
  const draw = rng(`${args.seed}:${args.client}:${loop}`);
  let sessions = 0;
  let calls = 0;
  while (!stopping()) {
    const state = { conn: `${loop}.${sessions}`, sid: null, tag: null, gone: false, transportErrors: [] };
    sessions += 1;
    const transport = new StreamableHTTPClientTransport(new URL(args.url), {
      fetch: loggingFetch(state),
      reconnectionOptions: {
        initialReconnectionDelay: 500, maxReconnectionDelay: 5000, reconnectionDelayGrowFactor: 1.5, maxRetries: args.patience,
      },
    });
    const client = new Client({ name: `faults-${args.client}`, version: "1.0.0" });
    try {
      await client.connect(new Tap(transport, state), { timeout: INIT_TIMEOUT_MS });
      record("session", { conn: state.conn, sid: state.sid });
      while (!stopping() && !state.gone) {
        calls += 1;
        const ok = await runCall(client, state, `${args.client}-${loop}-${calls}`, 20 + Math.floor(draw() * 21));
        if (!ok) await sleep(ERROR_PAUSE_MS);
      }
    } catch (error) {
      record("init_error", { conn: state.conn, message: String(error?.message ?? error).slice(0, 300) });
      await sleep(ERROR_PAUSE_MS);
    } finally {
      await client.close().catch(() => {});
    }
  }
}

record("client", { sdk: "typescript" });
await Promise.all(Array.from({ length: args.loops }, (_, loop) => sessionLoop(loop)));
record("done");
closeSync(fd);
await agent.close().catch(() => {});
process.exit(0);
