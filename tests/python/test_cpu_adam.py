"""strata.optim.CPUAdam against torch's AdamW and Adam, and against torch's arithmetic with the
compact forms' rounding where torch has no such form; state_dict round trips; the refusals.

Tolerances come from the arithmetic: the engine computes each step in float32 (hyperparameters
formed in double and rounded once, as torch holds them), so per step it may differ from torch's
float32 operations by a few units in the last place of the update (lr-sized) and of the
parameter; over STEPS steps those add up at most linearly.
"""

import copy

import pytest
import torch

import strata
from strata import _core
from strata.optim import CPUAdam

STEPS = 10
EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps


def make_params(dtype=torch.float32, seed=0, shapes=((64, 33), (129,), (7, 5, 3))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def grads_for(params, step, dtype=None):
    """Gradients of each step, the same for every optimizer compared (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).mul_(0.1).to(dtype or p.dtype) for p in params]


def run(opt, params, steps=STEPS, first=0):
    for step in range(first, first + steps):
        for p, grad in zip(params, grads_for(params, step)):
            p.grad = grad.clone()
        opt.step()


def bound(ref, lr, steps=STEPS, rel=EPS32):
    """steps x (a few ulps of the parameter + a few ulps of an lr-sized update)."""
    return steps * (4 * rel * ref.abs() + 8 * EPS32 * lr)


def assert_close(got, ref, tol, what):
    err = (got.float() - ref.float()).abs()
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, worst {err.max().item():.3g} "
                           f"(bound there {tol.flatten()[err.flatten().argmax()].item():.3g})")


def test_version():
    assert strata.__version__ == _core.__version__
    assert strata.__version__.count(".") == 2


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fp32_equals_torch(adamw_mode):
    lr, wd = 1e-2, 0.1
    ours, theirs = make_params(), make_params()
    opt = CPUAdam(ours, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, adamw_mode=adamw_mode)
    torch_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(
        theirs, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, foreach=False)
    run(opt, ours)
    run(torch_opt, theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a.detach(), b.detach(), bound(b.detach(), lr), f"parameter {i}")
        sa, sb = opt.state_dict()["state"][i], torch_opt.state_dict()["state"][i]
        # A moment is a running sum whose terms may cancel: its rounding is relative to the
        # terms' size (torch may also fuse a multiply-add the engine rounds twice).
        for key in ("exp_avg", "exp_avg_sq"):
            want = sb[key]
            assert_close(sa[key], want, STEPS * 4 * EPS32 * want.abs().max(), f"{key} {i}")
        assert float(sa["step"]) == STEPS


def test_param_groups_have_their_own_lr_and_decay():
    ours, theirs = make_params(), make_params()
    groups = lambda ps: [{"params": ps[:1], "lr": 3e-2, "weight_decay": 0.0},
                         {"params": ps[1:], "lr": 1e-3, "weight_decay": 0.5}]
    opt = CPUAdam(groups(ours), lr=1.0)
    torch_opt = torch.optim.AdamW(groups(theirs), lr=1.0, foreach=False)
    run(opt, ours)
    run(torch_opt, theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a.detach(), b.detach(), bound(b.detach(), 3e-2), f"parameter {i}")


def reference_compact(params, steps, lr, betas, eps, wd, state_dtype):
    """torch's AdamW in float32 with the moments stored as state_dtype after each step (the step
    itself uses them unrounded): bfloat16 rounded to nearest even, int8 through the engine's own
    block quantizer."""
    ps = [p.detach().clone().float().reshape(-1) for p in params]
    store = []
    for p in ps:
        store.append([torch.zeros_like(p), torch.zeros_like(p)])
    beta1, beta2 = betas
    for step in range(steps):
        t = step + 1
        for p, grad, st in zip(ps, grads_for(params, step), store):
            grad = grad.float().reshape(-1)
            m = st[0] * beta1 + grad * (1 - beta1)
            v = st[1] * beta2 + grad * grad * (1 - beta2)
            p.mul_(1 - lr * wd)
            denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
            for k, (x, second) in enumerate(((m, False), (v, True))):
                if state_dtype == "bf16":
                    st[k] = x.to(torch.bfloat16).float()
                else:
                    n = x.numel()
                    codes = torch.empty(n, dtype=torch.uint8)
                    scales = torch.empty((n + 63) // 64, dtype=torch.float32)
                    x = x.contiguous()
                    _core.adam8_quantize(values=x.data_ptr(), n=n, second=second,
                                         codes=codes.data_ptr(), scales=scales.data_ptr())
                    out = torch.empty(n, dtype=torch.float32)
                    _core.adam8_dequantize(codes=codes.data_ptr(), scales=scales.data_ptr(), n=n,
                                           second=second, out=out.data_ptr())
                    st[k] = out
    return ps, store


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compact_moments_follow_torch_with_their_rounding(state_dtype):
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.01
    ours = make_params()
    opt = CPUAdam(ours, lr=lr, betas=betas, eps=eps, weight_decay=wd, state_dtype=state_dtype)
    run(opt, ours)
    ref, store = reference_compact(make_params(), STEPS, lr, betas, eps, wd, state_dtype)
    sd = opt.state_dict()["state"]
    for i, p in enumerate(ours):
        assert_close(p.detach().reshape(-1), ref[i], bound(ref[i], lr), f"parameter {i}")
        # The stored moments equal the reference's stored ones up to float32 rounding of the
        # values they were rounded from (which can flip a rounding: one unit of the stored form).
        unit = EPS_BF16 if state_dtype == "bf16" else 0.2
        for k, key in enumerate(("exp_avg", "exp_avg_sq")):
            want = store[i][k]
            got = sd[i][key].reshape(-1)
            scale = want.abs() if state_dtype == "bf16" else want.abs().max()
            assert_close(got, want, unit * scale + 1e-30, f"{key} {i}")


def run_beside_fp32(opt, ours, torch_opt, theirs):
    """STEPS steps of half-precision parameters `ours` and of their fp32 copies `theirs`, each
    with the same gradients (the fp32 ones widened from the half-precision ones)."""
    for step in range(STEPS):
        for p, q, grad in zip(ours, theirs, grads_for(ours, step)):
            p.grad = grad.clone()
            q.grad = grad.float()
        opt.step()
        torch_opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_parameters_keep_an_fp32_master(dtype):
    lr = 1e-2
    ours = make_params(dtype)
    theirs = [p.detach().float().requires_grad_() for p in ours]
    opt = CPUAdam(ours, lr=lr, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(theirs, lr=lr, weight_decay=0.01, foreach=False)
    run_beside_fp32(opt, ours, torch_opt, theirs)
    sd = opt.state_dict()["state"]
    for i, (p, q) in enumerate(zip(ours, theirs)):
        master = sd[i]["master"]
        assert master.dtype == torch.float32
        assert_close(master, q.detach(), bound(q.detach(), lr), f"master {i}")
        assert torch.equal(p.detach(), master.to(dtype)), f"parameter {i} is not its master rounded"


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_master_weights_track_fp32(rounding):
    lr = 1e-2
    ours = make_params(torch.bfloat16)
    theirs = [p.detach().float().requires_grad_() for p in ours]
    opt = CPUAdam(ours, lr=lr, master_dtype="bf16", master_rounding=rounding)
    torch_opt = torch.optim.AdamW(theirs, lr=lr, weight_decay=0.0, foreach=False)
    run_beside_fp32(opt, ours, torch_opt, theirs)
    sd = opt.state_dict()["state"]
    for i, q in enumerate(theirs):
        want = q.detach()
        # Stochastic: each step rounds to one of the two neighbouring bf16 values (an error
        # below one bf16 unit a step). Kahan: the compensation keeps what rounding dropped, to
        # bf16's precision of that remainder.
        rel = EPS_BF16 if rounding == "stochastic" else EPS_BF16 * EPS_BF16 * 4
        assert_close(sd[i]["master"], want, bound(want, lr, rel=rel), f"master {i}")
    if rounding == "kahan":
        assert "master_comp" in opt.state[ours[0]]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_state_dict_round_trip_continues_the_same_bits(state_dtype):
    a = make_params()
    opt = CPUAdam(a, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    run(opt, a, steps=5)
    saved = copy.deepcopy(opt.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = CPUAdam(b, lr=1.0, state_dtype=state_dtype)  # hyperparameters come from the state
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    run(opt, a, steps=5, first=5)
    run(opt_b, b, steps=5, first=5)
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p.detach(), q.detach()), f"parameter {i} differs after the resume"


def test_torch_adamw_reads_our_state_dict():
    lr = 1e-2
    a = make_params()
    opt = CPUAdam(a, lr=lr)
    run(opt, a, steps=5)
    b = [p.detach().clone().requires_grad_() for p in a]
    torch_opt = torch.optim.AdamW(b, lr=lr, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(opt, a, steps=5, first=5)
    run(torch_opt, b, steps=5, first=5)
    for i, (p, q) in enumerate(zip(a, b)):
        assert_close(p.detach(), q.detach(), bound(q.detach(), lr, steps=5), f"parameter {i}")


def test_closure_zero_grad_and_missing_grads():
    w = torch.zeros(8, requires_grad=True)
    frozen = torch.ones(8, requires_grad=True)
    opt = CPUAdam([w, frozen], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = ((w - 1.0) ** 2).sum()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert first.item() == 8.0
    assert torch.all(w > 0)  # moved toward 1
    assert torch.equal(frozen.detach(), torch.ones(8))  # no gradient: untouched
    assert not opt.state[frozen]


@pytest.mark.parametrize("kwargs, words", [
    ({"amsgrad": True}, "amsgrad"),
    ({"bias_correction": False}, "bias_correction"),
    ({"state_dtype": "fp8"}, "state_dtype 'fp8'"),
    ({"master_dtype": "bf16"}, "master_dtype 'bf16'"),
    ({"master_rounding": "up"}, "master_rounding 'up'"),
    ({"lr": -1.0}, "learning rate"),
    ({"simd": "sse9"}, "sse9"),
    ({"fp32_optimizer_states": False, "state_dtype": "fp32"}, "fp32_optimizer_states"),
])
def test_refusals_name_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        CPUAdam(make_params(), **kwargs)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        CPUAdam([torch.zeros(4, 4).t().requires_grad_()])
    with pytest.raises(ValueError, match="float64"):
        CPUAdam([torch.zeros(4, dtype=torch.float64, requires_grad=True)])
    opt = CPUAdam(make_params())
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_reports_its_simd_path_and_threads():
    opt = CPUAdam(make_params(), threads=1, simd="scalar")
    assert opt.simd == "scalar"
    assert opt.threads == 1
