#!/usr/bin/python3
"""Golden data for the model families (tests/unit/model/family_golden_test.cpp and
tests/integration/family_train_test.cpp): tiny Llama 3.x, Qwen2, Qwen3 and Mistral models in
float64, written from transformers' modeling code (modeling_llama, modeling_qwen2,
modeling_qwen3, modeling_mistral: RMSNorm, rotary embeddings with rope_scaling "llama3" and
"linear", q/k/v/o and MLP biases, Qwen3's per-head q_norm/k_norm before the rotation, sliding-
window causal masks, repeat_kv, SiLU-gated MLP) in plain torch, since transformers is not
installed here.

For each case it writes the config.json, float32 initial weights, a token sequence, the loss and
every gradient of one forward/backward, and the losses of `STEPS` full-batch AdamW steps
(torch.optim.AdamW, in float64) with the weights after them. The batch is every window of
`SEQ` tokens of the sequence (window g: inputs tokens[g*SEQ : g*SEQ+SEQ], targets shifted by
one), which is what Strata's trainer draws each step when batch_size equals the number of
windows. The same computations in float32 give the error a plain f32 implementation makes.

Regenerate with Debian's python3 (torch, CPU):
    /usr/bin/python3 tools/golden/family_golden.py tests/data/families
"""
import json
import math
import os
import sys

import torch

BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.02,
            tie_word_embeddings=False, hidden_act="silu")
CASES = {
    # Llama 3.x: llama3 rope scaling, an explicit head_dim (6, not 16 / 4), both bias flags.
    "llama3": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], head_dim=6,
                   rope_theta=500000.0, attention_bias=True, mlp_bias=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}),
    "llama-linear": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"],
                         rope_scaling={"type": "linear", "factor": 2.0}),
    # Qwen2 / Qwen2.5: q/k/v biases, tied embeddings; a second case with sliding windows from
    # layer 1 on (use_sliding_window, max_window_layers).
    "qwen2": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=2, rope_theta=1000000.0),
    "qwen2-window": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                         use_sliding_window=True, sliding_window=3, max_window_layers=1),
    # Qwen3: q_norm / k_norm, explicit head_dim.
    "qwen3": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=6,
                  attention_bias=False, use_sliding_window=False, sliding_window=None,
                  max_window_layers=2, rope_theta=1000000.0),
    # Mistral: a sliding window of 4 in every layer.
    "mistral": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"],
                    sliding_window=4),
}
SEQ, WINDOWS, STEPS = 8, 4, 3
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def head_dim(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def has_qkv_bias(c):
    return c["model_type"] == "qwen2" or c.get("attention_bias", False)


def has_o_bias(c):
    return c["model_type"] in ("llama", "qwen3") and c.get("attention_bias", False)


def window_of(c, layer):
    if c["model_type"] == "mistral":
        return c.get("sliding_window") or 0
    if c["model_type"] in ("qwen2", "qwen3"):
        if c.get("use_sliding_window") and c.get("sliding_window") and \
                layer >= c.get("max_window_layers", 0):
            return c["sliding_window"]
    return 0


def make_weights(c, gen):
    h, d = c["hidden_size"], head_dim(c)
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    ffn, v = c["intermediate_size"], c["vocab_size"]

    def lin(*shape):
        return (0.3 * torch.randn(*shape, generator=gen)).float()

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=gen)).float()

    def bias(n):
        return (0.1 * torch.randn(n, generator=gen)).float()

    w = {"model.embed_tokens.weight": lin(v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        for name, out, inp, b in (("q_proj", q, h, has_qkv_bias(c)), ("k_proj", kv, h, has_qkv_bias(c)),
                                  ("v_proj", kv, h, has_qkv_bias(c)), ("o_proj", h, q, has_o_bias(c))):
            w[p + f"self_attn.{name}.weight"] = lin(out, inp)
            if b:
                w[p + f"self_attn.{name}.bias"] = bias(out)
        if c["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        for name, out, inp in (("gate_proj", ffn, h), ("up_proj", ffn, h), ("down_proj", h, ffn)):
            w[p + f"mlp.{name}.weight"] = lin(out, inp)
            if c.get("mlp_bias", False):
                w[p + f"mlp.{name}.bias"] = bias(out)
    w["model.norm.weight"] = norm(h)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(v, h)
    return w


def rms_norm(x, weight, eps):  # LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def inv_freq(c):  # rope_init_fn: default, linear, llama3 (modeling_rope_utils)
    d = head_dim(c)
    f = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = c.get("rope_scaling")
    if not s:
        return f
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return f / s["factor"]
    assert kind == "llama3", kind
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / f
    inv_llama = torch.where(wavelen > low_wavelen, f / factor, f)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_llama)


def rotary_cos_sin(c, seq):
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq(c))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def repeat_kv(x, n_rep):
    b, kvh, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def linear(x, w, name):
    y = x @ w[name + ".weight"].T
    if name + ".bias" in w:
        y = y + w[name + ".bias"]
    return y


def attention(x, w, p, c, cos, sin, window):
    b, s, _ = x.shape
    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], head_dim(c)
    q = linear(x, w, p + "q_proj").view(b, s, nh, d)
    k = linear(x, w, p + "k_proj").view(b, s, nkv, d)
    v = linear(x, w, p + "v_proj").view(b, s, nkv, d).transpose(1, 2)
    if c["model_type"] == "qwen3":  # norm over head_dim before the transpose and rotation
        q = rms_norm(q, w[p + "q_norm.weight"], c["rms_norm_eps"])
        k = rms_norm(k, w[p + "k_norm.weight"], c["rms_norm_eps"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
    scores = q @ k.transpose(2, 3) / math.sqrt(d)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    mask = torch.zeros((s, s), dtype=x.dtype).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores + mask, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, nh * d)
    return linear(out, w, p + "o_proj")


def mlp(x, w, p):
    gate = torch.nn.functional.silu(linear(x, w, p + "gate_proj"))
    return linear(gate * linear(x, w, p + "up_proj"), w, p + "down_proj")


def loss_fn(w, c, ids, targets):
    eps = c["rms_norm_eps"]
    h = w["model.embed_tokens.weight"][ids]
    cos, sin = rotary_cos_sin(c, ids.shape[1])
    cos, sin = cos.to(h.dtype), sin.to(h.dtype)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.",
                          c, cos, sin, window_of(c, i))
        h = h + mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
    h = rms_norm(h, w["model.norm.weight"], eps)
    lm = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    logits = h @ lm.T
    return torch.nn.functional.cross_entropy(logits.view(-1, c["vocab_size"]), targets.view(-1))


def batch_of(tokens):
    ids = torch.stack([tokens[g * SEQ: g * SEQ + SEQ] for g in range(WINDOWS)])
    targets = torch.stack([tokens[g * SEQ + 1: g * SEQ + SEQ + 1] for g in range(WINDOWS)])
    return ids, targets


def one_step(weights32, c, ids, targets, dtype):
    w = {k: v.to(dtype).clone().requires_grad_(True) for k, v in weights32.items()}
    loss = loss_fn(w, c, ids, targets)
    loss.backward()
    return loss.item(), {k: v.grad for k, v in w.items()}


def train(weights32, c, ids, targets, dtype):
    w = {k: v.to(dtype).clone().requires_grad_(True) for k, v in weights32.items()}
    opt = torch.optim.AdamW(list(w.values()), **ADAMW)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(w, c, ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in w.items()}


def greedy(weights64, c, prompt, n):
    """Greedy decoding by full recomputation (no cache): the reference `strata generate
    --temperature 0` must reproduce token for token. Also returns the smallest gap between the
    best and second-best logit met, so a near-tie that float32 could flip is visible."""
    ids = list(prompt)
    gap = float("inf")
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor([ids])
            eps = c["rms_norm_eps"]
            h = weights64["model.embed_tokens.weight"][t]
            cos, sin = rotary_cos_sin(c, t.shape[1])
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                h = h + attention(rms_norm(h, weights64[p + "input_layernorm.weight"], eps),
                                  weights64, p + "self_attn.", c, cos, sin, window_of(c, i))
                h = h + mlp(rms_norm(h, weights64[p + "post_attention_layernorm.weight"], eps),
                            weights64, p + "mlp.")
            h = rms_norm(h, weights64["model.norm.weight"], eps)
            lm = weights64["model.embed_tokens.weight"] if c["tie_word_embeddings"] \
                else weights64["lm_head.weight"]
            logits = h[0, -1] @ lm.T
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):], gap


def fmt(t, digits):
    return [float("%.*g" % (digits, x)) for x in t.flatten().tolist()]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/families"
    os.makedirs(out_dir, exist_ok=True)
    for n, (name, c) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(20261202 + n)
        weights = make_weights(c, gen)
        tokens = torch.randint(0, c["vocab_size"], (WINDOWS * SEQ + 1,), generator=gen)
        ids, targets = batch_of(tokens)
        loss, grads = one_step(weights, c, ids, targets, torch.float64)
        loss32, grads32 = one_step(weights, c, ids, targets, torch.float32)
        losses, trained = train(weights, c, ids, targets, torch.float64)
        losses32, trained32_run = train(weights, c, ids, targets, torch.float32)
        # Greedy decoding from the trained weights as Strata saves them (float32 values).
        trained32 = {k: torch.tensor(fmt(v, 10), dtype=torch.float32).reshape(v.shape).double()
                     for k, v in trained.items()}
        prompt = tokens[:5].tolist()
        generated, gap = greedy(trained32, c, prompt, 12)
        data = {
            "generator": "tools/golden/family_golden.py (torch %s, float64; f32 errors from the "
                         "same computation in float32)" % torch.__version__,
            "config": c,
            "seq": SEQ,
            "windows": WINDOWS,
            "tokens": tokens.tolist(),
            "adamw": dict(ADAMW, betas=list(ADAMW["betas"])),
            "weights": {k: fmt(v, 9) for k, v in weights.items()},
            "loss": loss,
            "grads": {k: fmt(v, 10) for k, v in grads.items()},
            "f32_loss_error": abs(loss32 - loss),
            "f32_grad_error": {k: float((grads32[k].double() - g).abs().max())
                               for k, g in grads.items()},
            "train_losses": losses,
            "f32_train_loss_error": max(abs(a - b) for a, b in zip(losses32, losses)),
            "trained_weights": {k: fmt(v, 10) for k, v in trained.items()},
            "f32_trained_weight_error": {k: float((trained32_run[k].double() - v).abs().max())
                                         for k, v in trained.items()},
            "greedy": {"prompt": prompt, "generated": generated, "min_top2_gap": gap},
        }
        path = os.path.join(out_dir, name + ".json")
        with open(path, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.write("\n")
        print("wrote %s: loss %.10f, trained %s" % (path, loss, " ".join("%.6f" % x for x in losses)))


if __name__ == "__main__":
    main()
