// A Kakeya client on grpc-js: create a session, append tokens, stream a generation.
// Usage: node kakeya_client.js HOST:PORT PROTO_ROOT MAX_TOKENS
// Prints one JSON line: {"session_id", "lengths", "tokens", "done"}.
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, root, maxTokens] = process.argv.slice(2);
const definition = loader.loadSync("kakeya/v1/runtime.proto", {
  includeDirs: [root],
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const kakeya = grpc.loadPackageDefinition(definition).kakeya.v1;
const client = new kakeya.RuntimeService(target, grpc.credentials.createInsecure());

const unary = (method, request) =>
  new Promise((resolve, reject) =>
    client[method](request, (err, reply) => (err ? reject(err) : resolve(reply))),
  );

async function main() {
  const { session_id } = await unary("CreateSession", {});
  const lengths = [];
  for (let i = 1; i <= 5; i++) {
    const reply = await unary("AppendTokens", { session_id, token_ids: [i] });
    lengths.push(Number(reply.history_length));
  }
  const tokens = [];
  let done = null;
  await new Promise((resolve, reject) => {
    const call = client.Generate({ session_id, max_tokens: Number(maxTokens), seed: 1 });
    call.on("data", (m) => {
      if (m.payload === "token_id") tokens.push(Number(m.token_id));
      else if (m.payload === "done") done = m.done;
    });
    call.on("error", reject);
    call.on("end", resolve);
  });
  console.log(JSON.stringify({ session_id, lengths, tokens, done }));
  client.close();
}

main().catch((err) => {
  console.error(String(err));
  process.exit(1);
});
