#!/usr/bin/env bash
# strata tokenize against Hugging Face's tokenizers (Rust, through its Node bindings), side by
# side on the same corpus and tokenizers, in one run:
#   - the reference, one thread (bench/hf_tokenize.mjs: one encode at a time)
#   - strata tokenize --jobs 1, and --jobs N (every core)
# and checks that every id matches the reference.
#
#   bench/tokenize_vs_hf.sh [MB]     (corpus size, default 16)
#
# The corpus is plain English (and some other) text from this machine: the Debian copyright
# files under /usr/share/doc, one JSON-lines record per file, in sorted order. strata's time
# covers reading, parsing and writing too; the reference's covers its encode calls only.
# Needs node and the npm package `tokenizers` in $STRATA_GOLDEN_NODE
# (tools/golden/tokenizer_golden.sh installs it) and a built build/strata.
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-16}
export STRATA_GOLDEN_NODE=${STRATA_GOLDEN_NODE:-$HOME/.cache/strata-golden-node}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
corpus=$work/corpus.jsonl
/usr/bin/python3 - "$corpus" "$mb" <<'PY'
import glob, json, sys
out, limit, n, docs = open(sys.argv[1], "w"), float(sys.argv[2]) * 1e6, 0, 0
for f in sorted(glob.glob("/usr/share/doc/*/copyright")):
    try:
        t = open(f, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
        continue
    out.write(json.dumps({"text": t}) + "\n")
    n += len(t.encode()); docs += 1
    if n > limit:
        break
print(f"corpus: {docs} documents, {n / 1e6:.1f} MB", file=sys.stderr)
PY
cores=$(nproc)
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $cores cores; $(date -u +%Y-%m-%d)"
printf '| tokenizer | reference 1 thread (M tok/s) | strata 1 thread | strata %d threads | 1-thread ratio | ids |\n' "$cores"
echo '|---|---|---|---|---|---|'
for name in llama3 bytelevel-bpe llama2-bpe unigram; do
  tok=tests/data/tokenizers/$name/tokenizer.json
  rate() { sed -n 's/.*(\([0-9.]*\)\([Mk]\) tokens\/s.*/\1 \2/p' | awk '{print ($2=="k") ? $1/1000 : $1}'; }
  s1=$(build/strata tokenize --tokenizer "$tok" --input "$corpus" --output "$work/t.bin" --no-eos \
         --format u32 --jobs 1 2>/dev/null | rate)
  sn=$(build/strata tokenize --tokenizer "$tok" --input "$corpus" --output "$work/t.bin" --no-eos \
         --format u32 --jobs "$cores" 2>/dev/null | rate)
  ref=$(node bench/hf_tokenize.mjs --tokenizer "$tok" --input "$corpus" --check "$work/t.bin" \
          --token-bytes 4 --eos none)
  hf=$(echo "$ref" | sed -n 's/.*"tokens_per_s":\([0-9]*\).*/\1/p' | awk '{printf "%.2f", $1/1e6}')
  bad=$(echo "$ref" | sed -n 's/.*"mismatched_documents":\([0-9]*\).*/\1/p')
  ids=$([[ "$bad" == 0 ]] && echo "identical" || echo "$bad documents differ")
  printf '| %s | %s | %s | %s | %.1fx | %s |\n' "$name" "$hf" "$s1" "$sn" \
    "$(echo "$s1 $hf" | awk '{print $1/$2}')" "$ids"
done
