// LlamaModel's pipeline stage: its chunk of layers forward (after the embedding on the first
// virtual stage, with the head on the last) and backward, one micro-batch slot at a time.
#include "src/model/llama_impl.h"

namespace strata::model {

// The chunk's layers forward, after the embedding on the first virtual stage; on the last, the
// head and the loss, and with train the head's backward at once (dlogits overwrite the logits),
// leaving the gradient of the chunk's output for backward_chunk.
Status LlamaModel::Impl::forward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                       bool train, StepTimings& timings) {
  Stopwatch clock;
  STRATA_RETURN_IF_ERROR(begin_pass(provider, mb, chunk, train));
  const PipelineStage& stage = options_.pipeline;
  const bool embeds = stage.first_chunk(chunk), heads = stage.last_chunk(chunk);
  const Dims& d = setup_.d;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  SlotSpace& slot = ws_.slots[static_cast<std::size_t>(mb.slot)];
  ChunkSpace& ch = slot.chunks[static_cast<std::size_t>(chunk)];
  ProviderSession ps(provider, layout_, timings);

  if (embeds || heads) {
    STRATA_RETURN_IF_ERROR(check_tokens(mb));
    const HostRows host = host_rows(mb.slot);
    const std::size_t row_bytes = static_cast<std::size_t>(R) * 4;
    if (embeds) {
      std::memcpy(host.ids, mb.inputs, row_bytes);
      embedding().to_local_ids(host.ids, R);
      device_.copy_to_device(slot.ids, host.ids, row_bytes, stream);
    }
    if (heads) {
      std::memcpy(host.targets, mb.targets, row_bytes);
      device_.copy_to_device(slot.targets, host.targets, row_bytes, stream);
    }
  }
  // The chunk's layer inputs: its first and its output the workspace's; checkpointed, the others
  // the provider's, each written once here and read back by its block's backward.
  const bool checkpointing = options_.activation_checkpointing;
  const std::int64_t n = ch.end - ch.begin;
  std::vector<void*> xs = ch.xs;
  const auto inner = [&](std::int64_t i) { return checkpointing && i > 0 && i < n; };
  const auto new_x = [&](std::int64_t i) -> Status {
    if (!inner(i)) return Status::ok();
    STRATA_ASSIGN_OR_RETURN(
        xs[static_cast<std::size_t>(i)],
        provider.write_activation(checkpoint_index(mb.slot, ch.begin + i), checkpoint_bytes()));
    return Status::ok();
  };
  const auto done_x = [&](std::int64_t i, bool keep) -> Status {
    return inner(i) ? provider.release_activation(checkpoint_index(mb.slot, ch.begin + i), keep)
                    : Status::ok();
  };
  // The load-balancing sums start at the embedding and continue from the stage before.
  if (embeds && config_.has_moe()) aux_[static_cast<std::size_t>(mb.slot)].reset(d.experts);
  if (ch.routing_in != nullptr) STRATA_RETURN_IF_ERROR(import_routing(mb.slot, ch.routing_in));
  if (embeds) {
    const int embed = layout_.embed_group();
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(embed));
    if (n > 0) prefetch_block(ps, ch.begin);
    const detail::VocabParallelEmbedding embedding = this->embedding();
    embedding.lookup(ops, slot.ids, R, offset_ptr(p, embed_offset_, eb), ws_.partial, xs[0]);
    ps.release(embed);
    STRATA_RETURN_IF_ERROR(embedding.sum(ws_.partial, xs[0]));
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t l = ch.begin + i;
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (i + 1 < n) {
      prefetch_block(ps, l + 1);
    } else if (heads) {
      prefetch_head(ps);
    }
    STRATA_RETURN_IF_ERROR(new_x(i + 1));
    LayerExperts experts = experts_of(ps, l);
    STRATA_RETURN_IF_ERROR(detail::block_forward(ops, setup_of(l, mb.slot, &experts), w,
                                                 acts_for(ch, i, xs[static_cast<std::size_t>(i)]),
                                                 xs[static_cast<std::size_t>(i + 1)]));
    release_block(ps, l);
    STRATA_RETURN_IF_ERROR(done_x(i, train));  // its block's backward reads it again
  }
  if (ch.routing_out != nullptr) STRATA_RETURN_IF_ERROR(export_routing(mb.slot, ch.routing_out));
  if (heads) {
    STRATA_RETURN_IF_ERROR(head_forward_backward(ps, mb, ch, train));
  }
  timings.forward_ms += clock.elapsed_ms();
  return device_.last_error();
}

// The chunk's layers backward from the gradient of its output (ch.dout), down to the gradient
// of its input: into the embedding's on the first virtual stage, else into ch.din to be sent.
Status LlamaModel::Impl::backward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                        StepTimings& timings) {
  Stopwatch clock;
  STRATA_RETURN_IF_ERROR(begin_pass(provider, mb, chunk, /*train=*/true));
  const PipelineStage& stage = options_.pipeline;
  const bool embeds = stage.first_chunk(chunk);
  const Dims& d = setup_.d;
  const TensorSplit& sp = setup_.split;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden;
  const bool tied = config_.tie_word_embeddings;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  const auto& bwd = ws_.bwd;
  SlotSpace& slot = ws_.slots[static_cast<std::size_t>(mb.slot)];
  ChunkSpace& ch = slot.chunks[static_cast<std::size_t>(chunk)];
  ProviderSession ps(provider, layout_, timings);
  const bool checkpointing = options_.activation_checkpointing;
  const auto layer = [&](std::int64_t l) { return layout_.layer_group(static_cast<int>(l)); };
  const auto adapter = [&](std::int64_t l) { return layout_.adapter_group(static_cast<int>(l)); };
  const auto trains = [&](int group) { return !layout_.group(group).frozen; };
  const auto zero = [&](void* scratch, std::int64_t elems) {
    if (scratch != nullptr) {
      device_.fill_zero(scratch, static_cast<std::size_t>(elems) * eb, stream);
    }
  };
  const std::int64_t n = ch.end - ch.begin;
  // The gradient of the residual stream, layer by layer, in bwd.dh (this rank's rows).
  ops.cast(ch.dout, dt, bwd.dh, dt, sp.local_rows * H);
  // Cut into stages, the last virtual stage's totals over every MoE layer.
  if (ch.totals_in != nullptr) STRATA_RETURN_IF_ERROR(import_routing(mb.slot, ch.totals_in));
  if (config_.has_moe() && config_.moe.aux_loss) {
    // The load-balancing loss's gradient, the same for every token of every MoE layer.
    aux_[static_cast<std::size_t>(mb.slot)].gradient(
        static_cast<double>(mb.grad_scale) * config_.moe.aux_loss_coef, ws_.moe.host_aux_grad);
    device_.copy_to_device(ws_.moe.aux_grad, ws_.moe.host_aux_grad,
                           static_cast<std::size_t>(d.experts) * 4, stream);
  }
  if (checkpointing && n > 1) {
    provider.prefetch_activation(checkpoint_index(mb.slot, ch.end - 1));
  }
  for (std::int64_t i = n - 1; i >= 0; --i) {
    const std::int64_t l = ch.begin + i;
    const auto li = static_cast<std::size_t>(l);
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (i > 0) prefetch_block(ps, l - 1);
    const void* x = ch.xs[static_cast<std::size_t>(i)];
    const bool inner = checkpointing && i > 0;
    if (inner) {
      STRATA_ASSIGN_OR_RETURN(x, provider.read_activation(checkpoint_index(mb.slot, l)));
      if (i > 1) provider.prefetch_activation(checkpoint_index(mb.slot, l - 1));
    }
    // A frozen base's gradients stay null: block_backward skips its weight products.
    const bool base_trains = trains(layer(l));
    BlockGrads grads;
    if (base_trains) {
      STRATA_ASSIGN_OR_RETURN(void* g, ps.acquire_grads(layer(l), GradientWrite::kAdd));
      grads = BlockGrads::at(g, blocks_[li], eb);
    }
    const bool adapters = block_adapted(l);
    if (adapters) {
      STRATA_ASSIGN_OR_RETURN(void* g, ps.acquire_grads(adapter(l), GradientWrite::kAdd));
      grads.overlay(g, block_trained_[li], eb);
      grads.attach_lora(g, adapters_[li], eb);
    }
    const BlockActs acts = acts_for(ch, i, x);
    LayerExperts experts = experts_of(ps, l);
    const BlockSetup dl = setup_of(l, mb.slot, &experts);
    if (checkpointing) STRATA_RETURN_IF_ERROR(detail::block_forward(ops, dl, w, acts, nullptr));
    // The sums block_backward adds into start at zero (absent ones: no-ops).
    for (void* scratch : {bwd.dqn, bwd.dkn}) zero(scratch, d.head_dim);
    for (void* scratch : {bwd.dln1, bwd.dln2}) zero(scratch, H);
    for (void* scratch : {bwd.kdb, bwd.vdb}) zero(scratch, d.kv_dim);
    STRATA_RETURN_IF_ERROR(detail::block_backward(ops, dl, w, acts, grads, bwd));
    release_block(ps, l);
    if (inner) {
      STRATA_RETURN_IF_ERROR(provider.release_activation(checkpoint_index(mb.slot, l), false));
    }
    if (base_trains) STRATA_RETURN_IF_ERROR(ps.release_grads(layer(l)));
    if (adapters) STRATA_RETURN_IF_ERROR(ps.release_grads(adapter(l)));
  }

  if (!embeds) {
    ops.cast(bwd.dh, dt, ch.din, dt, sp.local_rows * H);
  } else if (const int embed = layout_.embed_group(); trains(embed)) {
    // Tied: the head's gradient of the same group, acquired by the head where one stage holds
    // both; cut into stages, the head's part received from the last stage starts the sum.
    const bool received = tied && stage.split();
    void* embed_grads = tied_grads_;
    if (!tied || received) {
      STRATA_ASSIGN_OR_RETURN(embed_grads, ps.acquire_grads(embed, GradientWrite::kAdd));
    }
    if (received) {
      ops.cast(slot.embedding_grad, dt, offset_ptr(embed_grads, embed_offset_, eb), dt,
               d.vocab * H);
    }
    STRATA_RETURN_IF_ERROR(embedding().backward(ops, slot.ids, R,
                                                sp.seq_parallel ? bwd.dh_full : bwd.dh,
                                                offset_ptr(embed_grads, embed_offset_, eb)));
    STRATA_RETURN_IF_ERROR(ps.release_grads(embed));
  }
  if (ch.totals_out != nullptr) STRATA_RETURN_IF_ERROR(export_routing(mb.slot, ch.totals_out));
  stream.synchronize();
  timings.backward_ms += clock.elapsed_ms();
  return device_.last_error();
}

Status LlamaModel::Impl::import_routing(int slot, const void* from) {
  const std::size_t bytes = detail::MoeAux::bytes(setup_.d.experts);
  auto& stream = device_.stream(device::StreamKind::kCompute);
  device_.copy_to_host(ws_.moe.host_routing, from, bytes, stream);
  stream.synchronize();
  aux_[static_cast<std::size_t>(slot)].read(ws_.moe.host_routing);  // sized for d.experts
  return device_.last_error();
}

Status LlamaModel::Impl::export_routing(int slot, void* to) {
  const std::size_t bytes = detail::MoeAux::bytes(setup_.d.experts);
  aux_[static_cast<std::size_t>(slot)].write(ws_.moe.host_routing);
  auto& stream = device_.stream(device::StreamKind::kCompute);
  device_.copy_to_device(to, ws_.moe.host_routing, bytes, stream);
  stream.synchronize();  // the send reads it, and the host bytes are reused
  return device_.last_error();
}

}  // namespace strata::model
