#!/usr/bin/env node
// A specdec client written from the .proto alone: it loads protos/specdec/v1/specdec.proto at run
// time (@grpc/proto-loader) and streams one generation over @grpc/grpc-js.
//
//   node clients/node/generate.js --server HOST:PORT (--prompt TEXT | --prompt-ids 3,4,5)
//        [--max-new-tokens N] [--tau T] [--tree-budget B] [--proposer draft|lookup|hybrid]
//        [--temperature X] [--seed S] [--target-only]
//
// Draft.Generate (speculative) unless --target-only (Verify.Generate on a verify service). Prints
// one JSON object: token_ids, text, finish_reason, seed, stats. A gRPC error exits 1 with
// "CODE: details" on stderr.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "..", "..", "protos", "specdec", "v1", "specdec.proto");
const FLAGS = {
  "--server": "server", "--prompt": "prompt", "--prompt-ids": "promptIds", "--max-new-tokens": "maxNewTokens",
  "--tau": "tau", "--tree-budget": "treeBudget", "--proposer": "proposer", "--temperature": "temperature",
  "--seed": "seed", "--timeout": "timeout",
};

function parse(argv) {
  const a = { maxNewTokens: "64", timeout: "120", targetOnly: false };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--target-only") { a.targetOnly = true; continue; }
    const key = FLAGS[argv[i]];
    if (key === undefined || i + 1 >= argv.length) throw new Error(`unknown flag or missing value: ${argv[i]}`);
    a[key] = argv[++i];
  }
  if (!a.server) throw new Error("--server is required");
  if ((a.prompt === undefined) === (a.promptIds === undefined)) throw new Error("give exactly one of --prompt and --prompt-ids");
  return a;
}

function uint(text, flag) {
  if (!/^\d+$/.test(text)) throw new Error(`${flag} must be a whole number >= 0, got ${JSON.stringify(text)}`);
  return Number(text);
}

function request(a) {
  const req = { max_new_tokens: uint(a.maxNewTokens, "--max-new-tokens") };
  if (a.prompt !== undefined) req.prompt = a.prompt;
  else req.prompt_ids = a.promptIds.split(",").map((x) => uint(x.trim(), "--prompt-ids"));
  if (a.tau !== undefined) req.num_draft_tokens = uint(a.tau, "--tau");
  if (a.treeBudget !== undefined) req.tree_budget = uint(a.treeBudget, "--tree-budget");
  if (a.proposer !== undefined) req.proposer = "PROPOSER_" + a.proposer.toUpperCase();
  if (a.temperature !== undefined || a.seed !== undefined) {
    req.sampling = { temperature: Number(a.temperature || 0) };
    if (a.seed !== undefined) req.sampling.seed = a.seed;  // uint64: a decimal string
  }
  return req;
}

function main() {
  const a = parse(process.argv.slice(2));
  const def = protoLoader.loadSync(PROTO, { keepCase: true, longs: String, enums: String, defaults: true });
  const v1 = grpc.loadPackageDefinition(def).specdec.v1;
  const Service = a.targetOnly ? v1.Verify : v1.Draft;
  const stub = new Service(a.server, grpc.credentials.createInsecure());
  const deadline = new Date(Date.now() + 1000 * Number(a.timeout));
  const out = { token_ids: [], text: "", finish_reason: null, seed: null, stats: null };
  const call = stub.Generate(request(a), { deadline });
  call.on("data", (r) => {
    out.token_ids.push(...r.token_ids);
    out.text += r.text;
    if (r.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      out.finish_reason = r.finish_reason;
      out.seed = r.seed;
      out.stats = r.stats;
    }
  });
  call.on("error", (e) => {
    process.stderr.write(`${grpc.status[e.code]}: ${e.details}\n`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    if (!process.exitCode) process.stdout.write(JSON.stringify(out) + "\n");
    stub.close();
  });
}

try {
  main();
} catch (e) {
  process.stderr.write(`error: ${e.message}\n`);
  process.exitCode = 2;
}
