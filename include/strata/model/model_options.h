// How a model runs: its compute dtype, checkpointed activations, adapters on a (quantized) base,
// its tensor-parallel slices and sequence parallelism, its LM head's chunks, its pipeline stage
// and its share of the experts. The model (llama.h) and its private pieces (src/model/) read it.
#pragma once

#include <cstdint>
#include <optional>

#include "strata/core/dtype.h"
#include "strata/model/expert_group.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/model/pipeline_stage.h"
#include "strata/model/tensor_group.h"

namespace strata::model {

struct ModelOptions {
  DType compute_dtype = DType::kF32;      // f32 or bf16: weights, activations and gradients
  bool activation_checkpointing = false;  // keep only each block's input; recompute in backward
  // LoRA adapters on a frozen base: the layout must be ParamLayout::build(config, lora, nf4_base).
  std::optional<LoraConfig> lora;
  // QLoRA: the base's projection weights are NF4 (TensorFormat::kNf4), decoded one at a time
  // into workspace before each product.
  bool nf4_base = false;
  // Tensor parallelism: this rank's slices of every layer (the layout must be
  // ParamLayout::build(..., tensor_parallel)), and the group they run over (size and rank the
  // same; only sizes, as for activation_bytes, need none). Column-parallel products' input
  // gradients and row-parallel products' outputs are summed over it, the embedding and the
  // cross-entropy are vocabulary-parallel (the logits never whole).
  TensorParallel tensor_parallel{};
  TensorGroup* tensor_group = nullptr;
  // Megatron's sequence parallelism (a split only): the residual stream, the norms and their
  // activations hold this rank's rows (batch * seq / size of them, which it must divide);
  // all-gathers before the column-parallel products and reduce-scatters after the row-parallel
  // ones take the place of the all-reduces, and the norms' weight gradients are summed.
  bool sequence_parallel = false;
  // Tokens the LM head and the loss run at once (their logits and gradient are that many rows
  // of the vocabulary, never all of them); 0: all of them while the vocabulary is at most twice
  // the hidden size, else as many as make a chunk's logits twice the hidden states' bytes.
  std::int64_t lm_head_chunk_tokens = 0;
  // Pipeline parallelism: the model is this stage's chunks of layers (the layout must be
  // ParamLayout::build(..., pipeline)), run a chunk at a time by forward_chunk and
  // backward_chunk.
  PipelineStage pipeline{};
  // Expert parallelism: this rank's share of every MoE layer's experts (the layout must be
  // ParamLayout::build(..., expert_parallel)) and the group they are shared over (size and rank
  // the same; only sizes, as for activation_bytes, need none). Each token's rows travel to the
  // ranks of its experts and back; the experts' activations hold up to size x this rank's rows
  // (every rank of the group sending all of its rows here: dropless).
  ExpertSplit expert_parallel{};
  ExpertGroup* expert_group = nullptr;
};

}  // namespace strata::model
