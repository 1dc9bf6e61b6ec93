#!/usr/bin/python3
"""Writes a Hugging Face LlamaForCausalLM checkpoint of random bf16 weights (N(0, 0.02), norms 1)
for a config.json given inline, tensor by tensor, so a 1.1B-parameter model needs about one
tensor's worth of memory. For benchmarks of shapes no checkpoint is at hand for.

    /usr/bin/python3 bench/make_random_checkpoint.py OUT_DIR '{"vocab_size": 32000, ...}'
"""
import json
import os
import struct
import sys

import numpy as np


def tensors(c):
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h), False
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), True
        yield p + "self_attn.q_proj.weight", (q, h), False
        yield p + "self_attn.k_proj.weight", (kv, h), False
        yield p + "self_attn.v_proj.weight", (kv, h), False
        yield p + "self_attn.o_proj.weight", (h, q), False
        yield p + "post_attention_layernorm.weight", (h,), True
        yield p + "mlp.gate_proj.weight", (f, h), False
        yield p + "mlp.up_proj.weight", (f, h), False
        yield p + "mlp.down_proj.weight", (h, f), False
    yield "model.norm.weight", (h,), True
    if not c.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h), False


def main():
    out, config = sys.argv[1], json.loads(sys.argv[2])
    config.setdefault("model_type", "llama")
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config["torch_dtype"] = "bfloat16"
    os.makedirs(out, exist_ok=True)
    header, offset = {}, 0
    specs = list(tensors(config))
    for name, shape, _ in specs:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    rng = np.random.default_rng(1)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, norm in specs:
            x = np.ones(shape, np.float32) if norm else \
                (rng.standard_normal(shape, dtype=np.float32) * 0.02)
            f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print("wrote %s: %.2f GB" % (out, offset / 1e9))


if __name__ == "__main__":
    main()
