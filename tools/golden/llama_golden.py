#!/usr/bin/python3
"""Golden data for tests/unit/model/llama_golden_test.cpp: a tiny LlamaForCausalLM in float64.

Mirrors transformers' modeling_llama (LlamaRMSNorm, LlamaRotaryEmbedding with rotate_half,
repeat_kv, causal softmax attention, SiLU-gated MLP, final norm, lm_head) in plain torch, since
the transformers package is not installed here. Targets are given per position (the shift
LlamaForCausalLM applies to labels is the data loader's job in Strata); -1 marks an ignored
target. Writes config, weights (float32 values), ids, targets, the loss and the gradients of
some tensors, for an untied model and for the same weights with tied embeddings.

Regenerate with Debian's python3 (torch 1.13, CPU):
    /usr/bin/python3 tools/golden/llama_golden.py tests/data/llama_tiny_golden.json
"""
import json
import math
import sys

import torch

CONFIG = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.02,
              tie_word_embeddings=False, hidden_act="silu", model_type="llama")
BATCH, SEQ = 2, 7
GRAD_TENSORS = [
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def make_weights(c, gen):
    """float32 weights with enough spread for a non-uniform softmax everywhere."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    ffn, v = c["intermediate_size"], c["vocab_size"]

    def lin(*shape):
        return (0.3 * torch.randn(*shape, generator=gen)).float()

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=gen)).float()

    w = {"model.embed_tokens.weight": lin(v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = lin(h, h)
        w[p + "self_attn.k_proj.weight"] = lin(kv, h)
        w[p + "self_attn.v_proj.weight"] = lin(kv, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = lin(ffn, h)
        w[p + "mlp.up_proj.weight"] = lin(ffn, h)
        w[p + "mlp.down_proj.weight"] = lin(h, ffn)
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = lin(v, h)
    return w


def rms_norm(x, weight, eps):  # LlamaRMSNorm
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(seq, dim, theta):  # LlamaRotaryEmbedding
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def repeat_kv(x, n_rep):  # [b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]
    b, kvh, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def attention(x, w, p, c, cos, sin):  # LlamaAttention (eager)
    b, s, h = x.shape
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = h // nh
    q = (x @ w[p + "q_proj.weight"].T).view(b, s, nh, d).transpose(1, 2)
    k = (x @ w[p + "k_proj.weight"].T).view(b, s, nkv, d).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].T).view(b, s, nkv, d).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
    scores = q @ k.transpose(2, 3) / math.sqrt(d)
    mask = torch.triu(torch.full((s, s), float("-inf"), dtype=x.dtype), diagonal=1)
    probs = torch.softmax(scores + mask, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, h)
    return out @ w[p + "o_proj.weight"].T


def mlp(x, w, p):  # LlamaMLP
    gate = torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T)
    return (gate * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def loss_fn(w, c, ids, targets):
    eps = c["rms_norm_eps"]
    d = c["hidden_size"] // c["num_attention_heads"]
    cos, sin = rotary_cos_sin(ids.shape[1], d, c["rope_theta"])
    h = w["model.embed_tokens.weight"][ids]
    cos, sin = cos.to(h.dtype), sin.to(h.dtype)  # angles in float64, used in the run's dtype
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.",
                          c, cos, sin)
        h = h + mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
    h = rms_norm(h, w["model.norm.weight"], eps)
    lm = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    logits = h @ lm.T
    return torch.nn.functional.cross_entropy(logits.view(-1, c["vocab_size"]), targets.view(-1),
                                             ignore_index=-1)


def run(weights32, c, ids, targets, names):
    w = {k: v.double().requires_grad_(True) for k, v in weights32.items()}
    loss = loss_fn(w, c, ids, targets)
    loss.backward()
    grads = {n: [float("%.10g" % g) for g in w[n].grad.flatten().tolist()] for n in names}
    # The same computation in float32: how far a plain f32 implementation lands from float64,
    # per tensor (the largest element error) and for the loss. The test allows Strata's f32 a
    # small multiple of that, instead of a tolerance fitted to one machine's rounding.
    w32 = {k: v.float().clone().requires_grad_(True) for k, v in weights32.items()}
    loss32 = loss_fn(w32, c, ids, targets)
    loss32.backward()
    f32_err = {n: float((w32[n].grad.double() - w[n].grad).abs().max()) for n in names}
    return loss.item(), grads, abs(loss32.item() - loss.item()), f32_err


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/llama_tiny_golden.json"
    gen = torch.Generator().manual_seed(20261129)
    weights = make_weights(CONFIG, gen)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    targets[0, 2] = -1
    targets[1, 6] = -1

    loss, grads, loss_err, grad_err = run(weights, CONFIG, ids, targets, GRAD_TENSORS)
    tied_config = dict(CONFIG, tie_word_embeddings=True)
    tied_weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    tied_names = ["model.embed_tokens.weight", "model.norm.weight",
                  "model.layers.1.mlp.down_proj.weight"]
    tied_loss, tied_grads, tied_loss_err, tied_grad_err = run(tied_weights, tied_config, ids,
                                                               targets, tied_names)

    data = {
        "generator": "tools/golden/llama_golden.py (torch %s, float64; f32 errors from the same "
                     "computation in float32)" % torch.__version__,
        "config": CONFIG,
        "batch": BATCH,
        "seq": SEQ,
        "inputs": ids.flatten().tolist(),
        "targets": targets.flatten().tolist(),
        # float32 values printed to round-trip exactly
        "weights": {k: [float("%.9g" % x) for x in v.flatten().tolist()]
                    for k, v in weights.items()},
        "untied": {"loss": loss, "grads": grads,
                   "f32_loss_error": loss_err, "f32_grad_error": grad_err},
        "tied": {"config": tied_config, "loss": tied_loss, "grads": tied_grads,
                 "f32_loss_error": tied_loss_err, "f32_grad_error": tied_grad_err},
    }
    with open(out_path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print("wrote %s: untied loss %.12f, tied loss %.12f" % (out_path, loss, tied_loss))


if __name__ == "__main__":
    main()
