#!/usr/bin/env node
// A specdec client written from the .proto alone: it loads protos/specdec/v1/specdec.proto at run
// time (@grpc/proto-loader) and streams one generation over @grpc/grpc-js.
//
//   node clients/node/generate.js --server HOST:PORT (--prompt TEXT | --prompt-ids 3,4,5)
//        [--max-new-tokens N] [--tau T] [--tree-budget B] [--proposer draft|lookup|hybrid]
//        [--temperature X] [--top-k K] [--top-p P] [--seed S] [--stop TEXT]... [--mode greedy|sparse|dense]
//        [--sparse-k K] [--request-id ID] [--[no-]adaptive] [--[no-]predraft] [--early-stop-p P]
//        [--[no-]add-special-tokens]
//        [--timeout SECONDS (default 120; inf: none)] [--target-only]
//        [--tls-ca PEM] [--tls-cert PEM --tls-key PEM] [--token-file FILE | --token TOKEN]
//
// TLS as the Python client's flags: --tls-ca checks the server's certificate against that CA
// (with only --tls-cert/--tls-key: against Node's built-in roots, not the system's trust store);
// --tls-cert/--tls-key send a client certificate (mTLS). A token goes as `authorization: Bearer
// <token>` metadata; one a header cannot carry is refused (without printing it).
// Draft.Generate (speculative) unless --target-only (Verify.Generate on a verify service). Prints
// one JSON object: token_ids, text, finish_reason, seed (a uint64, as a decimal string), request_id, stats.
// A gRPC error, or a stream that ends without its last chunk, exits 1 with "error: CODE: details" on
// stderr (one line; an error after the last chunk, a deadline during the server's end, leaves the
// result whole); a bad flag exits 2 before anything is sent (the wire would wrap a number out of range).
"use strict";

process.noDeprecation = true;  // stderr is the one error line: grpc-js's TLS to an IP address makes Node warn (DEP0123)

const crypto = require("crypto");
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "..", "..", "protos", "specdec", "v1", "specdec.proto");
const FLAGS = {
  "--server": "server", "--prompt": "prompt", "--prompt-ids": "promptIds", "--max-new-tokens": "maxNewTokens",
  "--tau": "tau", "--tree-budget": "treeBudget", "--proposer": "proposer", "--temperature": "temperature",
  "--seed": "seed", "--timeout": "timeout", "--tls-ca": "tlsCa", "--tls-cert": "tlsCert", "--tls-key": "tlsKey",
  "--token-file": "tokenFile", "--token": "token", "--top-k": "topK", "--top-p": "topP", "--mode": "mode",
  "--sparse-k": "sparseK", "--request-id": "requestId", "--early-stop-p": "earlyStopP",
};
const SWITCHES = { "--adaptive": ["adaptive", true], "--no-adaptive": ["adaptive", false],
  "--predraft": ["predraft", true], "--no-predraft": ["predraft", false],
  "--add-special-tokens": ["addSpecialTokens", true], "--no-add-special-tokens": ["addSpecialTokens", false] };

function parse(argv) {
  const a = { maxNewTokens: "64", timeout: "120", targetOnly: false, stop: [] };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--target-only") { a.targetOnly = true; continue; }
    if (SWITCHES[argv[i]]) { a[SWITCHES[argv[i]][0]] = SWITCHES[argv[i]][1]; continue; }
    if (argv[i] === "--stop" && i + 1 < argv.length) { a.stop.push(argv[++i]); continue; }  // repeatable
    const key = FLAGS[argv[i]];
    if (key === undefined || i + 1 >= argv.length) throw new Error(`unknown flag or missing value: ${argv[i]}`);
    a[key] = argv[++i];
  }
  if (!a.server) throw new Error("--server is required");
  if ((a.prompt === undefined) === (a.promptIds === undefined)) throw new Error("give exactly one of --prompt and --prompt-ids");
  if ((a.tlsCert === undefined) !== (a.tlsKey === undefined)) throw new Error("give --tls-cert and --tls-key together");
  if (a.token !== undefined && a.tokenFile !== undefined) throw new Error("give one of --token and --token-file");
  return a;
}

const PROPOSERS = ["draft", "lookup", "hybrid"];
const MODES = ["greedy", "sparse", "dense"];

function choice(text, flag, names, prefix) {  // an enum by its lower-case short name
  if (!names.includes(text)) throw new Error(`${flag} must be one of ${names.join(", ")}, got ${JSON.stringify(text)}`);
  return prefix + text.toUpperCase();
}

function uint(text, flag, bits = 32) {  // a uint32 (a token id: 31 bits, an int32's range; or a uint64, returned as its decimal string)
  if (!/^\d+$/.test(text) || BigInt(text) >= 2n ** BigInt(bits)) {
    throw new Error(`${flag} must be a whole number in [0, 2^${bits}), got ${JSON.stringify(text)}`);
  }
  return bits > 32 ? BigInt(text).toString() : Number(text);
}

function real(text, flag) {
  const x = Number(text);
  if (text.trim() === "" || !Number.isFinite(x)) throw new Error(`${flag} must be a number, got ${JSON.stringify(text)}`);
  return x;
}

const MIN_TEMPERATURE = 1e-4;  // the services' least sampled temperature (specdec/validation.py); 0 is greedy
const MAX_FLOAT32 = 3.4028234663852886e38;

function temperature(text) {  // a float32 on the wire: 1e-50 would round to 0 (greedy) and 1e39 to inf
  const x = real(text, "--temperature");
  if (x < 0 || (x > 0 && x < MIN_TEMPERATURE) || x > MAX_FLOAT32) {
    throw new Error(`--temperature must be 0 (greedy) or in [${MIN_TEMPERATURE}, ${MAX_FLOAT32}], got ${JSON.stringify(text)}`);
  }
  return x;
}

const MAX_TIMEOUT_S = 1e9;  // beyond this (or inf): no deadline (a Date past its range is invalid: an instant DEADLINE_EXCEEDED)

function deadlineOf(text) {
  const x = /^\+?inf(inity)?$/i.test(text.trim()) ? Infinity : Number(text);  // "inf", as the Python client takes it
  if (text.trim() === "" || !(x > 0)) throw new Error(`--timeout must be seconds > 0 (inf: none), got ${JSON.stringify(text)}`);
  return x > MAX_TIMEOUT_S ? Infinity : new Date(Date.now() + 1000 * x);
}

function readFlag(file, flag) {  // a file a flag names: its bytes, or one line saying why not
  try {
    return fs.readFileSync(file);
  } catch (e) {
    throw new Error(`${flag} ${file}: ${e.code === "ENOENT" ? "no such file" : e.message}`);
  }
}

function credentials(a) {  // the channel's: TLS where any --tls-* flag is given, else plaintext
  if (a.tlsCa === undefined && a.tlsCert === undefined) return grpc.credentials.createInsecure();
  const ca = a.tlsCa === undefined ? null : readFlag(a.tlsCa, "--tls-ca");
  if (ca !== null) {  // a key, an empty or another file went through to the handshake: UNAVAILABLE, blaming the server
    try {
      new crypto.X509Certificate(ca);  // the bundle's first certificate
    } catch (e) {
      throw new Error(`--tls-ca ${a.tlsCa}: no CA certificate in it (${oneLine(e.message)})`);
    }
  }
  const key = a.tlsKey === undefined ? null : readFlag(a.tlsKey, "--tls-key");
  const cert = a.tlsCert === undefined ? null : readFlag(a.tlsCert, "--tls-cert");
  try {
    return grpc.credentials.createSsl(ca, key, cert);
  } catch (e) {  // OpenSSL's own words name no file: which flags they are
    const flags = [a.tlsCa === undefined ? null : "--tls-ca", a.tlsCert === undefined ? null : "--tls-cert/--tls-key"].filter((x) => x);
    throw new Error(`${flags.join(", ")}: not usable TLS files (${oneLine(e.message)})`);
  }
}

function oneLine(text) {
  return String(text).replace(/\s*\n\s*/g, " ").trim();
}

function metadata(a) {  // the bearer token, as the services' --auth-token-file checks it
  const md = new grpc.Metadata();
  const token = a.tokenFile === undefined ? a.token : readFlag(a.tokenFile, "--token-file").toString().trim();
  if (token !== undefined) {
    const where = a.tokenFile === undefined ? "--token" : "--token-file " + a.tokenFile;
    if (token === "") throw new Error(`${where}: empty token`);
    if (!/^[ -~]+$/.test(token)) {  // grpc-js's own refusal quoted the token
      throw new Error(`${where}: the token must be one line of printable ASCII (no line breaks, control or non-ASCII characters)`);
    }
    md.add("authorization", `Bearer ${token}`);
  }
  return md;
}

function probability(text, flag, zero) {  // a float32 in [0, 1]: one that would arrive as 0 is refused
  const p = real(text, flag);
  if (!(p >= 0 && p <= 1)) throw new Error(`${flag} must be in [0, 1] (${zero}), got ${JSON.stringify(text)}`);
  if (p > 0 && Math.fround(p) === 0) throw new Error(`${flag} ${text} arrives as 0 in its float32 field (${zero}): give 0 or a larger value`);
  return p;
}

function request(a) {
  const req = { max_new_tokens: uint(a.maxNewTokens, "--max-new-tokens") };
  if (a.prompt !== undefined) req.prompt = a.prompt;
  else req.prompt_ids = a.promptIds.split(",").map((x) => uint(x.trim(), "--prompt-ids", 31));  // int32 on the wire
  if (a.tau !== undefined) req.num_draft_tokens = uint(a.tau, "--tau");
  if (a.treeBudget !== undefined) req.tree_budget = uint(a.treeBudget, "--tree-budget");
  if (a.proposer !== undefined) req.proposer = choice(a.proposer, "--proposer", PROPOSERS, "PROPOSER_");
  if (a.mode !== undefined) req.proposal_mode = choice(a.mode, "--mode", MODES, "PROPOSAL_MODE_");
  if (a.sparseK !== undefined) req.sparse_k = uint(a.sparseK, "--sparse-k");
  if (a.requestId !== undefined) req.request_id = a.requestId;
  if (a.stop.length) req.stop = a.stop;
  for (const k of ["adaptive", "predraft"]) if (a[k] !== undefined) req[k] = a[k];
  if (a.addSpecialTokens !== undefined) req.add_special_tokens = a.addSpecialTokens;
  if (a.earlyStopP !== undefined) req.early_stop_p = probability(a.earlyStopP, "--early-stop-p", "0: off");
  if ([a.temperature, a.seed, a.topK, a.topP].some((x) => x !== undefined)) {
    req.sampling = { temperature: a.temperature === undefined ? 0 : temperature(a.temperature) };
    if (a.seed !== undefined) req.sampling.seed = uint(a.seed, "--seed", 64);  // uint64: a decimal string
    if (a.topK !== undefined) req.sampling.top_k = uint(a.topK, "--top-k");
    if (a.topP !== undefined) req.sampling.top_p = probability(a.topP, "--top-p", "0: unset, i.e. 1");
  }
  return req;
}

function main() {
  const a = parse(process.argv.slice(2));
  const req = request(a);  // a bad flag throws here, before anything connects
  const deadline = deadlineOf(a.timeout);
  const creds = credentials(a), md = metadata(a);  // a file that cannot be read throws here too
  const def = protoLoader.loadSync(PROTO, { keepCase: true, longs: String, enums: String, defaults: true });
  const v1 = grpc.loadPackageDefinition(def).specdec.v1;
  const Service = a.targetOnly ? v1.Verify : v1.Draft;
  const stub = new Service(a.server, creds);
  const out = { token_ids: [], text: "", finish_reason: null, seed: null, request_id: "", stats: null };
  const call = stub.Generate(req, md, { deadline });
  call.on("data", (r) => {
    out.token_ids.push(...r.token_ids);
    out.text += r.text;
    if (r.request_id) out.request_id = r.request_id;
    if (r.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      // "length", as the Python CLI's --json; a value this .proto does not name (a newer server's) "unknown_N"
      out.finish_reason = typeof r.finish_reason === "number" ? `unknown_${r.finish_reason}`
        : r.finish_reason.replace(/^FINISH_REASON_/, "").toLowerCase();
      out.seed = r.seed;
      out.stats = r.stats;
    }
  });
  let done = false;
  const finish = () => {  // once, at the stream's end or its error, whichever comes first
    if (done) return;
    done = true;
    if (!process.exitCode && out.finish_reason === null) {
      process.stderr.write("error: INTERNAL: the stream ended without its last chunk\n");
      process.exitCode = 1;
    }
    if (!process.exitCode) process.stdout.write(JSON.stringify(out) + "\n");
    stub.close();
  };
  call.on("error", (e) => {
    // after the last chunk (a deadline during the server's end) the result is whole: not an error
    if (out.finish_reason === null && !done) {
      process.stderr.write(`error: ${grpc.status[e.code]}: ${oneLine(e.details)}\n`);  // the Python CLI's line
      process.exitCode = 1;
    }
    finish();
  });
  call.on("end", finish);
}

try {
  main();
} catch (e) {
  process.stderr.write(`error: ${e.message}\n`);
  process.exitCode = 2;
}
