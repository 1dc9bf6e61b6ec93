// LlamaModel's decoding: a KV cache per layer, tokens fed a few at a time, the logits of the
// last one.
#include <cstring>

#include "src/model/llama_impl.h"
#include "src/model/vocab_parallel.h"
#include "strata/core/aligned.h"

namespace strata::model {

Status LlamaModel::Impl::begin_decode(ParamProvider& provider, std::int64_t max_positions,
                                      std::int64_t max_rows) {
  if (max_positions <= 0 || max_rows <= 0 || max_rows > max_positions) {
    return invalid_argument("decoding needs 0 < rows <= positions, got rows " +
                            std::to_string(max_rows) + " and positions " +
                            std::to_string(max_positions));
  }
  if (max_positions > config_.max_position_embeddings) {
    return invalid_argument("decoding " + std::to_string(max_positions) +
                            " positions exceeds max_position_embeddings " +
                            std::to_string(config_.max_position_embeddings));
  }
  const BlockSetup setup = decode_setup(max_rows);
  DecodeWorkspace measure;
  const std::uint64_t bytes =
      carve_decode(setup, config_.num_hidden_layers, max_positions, nullptr, &measure);
  STRATA_ASSIGN_OR_RETURN(
      void* base, provider.workspace(bytes, "KV cache and decoding activations (" +
                                                std::to_string(max_positions) + " positions)"));
  carve_decode(setup, config_.num_hidden_layers, max_positions, static_cast<std::byte*>(base),
               &dws_);
  decode_setup_ = setup;
  decode_setup_.base.decoded = dws_.nf4_weight;
  decode_positions_ = max_positions;
  decode_rows_ = max_rows;
  decoded_ = 0;
  workspace_ = nullptr;  // the training workspace, if any, was replaced
  // Token ids in and logits out, then (MoE layers) the routing read back.
  const std::uint64_t io_bytes =
      align_up(static_cast<std::uint64_t>(std::max(max_rows, config_.vocab_size)) * 4, 256);
  STRATA_ASSIGN_OR_RETURN(decode_io_, provider.host_io(io_bytes + moe_host_bytes(config_, max_rows),
                                                       "decoding token ids and logits"));
  if (config_.has_moe()) {
    dws_.moe.place_host(static_cast<std::byte*>(decode_io_) + io_bytes, max_rows, setup.d.experts,
                        setup.d.experts_per_token);
    decode_setup_.moe.device = &device_;
    decode_setup_.moe.scratch = dws_.moe;
  }
  host_io_ = nullptr;  // the training one, if any, was replaced
  return Status::ok();
}

Result<const float*> LlamaModel::Impl::decode(ParamProvider& provider, const std::int32_t* ids,
                                              std::int64_t n) {
  if (decode_positions_ == 0) return failed_precondition("decode before begin_decode");
  if (n <= 0 || n > decode_rows_ || decoded_ + n > decode_positions_) {
    return invalid_argument(
        "decoding " + std::to_string(n) + " tokens after " + std::to_string(decoded_) +
        " exceeds the " + std::to_string(decode_positions_) + " positions (" +
        std::to_string(decode_rows_) + " at a time) begin_decode made room for");
  }
  for (std::int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      return invalid_argument("token " + std::to_string(ids[i]) +
                              " is outside the vocabulary [0, " +
                              std::to_string(config_.vocab_size) + ")");
    }
  }
  BlockSetup setup = decode_setup_;
  Dims& d = setup.d;
  d.rows = n;
  d.seq = n;
  setup.split.rows = setup.split.local_rows = n;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t H = d.hidden, V = d.vocab, L = config_.num_hidden_layers;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  StepTimings timings;
  ProviderSession ps(provider, layout_, timings);
  const int embed = layout_.embed_group();

  // Split, each rank looks up the tokens of its slice of the vocabulary and the rows are summed.
  const detail::VocabParallelEmbedding embedding{&setup.split, V, H, dt};
  auto* host = static_cast<std::int32_t*>(decode_io_);
  std::memcpy(host, ids, static_cast<std::size_t>(n) * 4);
  embedding.to_local_ids(host, n);
  device_.copy_to_device(dws_.ids, host, static_cast<std::size_t>(n) * 4, stream);
  {
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(embed));
    ps.prefetch(layout_.layer_group(0));
    embedding.lookup(ops, dws_.ids, n, offset_ptr(p, embed_offset_, eb), nullptr, dws_.xs[0]);
    ps.release(embed);
    STRATA_RETURN_IF_ERROR(embedding.sum(nullptr, dws_.xs[0]));
  }
  for (std::int64_t l = 0; l < L; ++l) {
    const auto li = static_cast<std::size_t>(l);
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (l + 1 < L) {
      prefetch_block(ps, l + 1);
    } else {
      prefetch_head(ps);
    }
    BlockSetup dl = setup;
    dl.d.window = config_.window_of(l);
    LayerExperts experts = experts_of(ps, l);
    dl.moe.source = &experts;
    detail::DecodeActs acts = dws_.acts;
    acts.x = dws_.xs[l % 2];
    STRATA_RETURN_IF_ERROR(detail::block_decode(ops, dl, w, acts, dws_.k_cache[li],
                                                dws_.v_cache[li], decoded_, dws_.xs[(l + 1) % 2]));
    release_block(ps, l);
  }
  // Head on the last token only; split, each rank's slice of the logits gathered whole.
  STRATA_ASSIGN_OR_RETURN(const HeadWeights head, acquire_head(ps));
  const void* last = offset_ptr(dws_.xs[L % 2], (n - 1) * H, eb);
  ops.rmsnorm_forward(last, head.norm, dws_.hf, dws_.rstd_final, 1, H, d.eps, dt);
  matmul(ops, dt, false, true, 1, V, H, dws_.hf, head.lm, dws_.logits, false);
  release_head(ps);
  if (setup.split.split()) {
    ops.cast(dws_.logits, dt, dws_.logits_local_f32, DType::kF32, V);
    STRATA_RETURN_IF_ERROR(setup.split.group->all_gather(dws_.logits_local_f32, dws_.logits_f32, V,
                                                         DType::kF32, "decoding logits"));
  } else {
    ops.cast(dws_.logits, dt, dws_.logits_f32, DType::kF32, V);
  }
  auto* logits = static_cast<float*>(decode_io_);
  device_.copy_to_host(logits, dws_.logits_f32, static_cast<std::size_t>(config_.vocab_size) * 4,
                       stream);
  stream.synchronize();
  STRATA_RETURN_IF_ERROR(device_.last_error());
  decoded_ += n;
  return static_cast<const float*>(logits);
}

}  // namespace strata::model
