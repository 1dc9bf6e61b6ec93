#!/usr/bin/python3
"""Golden test data for Strata's tokenizer: the sentencepiece half.

Run through tools/golden/tokenizer_golden.sh, which first runs tokenizer_golden.mjs
(it writes tests/data/tokenizers/texts.json and the training corpus). Directly:

  /usr/bin/python3 tools/golden/sentencepiece_golden.py --out tests/data/tokenizers \
      --corpus SCRATCH_DIR/corpus.txt [--retrain]

Needs Debian's `sentencepiece` (spm_train) and `python3-sentencepiece`, which only
Debian's /usr/bin/python3 can import. It writes
  OUT/sentencepiece-bpe/tokenizer.model      spm_train, Llama 2 settings, 1000 pieces
  OUT/sentencepiece-unigram/tokenizer.model  spm_train, unigram, nmt_nfkc, 1000 pieces
  OUT/<name>/golden.json                     SentencePieceProcessor encode/decode results
A model that already exists is kept unless --retrain is given; with --num_threads=1
and a fixed seed spm_train gives the same model bytes again.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata

import sentencepiece as spm

MODELS = {
    "sentencepiece-bpe": [
        "--model_type=bpe", "--byte_fallback=true", "--vocab_size=1000",
        "--character_coverage=0.9995", "--split_digits=true",
        "--allow_whitespace_only_pieces=true", "--normalization_rule_name=identity",
        "--add_dummy_prefix=true", "--remove_extra_whitespaces=false",
    ],
    "sentencepiece-unigram": [
        "--model_type=unigram", "--byte_fallback=true", "--vocab_size=1000",
    ],
}
# Reproducibility: one thread, fixed seed, every sentence (no sampling).
COMMON = ["--num_threads=1", "--random_seed=20240517", "--input_sentence_size=0",
          "--minloglevel=1"]

INVISIBLE = {"Cc", "Cf", "Zs", "Zl", "Zp"}


def escape_invisible(text):
    """Same escaping as tokenizer_golden.mjs: invisible characters as \\uXXXX."""
    out = []
    for ch in text:
        if ch != " " and unicodedata.category(ch) in INVISIBLE:
            cp = ord(ch)
            if cp > 0xFFFF:
                cp -= 0x10000
                out.append("\\u%04x\\u%04x" % (0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF)))
            else:
                out.append("\\u%04x" % cp)
        else:
            out.append(ch)
    return "".join(out)


def dump(value):
    return escape_invisible(json.dumps(value, ensure_ascii=False))


def train(name, corpus, model_path):
    # The model stores its trainer_spec, input and model_prefix included: run in a scratch
    # folder with relative names so no local path ends up in the committed file.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(corpus, os.path.join(tmp, "corpus.txt"))
        cmd = ["spm_train", "--input=corpus.txt", "--model_prefix=tokenizer"] + MODELS[name] + COMMON
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=tmp)
        os.makedirs(os.path.dirname(model_path), exist_ok=True)
        shutil.copyfile(os.path.join(tmp, "tokenizer.model"), model_path)


def write_golden(name, model_path, texts):
    sp = spm.SentencePieceProcessor(model_file=model_path)
    cases = []
    for i, text in enumerate(texts):
        ids = sp.encode(text)
        decoded = sp.decode(ids)
        cases.append({"text": i, "ids": ids, "ids_plain": ids, "decoded": decoded,
                      "decoded_skip": decoded, "tokens": [sp.id_to_piece(t) for t in ids]})
    reference = (
        "sentencepiece %s (Debian python3-sentencepiece / spm_train): "
        "ids = ids_plain = SentencePieceProcessor(model_file=tokenizer.model).encode(text) "
        "(no BOS/EOS), decoded = decoded_skip = decode(ids), tokens = id_to_piece(ids); "
        "model trained by tools/golden/sentencepiece_golden.py: spm_train %s on "
        "examples/data/gpl-3.0.txt + tools/golden/tokenizer_corpus_extra.txt + texts.json"
        % (spm.__version__, " ".join(MODELS[name] + COMMON[:3])))
    out = os.path.join(os.path.dirname(model_path), "golden.json")
    body = ("{\n  \"reference\": %s,\n  \"tokenizer\": %s,\n  \"cases\": [\n%s\n  ]\n}\n"
            % (dump(reference), dump(os.path.basename(model_path)),
               ",\n".join("    " + dump(c) for c in cases)))
    with open(out, "w", encoding="utf-8") as f:
        f.write(body)
    # Verify: parses, one case per text in order, ids inside the vocabulary.
    with open(out, encoding="utf-8") as f:
        back = json.load(f)
    assert back["cases"] == cases, out + ": does not read back"
    assert len(back["cases"]) == len(texts), out + ": case count"
    size = sp.get_piece_size()
    for i, c in enumerate(back["cases"]):
        assert c["text"] == i, "%s: case %d" % (out, i)
        assert all(0 <= t < size for t in c["ids"]), "%s: id out of range" % out
    n_bytes = sum(1 for c in cases for t in c["ids"] if sp.is_byte(t))
    print("%s: %d cases, %d ids (%d byte pieces), vocab %d, %d bytes (model %d bytes)"
          % (os.path.relpath(out), len(cases), sum(len(c["ids"]) for c in cases), n_bytes, size,
             os.path.getsize(out), os.path.getsize(model_path)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="tests/data/tokenizers")
    ap.add_argument("--corpus", required=True, help="corpus.txt written by tokenizer_golden.mjs")
    ap.add_argument("--retrain", action="store_true", help="train even if tokenizer.model exists")
    args = ap.parse_args()
    if shutil.which("spm_train") is None:
        sys.exit("spm_train not found: apt-get install sentencepiece python3-sentencepiece")
    with open(os.path.join(args.out, "texts.json"), encoding="utf-8") as f:
        texts = json.load(f)
    for name in MODELS:
        model_path = os.path.join(args.out, name, "tokenizer.model")
        if args.retrain or not os.path.exists(model_path):
            train(name, args.corpus, model_path)
        write_golden(name, model_path, texts)


if __name__ == "__main__":
    main()
