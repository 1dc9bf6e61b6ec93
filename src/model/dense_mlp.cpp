// DenseMlp: SwiGLU between a column-parallel gate/up and a row-parallel down projection.
#include "src/model/dense_mlp.h"

namespace strata::model::detail {

Status DenseMlp::forward(const device::Ops& ops, const void* x, const MlpActs& a, void* scratch,
                         void* partial, void* out) const {
  gate_up.forward(ops, x, {a.gate, a.up}, {a.t_gate, a.t_up}, scratch);
  const Linear& d = down.part;
  ops.swiglu_forward(a.gate, a.up, a.m, d.rows * d.in, d.dtype);
  if (out == nullptr) {
    if (d.adapted()) d.adapter_t(ops, a.m, a.t_down, scratch);
    return Status::ok();
  }
  return down.forward(ops, a.m, partial, out, a.t_down, scratch, "down_proj output");
}

Status DenseMlp::backward(const device::Ops& ops, const void* x, const MlpActs& a,
                          const MlpGrads& g, void* dy, void* dm, void* dx_partial, void* dx,
                          void* x_scratch, const AdapterScratch& s, const void* x_local) const {
  const Linear& d = down.part;
  STRATA_RETURN_IF_ERROR(down.gather_output_grad(dy, "block output gradient"));
  STRATA_RETURN_IF_ERROR(
      d.backward(ops, a.m, a.t_down, g.wd, g.bd, g.down, dy, dm, false, x_scratch, s));
  // In place: gate and up are read here for the last time (their gradients take their room).
  void* const dgate = a.gate;
  void* const dup = a.up;
  ops.swiglu_backward(dm, a.gate, a.up, dgate, dup, d.rows * d.in, d.dtype);
  if (x_local != nullptr) {
    STRATA_RETURN_IF_ERROR(gate_up.gather_input(const_cast<void*>(x),
                                                "post_attention_layernorm output again", x_local));
  }
  const auto& [gate, up] = gate_up.parts;
  STRATA_RETURN_IF_ERROR(
      gate.backward(ops, x, a.t_gate, g.wg, g.bg, g.gate, dgate, dx_partial, false, x_scratch, s));
  STRATA_RETURN_IF_ERROR(
      up.backward(ops, x, a.t_up, g.wu, g.bu, g.up, dup, dx_partial, true, x_scratch, s));
  return gate_up.reduce_input_grad(dx_partial, dx, "gate/up input gradient");
}

}  // namespace strata::model::detail
