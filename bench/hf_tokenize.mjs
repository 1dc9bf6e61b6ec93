// Throughput of the reference tokenizer (Hugging Face tokenizers, Rust, through its Node
// bindings), to compare with Strata's C++ tokenizer on the same files.
//
//   node bench/hf_tokenize.mjs --tokenizer PATH/tokenizer.json --input FILE [--repeat N]
//        [--check TOKENS --token-bytes 2|4 --eos ID|none]
//
// FILE is a .txt (the whole file is one document) or a .jsonl (one document per line,
// in its "text" field). Every document is encoded with add_special_tokens=true, N times
// (default 1), and one JSON line is printed:
//   {"documents", "bytes", "tokens", "seconds", "tokens_per_s", "mb_per_s"}
// (documents, bytes (UTF-8) and tokens count every repeat; mb_per_s is 1e6 bytes/s;
// seconds covers the encode calls only, not loading the tokenizer or reading FILE).
// --check compares, after the timed passes, every id with TOKENS, a raw little-endian token
// file that `strata tokenize` wrote from the same FILE (each document's ids, then ID unless
// none), and adds "checked_tokens" and "mismatched_documents" to the line (exit 3 on any).
//
// The `tokenizers` package is loaded from $STRATA_GOLDEN_NODE (default
// ~/.cache/strata-golden-node), where tools/golden/tokenizer_golden.sh installs it.
//
// Single thread: documents are encoded one at a time with encode(), awaiting each call,
// never with encodeBatch() (the only path that fans out over rayon's pool), so at most one
// encode runs at any moment. On top of that the script re-executes itself once with
// RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false and UV_THREADPOOL_SIZE=1 (each
// encode() is a task on libuv's pool), so these are in place before anything starts.
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ONE_THREAD = { RAYON_NUM_THREADS: '1', TOKENIZERS_PARALLELISM: 'false', UV_THREADPOOL_SIZE: '1' };
if (Object.entries(ONE_THREAD).some(([k, v]) => process.env[k] !== v)) {
  const r = spawnSync(process.execPath, [...process.execArgv, fileURLToPath(import.meta.url), ...process.argv.slice(2)],
    { stdio: 'inherit', env: { ...process.env, ...ONE_THREAD } });
  process.exit(r.status ?? 1);
}

function usage(msg) {
  if (msg) console.error(`hf_tokenize: ${msg}`);
  console.error('usage: node bench/hf_tokenize.mjs --tokenizer PATH --input FILE [--repeat N]');
  process.exit(2);
}

const opts = { repeat: 1 };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i];
  if (['--tokenizer', '--input', '--repeat', '--check', '--token-bytes', '--eos'].includes(k)) {
    if (i + 1 >= argv.length) usage(`${k} needs a value`);
    opts[k.slice(2)] = argv[++i];
  } else if (k === '-h' || k === '--help') usage();
  else usage(`unknown argument ${k}`);
}
if (!opts.tokenizer || !opts.input) usage('--tokenizer and --input are required');
const repeat = Number(opts.repeat);
if (!Number.isInteger(repeat) || repeat < 1) usage('--repeat must be a positive integer');

const nodeDir = process.env.STRATA_GOLDEN_NODE || path.join(os.homedir(), '.cache', 'strata-golden-node');
let tk;
try {
  tk = createRequire(path.join(nodeDir, 'package.json'))('tokenizers');
} catch (e) {
  console.error(`hf_tokenize: cannot load tokenizers from ${nodeDir} (run tools/golden/tokenizer_golden.sh ` +
    `or set STRATA_GOLDEN_NODE): ${e.message}`);
  process.exit(1);
}

const raw = fs.readFileSync(opts.input, 'utf8');
let docs;
if (opts.input.endsWith('.jsonl')) {
  docs = raw.split('\n').filter((l) => l.trim() !== '').map((l, i) => {
    const t = JSON.parse(l).text;
    if (typeof t !== 'string') throw new Error(`${opts.input}:${i + 1}: no string "text" field`);
    return t;
  });
} else {
  docs = [raw];
}
const docBytes = docs.reduce((s, d) => s + Buffer.byteLength(d, 'utf8'), 0);

const tok = tk.Tokenizer.fromFile(opts.tokenizer);
// One untimed warm-up encode so that first-call costs (lazy regex compilation, the
// libuv pool starting) are not counted.
if (docs.length) await tok.encode(docs[0], null, { addSpecialTokens: true });

let tokens = 0;
const t0 = process.hrtime.bigint();
for (let r = 0; r < repeat; r++) {
  for (const d of docs) {
    const enc = await tok.encode(d, null, { addSpecialTokens: true });
    tokens += enc.getLength();
  }
}
const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
const bytes = docBytes * repeat;
const result = {
  documents: docs.length * repeat,
  bytes,
  tokens,
  seconds: Number(seconds.toFixed(6)),
  tokens_per_s: Math.round(tokens / seconds),
  mb_per_s: Number((bytes / seconds / 1e6).toFixed(3)),
};
if (opts.check) {
  const width = Number(opts['token-bytes'] || 4);
  if (width !== 2 && width !== 4) usage('--token-bytes must be 2 or 4');
  const buf = fs.readFileSync(opts.check);
  const at = (i) => (width === 2 ? buf.readUInt16LE(i * 2) : buf.readUInt32LE(i * 4));
  const total = buf.length / width;
  let pos = 0;
  let mismatched = 0;
  for (let d = 0; d < docs.length; d++) {
    const want = (await tok.encode(docs[d], null, { addSpecialTokens: true })).getIds();
    if (opts.eos && opts.eos !== 'none') want.push(Number(opts.eos));
    let same = pos + want.length <= total;
    for (let i = 0; same && i < want.length; i++) same = at(pos + i) === want[i];
    if (!same) {
      if (mismatched++ < 3) console.error(`hf_tokenize: document ${d} differs from ${opts.check}`);
    }
    pos += want.length;
  }
  if (pos !== total) mismatched++;
  result.checked_tokens = pos;
  result.mismatched_documents = mismatched;
}
console.log(JSON.stringify(result));
if (result.mismatched_documents) process.exit(3);
