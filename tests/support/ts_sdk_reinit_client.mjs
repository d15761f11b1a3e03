// The official TypeScript SDK client (npm @modelcontextprotocol/sdk) on one session across an upstream
// restart: tests/test_reinitialize.py copies this file beside the installed SDK and runs it:
// node ts_sdk_reinit_client.mjs <MCP endpoint URL>. It calls add(1, 2), prints one JSON line
// {"sessionId", "first"}, waits for a line on stdin (the test kills the upstream -9 and starts it again
// meanwhile), calls add(2, 2) in the same session, and prints {"sessionId", "second"} (an error's message
// instead of a result).
import { createInterface } from "node:readline";
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

const client = new Client({ name: "reinit", version: "1.0.0" });
const transport = new StreamableHTTPClientTransport(url);
await client.connect(transport);
console.log(JSON.stringify({ sessionId: transport.sessionId, first: await call(client, "add", { a: 1, b: 2 }) }));
const lines = createInterface({ input: process.stdin });
for await (const _ of lines) break;
console.log(JSON.stringify({ sessionId: transport.sessionId, second: await call(client, "add", { a: 2, b: 2 }) }));
await transport.close();
process.exit(0);
