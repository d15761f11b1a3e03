// An MCP upstream made with the official TypeScript SDK (npm @modelcontextprotocol/sdk), as a real server
// behaves: one StreamableHTTPServerTransport per session, over node:http. tests/support/ts_sdk.py installs
// the SDK outside the repository, copies this file beside it and runs it; it prints its URL on stdout.
//
// Tools: "echo" answers its text at once; "slow" runs until it is cancelled (or "ms" milliseconds pass).
// The SDK never answers a request cancelled with notifications/cancelled (the spec: the receiver SHOULD
// NOT respond), so the POST stream of a cancelled "slow" call stays open until its client leaves.
// GET /stats: {"open": POST responses still open, "cancelled": calls cancelled, "finished": calls done}.
import { createServer } from "node:http";
import { randomUUID } from "node:crypto";
import { Server } from "@modelcontextprotocol/sdk/server/index.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { CallToolRequestSchema, ListToolsRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const transports = new Map();
const stats = { open: 0, cancelled: 0, finished: 0 };

function build() {
  const server = new Server({ name: "ts-sdk-upstream", version: "1.0.0" }, { capabilities: { tools: {} } });
  server.setRequestHandler(ListToolsRequestSchema, async () => ({
    tools: [
      { name: "echo", inputSchema: { type: "object", properties: { text: { type: "string" } } } },
      { name: "slow", inputSchema: { type: "object", properties: { ms: { type: "number" } } } },
    ],
  }));
  server.setRequestHandler(CallToolRequestSchema, async (request, extra) => {
    const args = request.params.arguments ?? {};
    if (request.params.name === "echo") {
      return { content: [{ type: "text", text: String(args.text ?? "") }] };
    }
    const ms = typeof args.ms === "number" ? args.ms : 3_600_000;
    const cancelled = await new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), ms);
      extra.signal.addEventListener("abort", () => {
        clearTimeout(timer);
        resolve(true);
      });
    });
    if (cancelled) stats.cancelled += 1;
    else stats.finished += 1;
    return { content: [{ type: "text", text: "slow done" }] };
  });
  return server;
}

const http = createServer(async (req, res) => {
  if (req.url === "/stats") {
    res.writeHead(200, { "Content-Type": "application/json" }).end(JSON.stringify(stats));
    return;
  }
  if (req.method === "POST") {
    stats.open += 1;
    res.on("close", () => {
      stats.open -= 1;
    });
  }
  const sessionId = req.headers["mcp-session-id"];
  let transport = sessionId === undefined ? undefined : transports.get(sessionId);
  if (transport === undefined) {
    if (sessionId !== undefined || req.method !== "POST") {
      res.writeHead(404, { "Content-Type": "application/json" }).end(
        JSON.stringify({ jsonrpc: "2.0", error: { code: -32001, message: "Session not found" }, id: null }),
      );
      return;
    }
    transport = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      onsessioninitialized: (id) => transports.set(id, transport),
    });
    transport.onclose = () => {
      if (transport.sessionId !== undefined) transports.delete(transport.sessionId);
    };
    await build().connect(transport);
  }
  await transport.handleRequest(req, res);
});

http.listen(0, "127.0.0.1", () => {
  process.stdout.write(`http://127.0.0.1:${http.address().port}/mcp\n`);
});
