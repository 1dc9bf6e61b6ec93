"""strata.optim: Strata's CPU Adam as a torch optimizer.

CPUAdam takes DeepSpeedCPUAdam's arguments, so a script that builds one changes one line:

    from strata.optim import CPUAdam
    opt = CPUAdam(model.parameters(), lr=1e-4, weight_decay=0.01, state_dtype="int8")

It steps CPU parameters in float32, bfloat16 or float16 with the engine's SIMD kernel (AVX-512,
AVX2 or scalar, chosen when it starts) on the engine's threads. Its moments are float32 (as
torch's), bfloat16 or block-wise 8-bit ("int8"); half-precision parameters keep a master copy
(float32, or bfloat16 with stochastic rounding or a Kahan compensation) that the step updates
and rounds into the parameter. state_dict() widens every moment and master copy to float32,
torch.optim.AdamW's layout, which torch's optimizers and load_state_dict() both read.
"""

from collections import defaultdict

import torch

from . import _core

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_STATE_DTYPES = ("fp32", "bf16", "int8")
_MASTER_DTYPES = ("fp32", "bf16")
_MASTER_ROUNDINGS = ("stochastic", "kahan")
_MASK64 = (1 << 64) - 1


def _blocks(n):
    block = _core.adam8_block_elems
    return (n + block - 1) // block


class CPUAdam(torch.optim.Optimizer):
    """AdamW (adamw_mode=True, torch.optim.AdamW's update) or Adam with L2 weight decay
    (adamw_mode=False, torch.optim.Adam's) over CPU parameters.

    DeepSpeedCPUAdam's arguments: model_params, lr, bias_correction (True only), betas, eps,
    weight_decay, amsgrad (False only), adamw_mode, fp32_optimizer_states (False: bfloat16
    moments). Strata's own, by keyword: state_dtype "fp32" | "bf16" | "int8" (the moments;
    overrides fp32_optimizer_states), master_dtype "fp32" | "bf16" and master_rounding
    "stochastic" | "kahan" (the master copy of half-precision parameters), threads (0: one per
    physical core), simd ("auto", "avx512", "avx2", "scalar"), seed (stochastic rounding's).
    """

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, *,
                 state_dtype=None, master_dtype="fp32", master_rounding="stochastic", threads=0,
                 simd="auto", seed=0):
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported (Strata's Adam keeps no "
                             "maximum of past second moments); pass amsgrad=False")
        if not bias_correction:
            raise ValueError("CPUAdam: bias_correction=False is not supported (the step always "
                             "corrects the moments' bias, as torch's Adam and AdamW do); pass "
                             "bias_correction=True")
        if state_dtype is None:
            state_dtype = "fp32" if fp32_optimizer_states else "bf16"
        elif not fp32_optimizer_states and state_dtype == "fp32":
            raise ValueError("CPUAdam: fp32_optimizer_states=False contradicts state_dtype='fp32'")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"CPUAdam: state_dtype {state_dtype!r} is not one of "
                             f"{', '.join(_STATE_DTYPES)}")
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError(f"CPUAdam: master_dtype {master_dtype!r} is not one of "
                             f"{', '.join(_MASTER_DTYPES)}")
        if master_rounding not in _MASTER_ROUNDINGS:
            raise ValueError(f"CPUAdam: master_rounding {master_rounding!r} is not one of "
                             f"{', '.join(_MASTER_ROUNDINGS)}")
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: invalid learning rate {lr} (expected >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"CPUAdam: invalid eps {eps} (expected >= 0)")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"CPUAdam: invalid beta at index {i}: {beta} (expected [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam: invalid weight_decay {weight_decay} (expected >= 0)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=True, amsgrad=False)
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype
        self.master_rounding = master_rounding
        self.seed = seed
        for p in self._params():
            self._check_param(p)
        self._adam = _core.Adam(threads, simd)

    @property
    def simd(self):
        """The SIMD path the step runs: "avx512", "avx2" or "scalar"."""
        return self._adam.simd

    @property
    def threads(self):
        return self._adam.threads

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _check_param(self, p):
        if p.device.type != "cpu":
            raise ValueError(f"CPUAdam: a parameter is on {p.device}; CPUAdam steps CPU "
                             "tensors only")
        if p.dtype not in _DTYPE_NAMES:
            raise ValueError(f"CPUAdam: a parameter is {p.dtype}; expected float32, bfloat16 or "
                             "float16")
        if not p.is_contiguous():
            raise ValueError(f"CPUAdam: a parameter of shape {tuple(p.shape)} is not contiguous")
        if p.dtype == torch.float32 and self.master_dtype != "fp32":
            raise ValueError("CPUAdam: master_dtype 'bf16' is for half-precision parameters; "
                             "float32 parameters are their own master weights")

    # ---- state: compact inside, float32 in state_dict() ----

    def _new_state(self, p):
        """A parameter's state before its first step: zero moments in state_dtype and, for
        half-precision parameters, the master copy."""
        n = p.numel()
        state = {"step": 0}
        if self.state_dtype == "fp32":
            state["exp_avg"] = torch.zeros(n, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.float32)
        elif self.state_dtype == "bf16":
            state["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16)
        else:
            state["exp_avg"] = torch.zeros(n, dtype=torch.uint8)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.uint8)
            state["exp_avg_scale"] = torch.zeros(_blocks(n), dtype=torch.float32)
            state["exp_avg_sq_scale"] = torch.zeros(_blocks(n), dtype=torch.float32)
        if p.dtype != torch.float32:
            if self.master_dtype == "fp32":
                state["master"] = p.detach().reshape(-1).float()
            elif p.dtype == torch.float16:
                state["master"] = p.detach().reshape(-1).to(torch.bfloat16)
            # bfloat16 parameters with bfloat16 master weights are their own master copy.
            if self.master_dtype == "bf16" and self.master_rounding == "kahan":
                state["master_comp"] = torch.zeros(n, dtype=torch.bfloat16)
        return state

    def _master(self, p, state):
        """The tensor the step updates: the master copy, or the parameter itself."""
        return state.get("master", p)

    def _moment(self, state, key, second):
        """A moment widened to float32 (a new tensor)."""
        m = state[key]
        if self.state_dtype != "int8":
            return m.float() if m.dtype != torch.float32 else m.clone()
        out = torch.empty(m.numel(), dtype=torch.float32)
        _core.adam8_dequantize(codes=m.data_ptr(), scales=state[key + "_scale"].data_ptr(),
                               n=m.numel(), second=second, out=out.data_ptr())
        return out

    def _set_moment(self, state, key, second, values):
        values = values.detach().reshape(-1).to(torch.float32).contiguous()
        m = state[key]
        if values.numel() != m.numel():
            raise ValueError(f"CPUAdam.load_state_dict: '{key}' has {values.numel()} elements; "
                             f"its parameter has {m.numel()}")
        if self.state_dtype != "int8":
            m.copy_(values)  # rounded to nearest even, as the engine narrows
            return
        _core.adam8_quantize(values=values.data_ptr(), n=values.numel(), second=second,
                             codes=m.data_ptr(), scales=state[key + "_scale"].data_ptr())

    def _wide_master(self, p, state):
        master = self._master(p, state).detach().reshape(-1).float()
        if "master_comp" in state:
            master = master + state["master_comp"].float()
        return master

    def state_dict(self):
        """torch's layout, every tensor float32: per parameter 'step', 'exp_avg' and 'exp_avg_sq'
        shaped as the parameter and, for half-precision parameters, 'master'."""
        packed = super().state_dict()
        wide = {}
        for index, p in enumerate(self._params()):
            state = self.state.get(p)
            if not state:
                continue
            entry = {"step": torch.tensor(float(state["step"])),
                     "exp_avg": self._moment(state, "exp_avg", False).view_as(p),
                     "exp_avg_sq": self._moment(state, "exp_avg_sq", True).view_as(p)}
            if p.dtype != torch.float32:
                entry["master"] = self._wide_master(p, state).view_as(p)
            wide[index] = entry
        packed["state"] = wide
        return packed

    def load_state_dict(self, state_dict):
        """Reads state_dict()'s layout (or torch.optim.AdamW's): moments narrowed to
        state_dtype; a missing 'master' is taken from the parameter."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"CPUAdam.load_state_dict: the state has {len(groups)} parameter "
                             f"groups; this optimizer has {len(self.param_groups)}")
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"CPUAdam.load_state_dict: parameter group {i} has "
                                 f"{len(saved['params'])} parameters in the state and "
                                 f"{len(mine['params'])} here")
        by_id = {}
        for saved, mine in zip(groups, self.param_groups):
            by_id.update(zip(saved["params"], mine["params"]))
        new_state = defaultdict(dict)
        for key, saved in state_dict["state"].items():
            if key not in by_id:
                raise ValueError(f"CPUAdam.load_state_dict: state for parameter {key}, which "
                                 "no group lists")
            p = by_id[key]
            state = self._new_state(p)
            step = saved["step"]
            state["step"] = int(step.item() if torch.is_tensor(step) else step)
            self._set_moment(state, "exp_avg", False, saved["exp_avg"])
            self._set_moment(state, "exp_avg_sq", True, saved["exp_avg_sq"])
            if "master" in saved and p.dtype != torch.float32:
                wide = saved["master"].detach().reshape(-1).float()
                master = self._master(p, state)
                with torch.no_grad():
                    master.view(-1).copy_(wide)
                    if "master_comp" in state:
                        state["master_comp"].copy_(wide - master.view(-1).float())
            new_state[p] = state
        new_groups = []
        for saved, mine in zip(groups, self.param_groups):
            group = {k: v for k, v in saved.items() if k != "params"}
            group["params"] = mine["params"]
            new_groups.append(group)
        self.__setstate__({"state": new_state, "param_groups": new_groups})

    # ---- the step ----

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                if grad.dtype not in _DTYPE_NAMES:
                    raise RuntimeError(f"CPUAdam: a gradient is {grad.dtype}; expected float32, "
                                       "bfloat16 or float16")
                state = self.state[p]
                if not state:
                    self._check_param(p)
                    state.update(self._new_state(p))
                state["step"] += 1
                master = self._master(p, state)
                separate = master is not p
                int8 = self.state_dtype == "int8"
                seed = (self.seed * 0x9E3779B97F4A7C15 + state["step"] * 0xBF58476D1CE4E5B9
                        + index) & _MASK64
                self._adam.step(
                    param=master.data_ptr(), master_dtype=_DTYPE_NAMES[master.dtype],
                    master_rounding=self.master_rounding,
                    param_comp=state["master_comp"].data_ptr() if "master_comp" in state else 0,
                    rounding_seed=seed, grad=grad.data_ptr(), grad_dtype=_DTYPE_NAMES[grad.dtype],
                    exp_avg=state["exp_avg"].data_ptr(), exp_avg_sq=state["exp_avg_sq"].data_ptr(),
                    state_dtype="uint8" if int8 else _DTYPE_NAMES[state["exp_avg"].dtype],
                    exp_avg_scale=state["exp_avg_scale"].data_ptr() if int8 else 0,
                    exp_avg_sq_scale=state["exp_avg_sq_scale"].data_ptr() if int8 else 0,
                    n=p.numel(), lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    step=state["step"], adamw_mode=self.adamw_mode,
                    param_out=p.data_ptr() if separate else 0,
                    out_dtype=_DTYPE_NAMES[p.dtype])
        return loss
