// The official TypeScript SDK client (npm @modelcontextprotocol/sdk 1.x: the handshake era) against the era
// bridge: a call with progress, a ping, a call whose upstream asks for input (an elicitation it answers), one
// whose upstream asks for it in an event stream after progress (answered, progress again, the result), then
// DELETE. tests/test_bridge.py copies this file beside the installed SDK and runs it:
// node ts_bridge_client.mjs <MCP endpoint URL>. It prints one JSON line of what it got.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const url = new URL(process.argv[2]);
const client = new Client({ name: "ts-bridge", version: "1.0.0" }, { capabilities: { elicitation: {} } });
const asked = [];
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  asked.push(request.params.message);
  return { action: "accept", content: { word: "kumquat" } };
});
const transport = new StreamableHTTPClientTransport(url);
await client.connect(transport);
const text = (result) => result.content.map((block) => block.text ?? "").join("");
const progress = [];
const counted = await client.callTool(
  { name: "count_slowly", arguments: { n: 3 } },
  undefined,
  { timeout: 30_000, onprogress: (p) => progress.push(p.progress) },
);
await client.ping();
const answered = await client.callTool({ name: "ask", arguments: { question: "A fruit?" } }, undefined, {
  timeout: 30_000,
});
const progressLater = [];
const answeredLater = await client.callTool(
  { name: "ask_later", arguments: { question: "A fruit?" } },
  undefined,
  { timeout: 30_000, onprogress: (p) => progressLater.push(p.progress) },
);
const version = client.getServerVersion();
await transport.terminateSession();
await transport.close();
console.log(
  JSON.stringify({
    counted: text(counted),
    progress,
    answered: text(answered),
    answeredLater: text(answeredLater),
    progressLater,
    asked,
    server: version?.name,
  }),
);
