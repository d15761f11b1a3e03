// The official TypeScript SDK client (npm @modelcontextprotocol/sdk) run twice on one session, as a client
// that saved its session id does: the second run gives StreamableHTTPClientTransport that id, sends no
// initialize, and numbers its requests from 0 again (the first run's initialize was 0). tests/test_request_ids.py
// copies this file beside the installed SDK and runs it: node ts_sdk_client.mjs <MCP endpoint URL>.
// It prints one JSON line: each call's text, as each run got it (an error's message instead of a result).
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const url = new URL(process.argv[2]);

async function call(client, name, args) {
  try {
    const result = await client.callTool({ name, arguments: args }, undefined, { timeout: 30_000 });
    const text = result.content.map((block) => block.text ?? "").join("");
    return result.isError ? `error: ${text}` : text;
  } catch (error) {
    return `error: ${error.message}`;
  }
}

const first = new Client({ name: "run-1", version: "1.0.0" });
const firstTransport = new StreamableHTTPClientTransport(url);
await first.connect(firstTransport);
const sessionId = firstTransport.sessionId;
const run1 = [await call(first, "echo", { text: "hello from run 1" }), await call(first, "add", { a: 1, b: 2 })];
await firstTransport.close(); // leaves the session: no DELETE

const second = new Client({ name: "run-2", version: "1.0.0" });
const secondTransport = new StreamableHTTPClientTransport(url, { sessionId });
await second.connect(secondTransport); // a session id already: no initialize
const run2 = [await call(second, "echo", { text: "hello from run 2" }), await call(second, "add", { a: 40, b: 2 })];
await secondTransport.terminateSession();
await secondTransport.close();

console.log(JSON.stringify({ sessionId, run1, run2 }));
