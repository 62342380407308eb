// agentkv's contract from Node.js: stubs built from protos/ at run time by the official
// @grpc/grpc-js and @grpc/proto-loader; nothing generated, nothing of the Python side.
// tests/test_other_language.py runs it against real store and worker processes and compares
// the one JSON object it prints with what the Python SDK gets.
// Usage: node contract.mjs '{"store": "HOST:PORT", "worker": "HOST:PORT", ...}'
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { blake2b } from "@noble/hashes/blake2";

const PROTOS = fileURLToPath(new URL("../../protos/", import.meta.url));
const HERE = fileURLToPath(new URL(".", import.meta.url)); // health.proto
const CALL_SECONDS = 60; // every call's deadline: a stuck server fails the test, never hangs it
const LOAD = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

function load(files) {
  const definition = protoLoader.loadSync(files, { ...LOAD, includeDirs: [PROTOS, HERE] });
  return grpc.loadPackageDefinition(definition);
}

const { agentkv } = load(["agentkv/v1/store.proto", "agentkv/worker/v1/worker.proto"]);
const { Health } = load(["health.proto"]).grpc.health.v1;
const options = () => ({ deadline: Date.now() + CALL_SECONDS * 1000 });
const hex = (bytes) => Buffer.from(bytes).toString("hex");

function unary(client, method, request) {
  return new Promise((resolve, reject) =>
    client[method](request, options(), (err, reply) => (err ? reject(err) : resolve(reply))),
  );
}

function readStream(call, onData) {
  return new Promise((resolve, reject) => {
    call.on("data", onData);
    call.on("error", reject);
    call.on("end", resolve);
  });
}

// What a failed call said: its status code, message and "agentkv-error" trailer.
async function failure(promise) {
  try {
    await promise;
  } catch (err) {
    const [error = null] = err.metadata?.get("agentkv-error") ?? [];
    return { code: grpc.status[err.code], details: err.details, error };
  }
  return { code: "OK" };
}

// The block key in store.proto's words: BLAKE2b-256, personalization "agentkv" zero-padded to 16.
function blockKey(fingerprint, parentKey, tokenIds) {
  const le = (n) => { const b = Buffer.alloc(4); b.writeUInt32LE(n); return b; };
  const fp = Buffer.from(fingerprint, "utf8");
  const message = Buffer.concat([
    Buffer.from("agentkv-block-v1", "ascii"),
    le(fp.length), fp,
    le(parentKey.length), parentKey,
    ...tokenIds.map(le),
  ]);
  const personalization = Buffer.alloc(16);
  personalization.write("agentkv", "ascii");
  return Buffer.from(blake2b(message, { dkLen: 32, personalization }));
}

// store.proto's own test vector, read from its text as a reader of the proto would.
function testVector() {
  const text = readFileSync(`${PROTOS}agentkv/v1/store.proto`, "utf8");
  const fingerprint = text.match(/Test vector \(fingerprint "([^"]+)"\)/)[1];
  let parent = Buffer.alloc(0);
  return [...text.matchAll(/tokens \[([\d, ]+)\] under .*-> ([0-9a-f]{64})/g)].map((m) => {
    const tokens = m[1].split(",").map(Number);
    parent = blockKey(fingerprint, parent, tokens);
    return { fingerprint, tokens, expected: m[2], computed: hex(parent) };
  });
}

// A block's tensors with deterministic bytes: two layers, U8 and F16.
function blockTensors(numTokens, seed) {
  const specs = [
    { name: "layers.0.keys.packed", dtype: "U8", shape: [1, 2, numTokens, 16] },
    { name: "layers.1.keys.scales", dtype: "F16", shape: [1, 2, numTokens, 2] },
  ];
  const size = 2 * numTokens * (16 + 2 * 2);
  const data = Buffer.from(Array.from({ length: size }, (_, i) => (i * 37 + seed) % 256));
  return { specs, data };
}

// One PutBlocks stream of a chain of blocks, each header then its bytes in two chunks.
function putChain(store, namespace, fingerprint, spans) {
  const sent = [];
  return new Promise((resolve, reject) => {
    const call = store.PutBlocks(options(), (err, reply) =>
      err ? reject(err) : resolve({ reply, sent }),
    );
    let parent = Buffer.alloc(0);
    for (const [i, token_ids] of spans.entries()) {
      const { specs, data } = blockTensors(token_ids.length, i);
      const header = { namespace, fingerprint, parent_key: parent, token_ids, tensors: specs };
      call.write({ header });
      const half = data.length >> 1;
      call.write({ chunk: data.subarray(0, half) });
      call.write({ chunk: data.subarray(half) });
      const key = blockKey(fingerprint, parent, token_ids);
      const block = { key: hex(key), parent_key: hex(parent), token_ids, tensors: specs };
      sent.push({ ...block, data: hex(data) });
      parent = key;
    }
    call.end();
  });
}

async function getBlocks(store, request) {
  const blocks = [];
  await readStream(store.GetBlocks(request, options()), ({ item, header, chunk }) => {
    if (item === "header") {
      const { key, parent_key, token_ids } = header;
      const tensors = header.tensors.map(({ name, dtype, shape }) => ({
        name, dtype, shape: shape.map(Number),
      }));
      blocks.push({ key: hex(key), parent_key: hex(parent_key), token_ids, tensors, data: "" });
    } else {
      blocks.at(-1).data += hex(chunk);
    }
  });
  return blocks;
}

async function turn(worker, request) {
  const reply = { token_ids: [], text: "", usage: null };
  await readStream(worker.Turn(request, options()), ({ item, tokens, usage }) => {
    if (item === "tokens") {
      reply.token_ids.push(...tokens.token_ids);
      reply.text += tokens.text;
    } else if (item === "usage") {
      reply.usage = usage;
    }
  });
  return reply;
}

async function health(address, services) {
  const client = new Health(address, grpc.credentials.createInsecure());
  const statuses = {};
  for (const service of services) {
    statuses[service] = (await unary(client, "Check", { service })).status;
  }
  client.close();
  return statuses;
}

async function main(config) {
  const insecure = grpc.credentials.createInsecure();
  const store = new agentkv.v1.CacheStore(config.store, insecure);
  const worker = new agentkv.worker.v1.InferenceWorker(config.worker, insecure);
  const { namespace, agent_id, unknown_agent: unknown, fingerprint } = config;
  const messages = [{ role: "user", content: config.question }];
  const sampling = { temperature: 0, max_tokens: config.max_tokens };
  const out = {};

  const create = { namespace, agent_id, system_prompt: config.system };
  out.created = (await unary(worker, "CreateAgent", create)).agent;
  out.turn = await turn(worker, { namespace, agent_id, messages, sampling, durable: true });
  out.described = (await unary(worker, "DescribeAgent", { namespace, agent_id })).agent;
  const formed = { namespace: config.form.namespace, agent_id, system_prompt: config.system };
  await unary(worker, "CreateAgent", formed);
  const format = { json_schema: JSON.stringify(config.form.schema) };
  const held = { ...sampling, max_tokens: config.form.max_tokens };
  out.formed = await turn(worker, { ...formed, messages, sampling: held, format });

  const nobody = { namespace, agent_id: unknown };
  const blockScope = { namespace: config.block_namespace, fingerprint };
  out.failures = {
    describe_unknown: await failure(unary(worker, "DescribeAgent", nobody)),
    turn_unknown: await failure(turn(worker, { ...nobody, messages, sampling })),
    store_get_unknown: await failure(unary(store, "GetAgent", nobody)),
    create_empty_id: await failure(unary(worker, "CreateAgent", { namespace, agent_id: "" })),
    get_no_keys: await failure(getBlocks(store, { ...blockScope, keys: [] })),
  };

  out.vector = testVector();
  const put = await putChain(store, config.block_namespace, fingerprint, config.put_spans);
  out.put = { sent: put.sent, stored: put.reply.blocks.map((b) => ({ ...b, key: hex(b.key) })) };
  const keys = config.read_keys.map((k) => Buffer.from(k, "hex"));
  out.read = await getBlocks(store, { ...blockScope, keys });

  out.health = {
    store: await health(config.store, ["", "agentkv.v1.CacheStore"]),
    worker: await health(config.worker, ["", "agentkv.worker.v1.InferenceWorker"]),
  };
  store.close();
  worker.close();
  return out;
}

console.log(JSON.stringify(await main(JSON.parse(process.argv[2]))));
