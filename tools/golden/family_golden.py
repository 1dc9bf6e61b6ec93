#!/usr/bin/python3
"""Golden data for the model families (tests/unit/model/family_golden_test.cpp and
tests/integration/family_train_test.cpp): tiny Llama 3.x, Qwen2, Qwen3, Mistral, Qwen3-MoE and
Mixtral models in float64, written from transformers' modeling code (modeling_llama,
modeling_qwen2, modeling_qwen3, modeling_mistral, modeling_qwen3_moe, modeling_mixtral: RMSNorm,
rotary embeddings with rope_scaling "llama3" and "linear", q/k/v/o and MLP biases, Qwen3's
per-head q_norm/k_norm before the rotation, sliding-window causal masks, repeat_kv, SiLU-gated
MLP; the sparse MoE block's router (softmax over the experts, top-k, the top-k weights
renormalized where the family does), its experts' weighted sum, and load_balancing_loss_func
added with router_aux_loss_coef) in plain torch, since transformers is not installed here.

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
    # Qwen3-MoE: Qwen3's attention; 4 experts of 8, top 2 renormalized; layer 1 keeps a dense
    # MLP (mlp_only_layers); the aux loss over layers 0 and 2 (coefficient raised so its
    # gradient shows).
    "qwen3-moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      num_hidden_layers=3, head_dim=6, attention_bias=False,
                      use_sliding_window=False, sliding_window=None, max_window_layers=3,
                      rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1], router_aux_loss_coef=0.05,
                      output_router_logits=True),
    # Mixtral: Mistral's attention (a window of 4); 4 experts (w1 gate, w2 down, w3 up) of
    # intermediate_size 8, top 2 always renormalized.
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"],
                    intermediate_size=8, sliding_window=4, num_local_experts=4,
                    num_experts_per_tok=2, router_aux_loss_coef=0.05,
                    output_router_logits=True, router_jitter_noise=0.0),
}
SEQ, WINDOWS, STEPS = 8, 4, 3
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def attention_type(c):
    """The dense family whose attention the model uses: Qwen3-MoE Qwen3's, Mixtral Mistral's."""
    return {"qwen3_moe": "qwen3", "mixtral": "mistral"}.get(c["model_type"], c["model_type"])


def head_dim(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def has_qkv_bias(c):
    return attention_type(c) == "qwen2" or c.get("attention_bias", False)


def has_o_bias(c):
    return attention_type(c) in ("llama", "qwen3") and c.get("attention_bias", False)


def window_of(c, layer):
    if attention_type(c) == "mistral":
        return c.get("sliding_window") or 0
    if attention_type(c) in ("qwen2", "qwen3"):
        if c.get("use_sliding_window") and c.get("sliding_window") and \
                layer >= c.get("max_window_layers", 0):
            return c["sliding_window"]
    return 0


def num_experts(c):
    return c.get("num_experts") or c.get("num_local_experts") or 0


def is_moe_layer(c, layer):  # Qwen3MoeDecoderLayer's rule; every Mixtral layer
    if c["model_type"] == "mixtral":
        return True
    if c["model_type"] != "qwen3_moe":
        return False
    return layer not in c.get("mlp_only_layers", []) and num_experts(c) > 0 and \
        (layer + 1) % c.get("decoder_sparse_step", 1) == 0


def moe_names(c, p):
    """The router's tensor and each expert's (gate, up, down) names in layer prefix p."""
    if c["model_type"] == "mixtral":
        m = p + "block_sparse_moe."
        return m + "gate.weight", [tuple(m + f"experts.{e}.{n}.weight" for n in ("w1", "w3", "w2"))
                                   for e in range(num_experts(c))]
    m = p + "mlp."
    return m + "gate.weight", [tuple(m + f"experts.{e}.{n}.weight"
                                     for n in ("gate_proj", "up_proj", "down_proj"))
                               for e in range(num_experts(c))]


def expert_size(c):
    return c["moe_intermediate_size"] if c["model_type"] == "qwen3_moe" else c["intermediate_size"]


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
        if attention_type(c) == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if is_moe_layer(c, i):
            router, experts = moe_names(c, p)
            w[router] = lin(num_experts(c), h)
            f = expert_size(c)
            for gate, up, down in experts:
                w[gate], w[up], w[down] = lin(f, h), lin(f, h), lin(h, f)
            continue
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
    if attention_type(c) == "qwen3":  # norm over head_dim before the transpose and rotation
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


# The smallest gap between a token's k-th and (k+1)-th router probability met so far: a near-tie
# that float32 could route otherwise is visible (and avoided by the case's seed).
ROUTE_GAP = [float("inf")]


def sparse_moe(x, w, p, c, router_logits):
    """Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock: softmax over the experts, top-k, the
    top-k weights renormalized (Mixtral always, Qwen3-MoE under norm_topk_prob), each token's
    output the weighted sum of its experts' SwiGLU outputs (index_add_ in expert order)."""
    b, s, h = x.shape
    xs = x.reshape(-1, h)
    router, experts = moe_names(c, p)
    logits = linear(xs, w, router[:-len(".weight")])
    router_logits.append(logits)
    probs = torch.softmax(logits, dim=1)
    k = c["num_experts_per_tok"]
    with torch.no_grad():
        top = torch.topk(probs, k + 1, dim=-1).values if k < probs.shape[1] else None
        if top is not None:
            ROUTE_GAP[0] = min(ROUTE_GAP[0], float((top[:, k - 1] - top[:, k]).min()))
    weights, chosen = torch.topk(probs, k, dim=-1)
    if c["model_type"] == "mixtral" or c.get("norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(xs)
    for e, (gate, up, down) in enumerate(experts):
        tok, slot = torch.where(chosen == e)
        if tok.numel() == 0:
            continue
        xe = xs[tok]
        # linear(): lora_golden.py puts PEFT's adapters on the experts' projections through it.
        g, u, d = (n[:-len(".weight")] for n in (gate, up, down))
        ye = linear(torch.nn.functional.silu(linear(xe, w, g)) * linear(xe, w, u), w, d)
        out = out.index_add(0, tok, ye * weights[tok, slot, None])
    return out.reshape(b, s, h)


def load_balancing_loss(router_logits, c):
    """transformers' load_balancing_loss_func without an attention mask, over every MoE layer's
    logits concatenated."""
    e, k = num_experts(c), c["num_experts_per_tok"]
    probs = torch.softmax(torch.cat(router_logits, dim=0), dim=-1)
    _, chosen = torch.topk(probs, k, dim=-1)
    mask = torch.nn.functional.one_hot(chosen, e)
    tokens_per_expert = torch.mean(mask.to(probs.dtype), dim=0)
    router_prob_per_expert = torch.mean(probs, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * e


def block_mlp(x, w, p, c, layer, router_logits):
    if is_moe_layer(c, layer):
        return sparse_moe(x, w, p, c, router_logits)
    return mlp(x, w, p + "mlp.")


def forward(w, c, ids, router_logits):
    """The final norm's output."""
    eps = c["rms_norm_eps"]
    h = w["model.embed_tokens.weight"][ids]
    cos, sin = rotary_cos_sin(c, ids.shape[1])
    cos, sin = cos.to(h.dtype), sin.to(h.dtype)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.",
                          c, cos, sin, window_of(c, i))
        h = h + block_mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), w, p, c, i,
                          router_logits)
    return rms_norm(h, w["model.norm.weight"], eps)


def losses_of(w, c, ids, targets):
    """(the training loss, the language-model loss, the aux loss or None): CausalLM's loss plus
    router_aux_loss_coef times the load-balancing loss when output_router_logits."""
    router_logits = []
    h = forward(w, c, ids, router_logits)
    lm = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    logits = h @ lm.T
    lm_loss = torch.nn.functional.cross_entropy(logits.view(-1, c["vocab_size"]),
                                                targets.view(-1))
    if not router_logits or not c.get("output_router_logits", False):
        return lm_loss, lm_loss, None
    aux = load_balancing_loss(router_logits, c)
    return lm_loss + c["router_aux_loss_coef"] * aux, lm_loss, aux


def loss_fn(w, c, ids, targets):
    return losses_of(w, c, ids, targets)[0]


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
            h = forward(weights64, c, t, [])
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
        if len(sys.argv) > 2 and name not in sys.argv[2:]:
            continue
        gen = torch.Generator().manual_seed(20261202 + n)
        weights = make_weights(c, gen)
        tokens = torch.randint(0, c["vocab_size"], (WINDOWS * SEQ + 1,), generator=gen)
        ids, targets = batch_of(tokens)
        ROUTE_GAP[0] = float("inf")
        loss, grads = one_step(weights, c, ids, targets, torch.float64)
        with torch.no_grad():
            w64 = {k: v.double() for k, v in weights.items()}
            _, lm_loss, aux_loss = losses_of(w64, c, ids, targets)
        loss32, grads32 = one_step(weights, c, ids, targets, torch.float32)
        losses, trained = train(weights, c, ids, targets, torch.float64)
        losses32, trained32_run = train(weights, c, ids, targets, torch.float32)
        # Greedy decoding from the trained weights as Strata saves them (float32 values).
        trained32 = {k: torch.tensor(fmt(v, 10), dtype=torch.float32).reshape(v.shape).double()
                     for k, v in trained.items()}
        prompt = tokens[:5].tolist()
        generated, gap = greedy(trained32, c, prompt, 12)
        route_gap = ROUTE_GAP[0]
        assert route_gap > 1e-4, "%s: a near-tie in routing (%g): change its seed" % (name, route_gap)
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
            "lm_loss": float(lm_loss),
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
        if aux_loss is not None:
            data["aux_loss"] = float(aux_loss)
        if route_gap != float("inf"):
            # Every routing decision of the step, the training and the decoding, in float64.
            data["min_route_gap"] = route_gap
        path = os.path.join(out_dir, name + ".json")
        with open(path, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.write("\n")
        print("wrote %s: loss %.10f, trained %s" % (path, loss, " ".join("%.6f" % x for x in losses)))


if __name__ == "__main__":
    main()
