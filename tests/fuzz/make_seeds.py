#!/usr/bin/env python3
"""Writes the fuzz harnesses' seed corpus, tests/fuzz/corpus/<harness>/seed-*: small valid inputs
(and a few near misses) for each parser, most cut down from the repository's own test data and
examples so the fuzzer starts from the shapes real files have. Run from anywhere:
    python3 tests/fuzz/make_seeds.py
It replaces the seed-* files and leaves the rest of each corpus directory alone."""
import json
import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"


def put(harness, name, data):
    d = CORPUS / harness
    d.mkdir(parents=True, exist_ok=True)
    (d / ("seed-" + name)).write_bytes(data if isinstance(data, bytes) else data.encode())


def clear_seeds():
    if CORPUS.exists():
        for f in CORPUS.glob("*/seed-*"):
            f.unlink()


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)]"""
    header, blob = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + blob


def small_json(path):
    return json.dumps(json.loads(Path(path).read_text()), separators=(",", ":"))


def shrink_bpe(tok, keep):
    """The tokenizer with the ids below `keep` (and the added tokens), and the merges among them."""
    model = tok["model"]
    vocab = {k: v for k, v in model["vocab"].items() if v < keep}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"], model["merges"] = vocab, merges
    return tok


def main():
    clear_seeds()
    data = ROOT / "tests" / "data"

    # safetensors
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)
    put("safetensors", "f32", safetensors([("w", "F32", [2, 2], f32)], {"format": "pt"}))
    put("safetensors", "mixed", safetensors([
        ("a", "BF16", [3], b"\x80\x3f\x00\x40\x00\xc0"), ("b", "F16", [1, 2], b"\x00\x3c\x00\xbc"),
        ("c", "U8", [4], b"\x01\x02\x03\x04"), ("d", "I64", [1], struct.pack("<q", -7)),
        ("e", "U16", [2], b"\x01\x00\xff\xff"), ("f", "U32", [1], b"\x05\x00\x00\x00"),
        ("g", "I32", [], b"\xff\xff\xff\xff"), ("empty", "F32", [0, 3], b"")]))
    put("safetensors", "overlap", safetensors([("x", "F32", [1], f32[:4])]) [:-4] + f32[:4])
    put("safetensors", "truncated", safetensors([("w", "F32", [2, 2], f32)])[:-5])

    # hf_index: the harness's shard holds "a" and "b"
    shard = "model-00001-of-00001.safetensors"
    put("hf_index", "valid", json.dumps({"metadata": {"total_size": 10},
                                         "weight_map": {"a": shard, "b": shard}}))
    put("hf_index", "missing-shard", json.dumps({"weight_map": {"a": shard, "b": "model-2.safetensors"}}))
    put("hf_index", "no-map", json.dumps({"metadata": {}}))

    # hf_config: each family's config.json as the golden tests have it
    for f in sorted((data / "families").glob("*.json")):
        put("hf_config", f.stem, json.dumps(json.loads(f.read_text())["config"]))

    # train_config: the examples, with and without overrides, and the features' keys
    quick = json.loads((ROOT / "examples" / "quickstart.json").read_text())
    sft = json.loads((ROOT / "examples" / "sft.json").read_text())
    put("train_config", "quickstart", json.dumps(quick))
    put("train_config", "sft", json.dumps(sft))
    put("train_config", "overrides",
        "optimizer.lr=1e-4\nzero_stage=2\noffload_optimizer=nvme\nhost_memory_limit=2GiB\n---\n"
        + json.dumps(quick))
    lora = dict(quick, finetune={"method": "lora", "lora": {"r": 8, "alpha": 16,
                                 "target_modules": ["q_proj", "v_proj"],
                                 "modules_to_save": ["norm"]}})
    put("train_config", "lora", json.dumps(lora))
    pipe = dict(quick, pipeline_parallel_size=2, pipeline_schedule="interleaved",
                virtual_stages=2, batch_size=16, micro_batch_size=2, tensor_parallel_size=1)
    put("train_config", "pipeline", json.dumps(pipe))
    compact = dict(quick, offload_optimizer="nvme", swap_dir="/tmp/strata-swap",
                   optimizer=dict(quick["optimizer"], state_dtype="int8", master_dtype="bf16",
                                  master_rounding="kahan"))
    put("train_config", "compact-states", json.dumps(compact))
    put("train_config", "checkpoints", json.dumps(dict(quick, save_every=10, keep_last=2,
                                                       resume_from="checkpoints/quickstart")))

    # token_data: format byte (0 u16, 1 u32, 2 llmc, 3 text), seq_len byte, tokens[, MASK mask]
    u16 = struct.pack("<12H", *range(12))
    put("token_data", "u16", b"\x00\x04" + u16)
    put("token_data", "u16-mask", b"\x00\x03" + u16 + b"MASK" + bytes([0, 1] * 6))
    put("token_data", "u32", b"\x01\x02" + struct.pack("<6I", 1, 2, 3, 299, 300, 70000))
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, 10
    put("token_data", "llmc", b"\x02\x04" + struct.pack("<256i", *header) + struct.pack("<10H", *range(10)))
    header[1] = 2
    put("token_data", "llmc-u32", b"\x02\x02" + struct.pack("<256i", *header) + struct.pack("<10I", *range(10)))
    put("token_data", "text", b"\x03\x08" + b"The quick brown fox jumps over the lazy dog.")

    # tokenizer_json: the test tokenizers cut down to a few hundred ids, and the other models
    for name, keep in [("bytelevel-bpe", 300), ("llama2-bpe", 320), ("llama2-bpe-legacy", 320),
                       ("llama3", 300)]:
        tok = json.loads((data / "tokenizers" / name / "tokenizer.json").read_text())
        tok = shrink_bpe(tok, keep)
        if name == "llama3":
            tok["added_tokens"] = tok["added_tokens"][:4]
            for t in tok["added_tokens"]:
                t["id"] = keep + tok["added_tokens"].index(t)
        put("tokenizer_json", name, json.dumps(tok, separators=(",", ":"), ensure_ascii=False))
    put("tokenizer_json", "unigram", json.dumps({
        "version": "1.0", "added_tokens": [{"id": 0, "content": "<unk>", "special": True}],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"},
                       {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": False,
                  "vocab": [["<unk>", 0.0], ["\u2581", -1.0], ["\u2581the", -2.0], ["h", -3.0], ["e", -3.0],
                            ["l", -3.0], ["o", -3.0], ["\u2581hello", -2.5], ["w", -3.0], ["r", -3.0], ["d", -3.0]]}}))
    put("tokenizer_json", "wordlevel-bert", json.dumps({
        "version": "1.0", "added_tokens": [{"id": 0, "content": "[UNK]", "special": True},
                                           {"id": 1, "content": "[CLS]", "special": True},
                                           {"id": 2, "content": "[SEP]", "special": True}],
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                          {"type": "Punctuation", "behavior": "Isolated"},
                          {"type": "Digits", "individual_digits": True}]},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 2], "cls": ["[CLS]", 1]},
        "decoder": {"type": "BPEDecoder", "suffix": "</w>"},
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, ",": 4, "world": 5, "!": 6, "2": 7, "0": 8}}}))

    # sentencepiece: the BPE test model (the unigram one is 250 KB)
    put("sentencepiece", "bpe", (data / "tokenizers" / "sentencepiece-bpe" / "tokenizer.model").read_bytes())

    # tokenizer_config: Llama 3's (with its chat template) and the keys' other forms
    put("tokenizer_config", "llama3", small_json(data / "tokenizers" / "llama3" / "tokenizer_config.json"))
    put("tokenizer_config", "bos-eos", json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                   "add_bos_token": True, "add_eos_token": True,
                                                   "tokenizer_class": "LlamaTokenizerFast"}))
    chatml = json.loads((data / "chat_templates" / "chatml.json").read_text())
    put("tokenizer_config", "named-templates", json.dumps({
        "eos_token": "</s>", "chat_template": [{"name": "default", "template": chatml["chat_template"]},
                                               {"name": "tool_use", "template": "{{ x }}"}]}))

    # chat_template: each built-in template with a conversation
    conversation = "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: Bye\nassistant: Bye."
    for f in sorted((data / "chat_templates").glob("*.json")):
        put("chat_template", f.stem, json.loads(f.read_text())["chat_template"] + "\n---\n" + conversation)

    # jsonl_records: the SFT example's records and every record kind
    lines = (ROOT / "examples" / "sft" / "train.jsonl").read_text().splitlines()[:4]
    put("jsonl_records", "prompt-completion", "\n".join(lines) + "\n")
    put("jsonl_records", "kinds", "\n".join(json.dumps(r) for r in [
        {"text": "ab ab a b"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                      {"role": "assistant", "content": "ba"}]},
        {"prompt": "a", "completion": "b"}, {"text": ""}]) + "\n")

    # trainer_state: `latest`, then trainer_state.json
    state = {"format_version": 1, "step": 6, "sequences_consumed": 96, "seed": 1234,
             "world_size": 4, "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
             "pipeline_layers": [1, 1, 1, 1],
             "loss_scaler": {"scale": 65536.0, "iteration": 6, "last_overflow": -1, "hysteresis": 2},
             "config": {"seed": 1234}}
    put("trainer_state", "pipeline", "step-00000001\n---\n" + json.dumps(state))
    put("trainer_state", "plain", json.dumps({"format_version": 1, "step": 1, "sequences_consumed": 16,
                                              "seed": 1, "world_size": 2, "loss_scaler": None}))

    # peft_adapter: adapter_config.json as PEFT writes it
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 2, "lora_dropout": 0.0,
            "target_modules": ["q_proj"], "use_rslora": False, "use_dora": False, "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": "base"}
    put("peft_adapter", "q-proj", json.dumps(peft))
    put("peft_adapter", "all-save", json.dumps(dict(peft, r=4, target_modules="all-linear",
                                                    modules_to_save=["embed_tokens", "norm"], use_rslora=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
