#!/usr/bin/python3
"""Golden data for LoRA (tests/unit/model/lora_golden_test.cpp and
tests/integration/lora_train_test.cpp): tiny models of the four families with low-rank adapters
on a frozen base, in float64, written from PEFT's math (peft/tuners/lora/layer.py, Linear.forward:
result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora; one nn.Dropout per adapted module) over the same model code
as family_golden.py, since peft and transformers are not installed here.

Dropout masks are Strata's (include/strata/device/ops.h: element i of adapter (layer, target) is
kept when the top 24 bits of splitmix64_at(lora_dropout_key(key, layer, target), i) are at least
round(p * 2^24)), so the reference drops exactly the elements Strata drops. The single step uses
key DROPOUT_KEY; the training run uses the trainer's key of each step (src/train/trainer.cpp:
splitmix64_at(seed ^ DROPOUT_SALT, (step * accumulation + micro) * world + rank), with one
micro-batch on one rank). Cases with dropout repeat one window's tokens, so the trainer's batch
equals the reference's whatever order its sampler draws the windows in.

For each case: the base weights and adapters (B drawn non-zero, so every gradient is), with the
modules of PEFT's modules_to_save training whole beside them (their gradients and trained values
listed with the adapters'), the loss and every adapter gradient of one forward/backward, and the losses and adapters after `STEPS`
full-batch AdamW steps on the adapters alone; each with the error the same computation makes in
float32.

Regenerate with Debian's python3 (torch, CPU):
    /usr/bin/python3 tools/golden/lora_golden.py tests/data/lora
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_golden as fg  # noqa: E402

# Every projection of a decoder block ("all-linear"); then an MoE layer's router, PEFT's "gate",
# adapted only where named. Their order is LoraTarget's (include/strata/model/lora.h).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ORDER = TARGETS + ["gate"]
MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
          "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
          "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
# Mixtral's experts' names for the MLP's projections.
ALIAS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_TARGETS = ["gate_proj", "up_proj", "down_proj"]
CASES = {
    "llama3-all": ("llama3", dict(r=4, alpha=8.0, dropout=0.0, targets=TARGETS, rslora=False)),
    "llama3-all-dropout": ("llama3", dict(r=4, alpha=8.0, dropout=0.1, targets=TARGETS,
                                          rslora=False)),
    "llama3-qv": ("llama3", dict(r=2, alpha=16.0, dropout=0.0, targets=["q_proj", "v_proj"],
                                 rslora=False)),
    "qwen2-all-dropout": ("qwen2", dict(r=4, alpha=8.0, dropout=0.25, targets=TARGETS,
                                        rslora=False)),
    "qwen3-all-rslora": ("qwen3", dict(r=4, alpha=8.0, dropout=0.0, targets=TARGETS, rslora=True)),
    "mistral-mlp-dropout": ("mistral", dict(r=3, alpha=6.0, dropout=0.1,
                                            targets=["gate_proj", "up_proj", "down_proj"],
                                            rslora=False)),
    # modules_to_save: the embedding, model.norm (lm_head frozen) and every input_layernorm.
    "llama3-qv-save": ("llama3", dict(r=2, alpha=16.0, dropout=0.0, targets=["q_proj", "v_proj"],
                                      rslora=False,
                                      save=["embed_tokens", "norm", "input_layernorm"])),
    # lm_head (model.norm frozen), every q_norm, one block's post_attention_layernorm.
    "qwen3-all-save": ("qwen3", dict(r=4, alpha=8.0, dropout=0.1, targets=TARGETS, rslora=False,
                                     save=["lm_head", "q_norm",
                                           "layers.1.post_attention_layernorm"])),
    # A tied embedding: its gradient gathers the lookup's part and the head's.
    "qwen2-embed-save": ("qwen2", dict(r=2, alpha=4.0, dropout=0.0, targets=["q_proj", "v_proj"],
                                       rslora=False, save=["embed_tokens"])),
    # Mixtures of experts: gate_proj/up_proj/down_proj adapt the dense MLP (layer 1) and every
    # expert; Mixtral's experts by their own names w1/w3/w2, with dropout.
    "qwen3-moe-all": ("qwen3-moe", dict(r=4, alpha=8.0, dropout=0.0, targets=TARGETS,
                                        rslora=False)),
    "mixtral-experts-dropout": ("mixtral", dict(r=2, alpha=4.0, dropout=0.1,
                                                targets=["q_proj", "v_proj", "w1", "w2", "w3"],
                                                rslora=False)),
    # The router named ("gate"): its adapter adds to the logits before the softmax, in the MoE
    # layers only (Qwen3-MoE's layer 1 is dense); Mixtral's with dropout.
    "qwen3-moe-router": ("qwen3-moe", dict(r=4, alpha=8.0, dropout=0.0,
                                           targets=["q_proj", "gate", "down_proj"],
                                           rslora=False)),
    "mixtral-router-dropout": ("mixtral", dict(r=2, alpha=4.0, dropout=0.1,
                                               targets=["gate", "v_proj"], rslora=False)),
}
STEPS = 3
SEED = 1234  # the trainer's seed in lora_train_test.cpp
DROPOUT_KEY = 0x5EED5EED12345678
DROPOUT_SALT = 0x6C6F72612D64726F
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
M64 = (1 << 64) - 1


def splitmix64_at(key, i):
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def keep_mask(key, n, p):
    threshold = int(float(torch.tensor(p, dtype=torch.float32)) * 16777216.0 + 0.5)
    return torch.tensor([1.0 if (splitmix64_at(key, i) >> 40) >= threshold else 0.0
                         for i in range(n)], dtype=torch.float64)


class Lora:
    """The adapters' hyperparameters, the model's config and the current micro-batch's dropout
    key."""

    def __init__(self, spec, config):
        self.spec = spec
        self.config = config
        self.scaling = spec["alpha"] / (math.sqrt(spec["r"]) if spec["rslora"] else spec["r"])
        self.key = None  # None: no dropout (evaluation)


LORA = None


def lora_linear(x, w, name):
    """PEFT's Linear.forward over family_golden's linear."""
    y = x @ w[name + ".weight"].T
    if name + ".bias" in w:
        y = y + w[name + ".bias"]
    a = w.get(name + ".lora_A.weight")
    if a is None:
        return y
    xd = x
    p = LORA.spec["dropout"]
    if p > 0 and LORA.key is not None:
        parts = name.split(".")  # model.layers.<l>.<self_attn|mlp>.<target>
        layer, target = int(parts[2]), ORDER.index(ALIAS.get(parts[-1], parts[-1]))
        if "experts" in parts:
            # An expert's adapters draw as layer num_layers + layer * experts + expert
            # (include/strata/model/lora.h, expert_lora_layer).
            c = LORA.config
            expert = int(parts[parts.index("experts") + 1])
            layer = c["num_hidden_layers"] + layer * fg.num_experts(c) + expert
        key = splitmix64_at(LORA.key, layer * len(ORDER) + target)
        mask = keep_mask(key, x.numel(), p).view(x.shape).to(x.dtype)
        scale = 1.0 / (1.0 - float(torch.tensor(p, dtype=torch.float32)))
        xd = x * mask * scale
    return y + (xd @ a.T) @ w[name + ".lora_B.weight"].T * LORA.scaling


fg.linear = lora_linear


def make_adapters(c, spec, gen):
    d = fg.head_dim(c)
    q, kv, h, f = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["hidden_size"], \
        c["intermediate_size"]
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    targets = [ALIAS.get(t, t) for t in spec["targets"]]
    out = {}

    def add(p, o, inp):
        bound = 1.0 / math.sqrt(inp)
        out[p + ".lora_A.weight"] = ((torch.rand(spec["r"], inp, generator=gen) * 2 - 1)
                                     * bound).float()
        out[p + ".lora_B.weight"] = (0.2 * torch.randn(o, spec["r"], generator=gen)).float()

    for i in range(c["num_hidden_layers"]):
        moe = fg.is_moe_layer(c, i)
        for t in TARGETS:
            if t not in targets or (moe and t in EXPERT_TARGETS):
                continue
            add(f"model.layers.{i}.{MODULE[t]}", *dims[t])
        if not moe:
            continue
        router = fg.moe_names(c, f"model.layers.{i}.")[0]
        if "gate" in targets:
            add(router[:-len(".weight")], fg.num_experts(c), h)
        # Each expert's projections (their names: gate, up, down).
        fe = fg.expert_size(c)
        expert_dims = {"gate_proj": (fe, h), "up_proj": (fe, h), "down_proj": (h, fe)}
        for names in fg.moe_names(c, f"model.layers.{i}.")[1]:
            for t, n in zip(EXPERT_TARGETS, names):
                if t in targets:
                    add(n[:-len(".weight")], *expert_dims[t])
    return out


def saved(spec, name):
    """PEFT's modules_to_save as Strata reads it: a module whose path is the entry or ends with
    "." + the entry trains whole beside the adapters."""
    path = name[:-len(".weight")] if name.endswith(".weight") else None
    return path is not None and any(path == e or path.endswith("." + e)
                                    for e in spec.get("save", []))


def run(base32, adapters32, c, ids, targets, dtype, key):
    base = {k: v.to(dtype) for k, v in base32.items()}
    ad = {k: v.to(dtype).clone().requires_grad_(True) for k, v in adapters32.items()}
    LORA.key = key
    loss = fg.loss_fn({**base, **ad}, c, ids, targets)
    loss.backward()
    return loss.item(), {k: v.grad for k, v in ad.items()}


def train(base32, adapters32, c, ids, targets, dtype):
    base = {k: v.to(dtype) for k, v in base32.items()}
    ad = {k: v.to(dtype).clone().requires_grad_(True) for k, v in adapters32.items()}
    opt = torch.optim.AdamW(list(ad.values()), **ADAMW)
    losses = []
    for step in range(STEPS):
        LORA.key = splitmix64_at(SEED ^ DROPOUT_SALT, step)
        opt.zero_grad()
        loss = fg.loss_fn({**base, **ad}, c, ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in ad.items()}


def main():
    global LORA
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/lora"
    os.makedirs(out_dir, exist_ok=True)
    for n, (name, (family, spec)) in enumerate(CASES.items()):
        c = fg.CASES[family]
        LORA = Lora(spec, c)
        fg.ROUTE_GAP[0] = float("inf")
        gen = torch.Generator().manual_seed(20261203 + n)
        weights = fg.make_weights(c, gen)
        adapters = make_adapters(c, spec, gen)
        # Modules saved whole train beside the adapters, from the base's values.
        base = {k: v for k, v in weights.items() if not saved(spec, k)}
        adapters.update({k: v for k, v in weights.items() if saved(spec, k)})
        assert len(base) < len(weights) or not spec.get("save"), "modules_to_save matched nothing"
        if spec["dropout"] > 0:
            # Every window the same tokens: masks depend on a sequence's row in the batch, and
            # the trainer's sampler orders the windows its own way, so with identical windows
            # its batch is the reference's whatever the order.
            period = torch.randint(0, c["vocab_size"], (fg.SEQ,), generator=gen)
            tokens = period.repeat(fg.WINDOWS + 1)[:fg.WINDOWS * fg.SEQ + 1]
        else:
            tokens = torch.randint(0, c["vocab_size"], (fg.WINDOWS * fg.SEQ + 1,),
                                   generator=gen)
        ids, targets = fg.batch_of(tokens)
        loss, grads = run(base, adapters, c, ids, targets, torch.float64, DROPOUT_KEY)
        unused = [k for k, g in grads.items() if g is None]
        assert not unused, "no gradient (an expert no token chose?): %s" % unused
        loss32, grads32 = run(base, adapters, c, ids, targets, torch.float32, DROPOUT_KEY)
        losses, trained = train(base, adapters, c, ids, targets, torch.float64)
        losses32, trained32 = train(base, adapters, c, ids, targets, torch.float32)
        data = {
            "generator": "tools/golden/lora_golden.py (torch %s, float64; f32 errors from the "
                         "same computation in float32)" % torch.__version__,
            "config": c,
            "lora": {"r": spec["r"], "lora_alpha": spec["alpha"], "lora_dropout": spec["dropout"],
                     "target_modules": spec["targets"], "use_rslora": spec["rslora"],
                     "modules_to_save": spec.get("save")},
            "dropout_key": str(DROPOUT_KEY),
            "seed": SEED,
            "seq": fg.SEQ,
            "windows": fg.WINDOWS,
            "tokens": tokens.tolist(),
            "adamw": dict(ADAMW, betas=list(ADAMW["betas"])),
            # Every base weight (a saved module's initial value too); the adapters and the
            # saved modules, which train.
            "weights": {k: fg.fmt(v, 9) for k, v in weights.items()},
            "adapters": {k: fg.fmt(v, 9) for k, v in adapters.items()},
            "loss": loss,
            "grads": {k: fg.fmt(v, 10) for k, v in grads.items()},
            "f32_loss_error": abs(loss32 - loss),
            "f32_grad_error": {k: float((grads32[k].double() - g).abs().max())
                               for k, g in grads.items()},
            "train_losses": losses,
            "f32_train_loss_error": max(abs(a - b) for a, b in zip(losses32, losses)),
            "trained_adapters": {k: fg.fmt(v, 10) for k, v in trained.items()},
            "f32_trained_error": {k: float((trained32[k].double() - v).abs().max())
                                  for k, v in trained.items()},
        }
        path = os.path.join(out_dir, name + ".json")
        with open(path, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.write("\n")
        print("wrote %s: loss %.10f, trained %s%s" % (
            path, loss, " ".join("%.6f" % x for x in losses),
            ", smallest routing gap %.2e" % fg.ROUTE_GAP[0] if fg.ROUTE_GAP[0] < float("inf")
            else ""))


if __name__ == "__main__":
    main()
