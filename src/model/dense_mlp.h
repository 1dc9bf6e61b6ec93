// Private to the model: a decoder block's MLP (HF LlamaMLP), a piece the block calls beside its
// attention: m = silu(x Wg^T) * (x Wu^T), y = m Wd^T, with gate and up one column-parallel layer
// and down a row-parallel one, each projection with its adapter where it has one.
#pragma once

#include <string_view>

#include "src/model/parallel_layers.h"

namespace strata::model::detail {

// What the MLP keeps for its backward (device pointers, compute dtype): gate and up [rows, ffn]
// (their gradients take their room in backward), m [rows, ffn], and each adapter's t.
struct MlpActs {
  void* gate = nullptr;
  void* up = nullptr;
  void* m = nullptr;
  void* t_gate = nullptr;
  void* t_up = nullptr;
  void* t_down = nullptr;
};

// Its parameters' gradients (null where they do not train).
struct MlpGrads {
  void* wg = nullptr;
  void* wu = nullptr;
  void* wd = nullptr;
  void* bg = nullptr;
  void* bu = nullptr;
  void* bd = nullptr;
  LoraPair<void*> gate, up, down;
};

struct DenseMlp {
  ColumnParallelLinear<2> gate_up;  // gate_proj, up_proj
  RowParallelLinear down;           // down_proj

  // From x [rows, hidden] (every row; gathered by the caller): acts, then unless `out` is null
  // out [local rows, hidden] = m Wd^T (+ bd), summed over the group. A null out (a forward
  // recomputed for the backward) still forms down's adapter t. `scratch` [rows, ffn] holds an
  // adapter's dropped-out input; `partial` [rows, hidden] the product before its
  // reduce-scatter under sequence parallelism.
  Status forward(const device::Ops& ops, const void* x, const MlpActs& a, void* scratch,
                 void* partial, void* out) const;
  // dy [rows, hidden]: the output gradient, this rank's rows in place (gathered here under
  // sequence parallelism) -> dx: this rank's part of the input gradient summed over the group,
  // via `dx_partial` [rows, hidden]. `dm` [rows, ffn] is scratch. With `x_local`, x is gathered
  // again from it before gate's and up's backward (the layers share x's buffer).
  Status backward(const device::Ops& ops, const void* x, const MlpActs& a, const MlpGrads& g,
                  void* dy, void* dm, void* dx_partial, void* dx, void* x_scratch,
                  const AdapterScratch& s, const void* x_local) const;
};

}  // namespace strata::model::detail
