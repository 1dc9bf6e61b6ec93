// One pipeline stage's part of a step and of an evaluation (pipeline_runner.h).
#include "src/train/pipeline_runner.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "strata/train/pipeline_schedule.h"

namespace strata::train {
namespace {

// A boundary's routing counts, as bytes.
std::int64_t bytes(const model::LlamaModel::Boundary& b) {
  return static_cast<std::int64_t>(b.routing_bytes);
}

}  // namespace

Status PipelineRunner::run_step(const std::vector<StepMicroBatch>& micros,
                                const std::function<void()>& last_pass, std::vector<double>* losses,
                                std::vector<double>* aux, double* compute_ms) {
  const model::PipelineStage& stage = p_.stage;
  const PipelineShape shape = p_.config.pipeline_shape(p_.grid.data().world_size());
  const std::vector<PipelinePass> passes =
      stage_passes(p_.config.pipeline_schedule, shape, stage.stage);
  const std::int64_t mb = p_.config.micro_batch_size, seq = p_.config.seq_len;
  const int slots = stage.in_flight;
  STRATA_RETURN_IF_ERROR(p_.model.prepare(p_.provider, mb, seq));
  STRATA_RETURN_IF_ERROR(share_embedding());
  dist::Communicator& pipe = p_.grid.pipeline();
  const DType dt = p_.config.precision;
  // Each (slot, chunk)'s sends in flight: its buffers are not rewritten before they are done.
  const auto at = [&](int slot, int chunk) {
    return static_cast<std::size_t>(slot * stage.virtual_stages + chunk);
  };
  std::vector<dist::CommHandle> sent_output(at(slots, 0)), sent_grad(at(slots, 0));
  // MoE layers: the routing counts so far go with the activations, the totals with the
  // gradients (Boundary::routing_bytes; none without MoE layers).
  std::vector<dist::CommHandle> sent_routing(at(slots, 0)), sent_totals(at(slots, 0));
  // Tied embeddings cut into stages: the head's part of each micro-batch's embedding gradient,
  // from the last stage to the first (rank 1 to 0 of the embedding group), received into the
  // slot's buffer as soon as the slot's forward is done, so that the last stage's send never
  // waits for the first stage's backward.
  dist::Communicator* ends = p_.grid.embedding();
  const std::int64_t embedding_elems = ends != nullptr ? p_.model.embedding_elems() : 0;
  std::vector<dist::CommHandle> embedding_grads(static_cast<std::size_t>(slots));
  dist::CommHandle embedding_grad_sent;
  const auto named = [&](const char* what, const PipelinePass& p, int peer) {
    return std::string(what) + " of micro-batch " + std::to_string(p.micro_batch) +
           (stage.virtual_stages > 1 ? " (chunk " + std::to_string(p.chunk) + ")" : "") +
           " between pipeline stages " + std::to_string(stage.stage) + " and " +
           std::to_string(peer);
  };
  Status status;
  for (std::size_t k = 0; k < passes.size() && status.is_ok(); ++k) {
    const PipelinePass& p = passes[k];
    const StepMicroBatch& mi = micros[static_cast<std::size_t>(p.micro_batch)];
    const int slot = p.micro_batch % slots;
    const model::LlamaModel::MicroBatch batch{mi.inputs.data(), mi.targets.data(), mb,  seq,
                                              mi.grad_scale,    mi.dropout_key,    slot};
    const model::LlamaModel::Boundary b = p_.model.boundary(slot, p.chunk);
    std::int64_t begin = 0;  // the pass's own work, after what it waited to receive
    status = [&]() -> Status {
      if (p.forward) {
        STRATA_RETURN_IF_ERROR(sent_output[at(slot, p.chunk)].wait());
        STRATA_RETURN_IF_ERROR(sent_routing[at(slot, p.chunk)].wait());
        if (!stage.first_chunk(p.chunk)) {
          const int from = stage.previous_stage(p.chunk);
          STRATA_RETURN_IF_ERROR(
              pipe.recv(b.input, b.elems, dt, from, named("activations", p, from)).wait());
          if (b.routing_in != nullptr) {
            STRATA_RETURN_IF_ERROR(pipe.recv(b.routing_in, bytes(b), DType::kU8, from,
                                             named("routing counts", p, from))
                                       .wait());
          }
        }
        const bool sends_embedding_grad = b.embedding_grad != nullptr && stage.last_chunk(p.chunk);
        if (sends_embedding_grad) STRATA_RETURN_IF_ERROR(embedding_grad_sent.wait());
        begin = now_ns();
        // The last chunk's forward makes the head's gradients (its loss's backward) too.
        p_.provider.set_micro_batch(p.micro_batch);
        STRATA_RETURN_IF_ERROR(p_.model.forward_chunk(p_.provider, batch, p.chunk, /*train=*/true));
        if (b.embedding_grad != nullptr && stage.first_chunk(p.chunk)) {
          embedding_grads[static_cast<std::size_t>(slot)] =
              ends->recv(b.embedding_grad, embedding_elems, dt, 1,
                         named("the head's embedding gradient", p, stage.stages - 1));
        }
        if (sends_embedding_grad) {
          embedding_grad_sent = ends->send(b.embedding_grad, embedding_elems, dt, 0,
                                           named("the head's embedding gradient", p, 0));
        }
        if (stage.last_chunk(p.chunk)) {
          (*losses)[static_cast<std::size_t>(p.micro_batch)] =
              static_cast<double>(p_.model.loss(slot)) * mi.share;
          (*aux)[static_cast<std::size_t>(p.micro_batch)] = p_.model.aux_loss(slot) * mi.share;
        } else {
          const int to = stage.next_stage(p.chunk);
          sent_output[at(slot, p.chunk)] =
              pipe.send(b.output, b.elems, dt, to, named("activations", p, to));
          if (b.routing_out != nullptr) {
            sent_routing[at(slot, p.chunk)] =
                pipe.send(b.routing_out, bytes(b), DType::kU8, to, named("routing counts", p, to));
          }
        }
        return Status::ok();
      }
      // The stage's last pass: its gradients are final as they come, and the update may start.
      if (k + 1 == passes.size()) last_pass();
      STRATA_RETURN_IF_ERROR(sent_grad[at(slot, p.chunk)].wait());
      STRATA_RETURN_IF_ERROR(sent_totals[at(slot, p.chunk)].wait());
      if (!stage.last_chunk(p.chunk)) {
        const int from = stage.next_stage(p.chunk);
        STRATA_RETURN_IF_ERROR(
            pipe.recv(b.output_grad, b.elems, dt, from, named("gradients", p, from)).wait());
        if (b.totals_in != nullptr) {
          STRATA_RETURN_IF_ERROR(
              pipe.recv(b.totals_in, bytes(b), DType::kU8, from, named("routing totals", p, from))
                  .wait());
        }
      }
      if (b.embedding_grad != nullptr && stage.first_chunk(p.chunk)) {
        STRATA_RETURN_IF_ERROR(embedding_grads[static_cast<std::size_t>(slot)].wait());
      }
      begin = now_ns();
      p_.provider.set_micro_batch(p.micro_batch);
      STRATA_RETURN_IF_ERROR(p_.model.backward_chunk(p_.provider, batch, p.chunk));
      STRATA_RETURN_IF_ERROR(p_.provider.finish_micro_batch());
      if (!stage.first_chunk(p.chunk)) {
        const int to = stage.previous_stage(p.chunk);
        sent_grad[at(slot, p.chunk)] =
            pipe.send(b.input_grad, b.elems, dt, to, named("gradients", p, to));
        if (b.totals_out != nullptr) {
          sent_totals[at(slot, p.chunk)] =
              pipe.send(b.totals_out, bytes(b), DType::kU8, to, named("routing totals", p, to));
        }
      }
      return Status::ok();
    }();
    if (begin != 0) {
      trace_pass(p_.timeline,
                 std::string(p.forward ? "forward" : "backward") + " micro-batch " +
                     std::to_string(p.micro_batch) + " chunk " + std::to_string(p.chunk),
                 begin);
    }
    *compute_ms += p_.model.last_timings().forward_ms + p_.model.last_timings().backward_ms;
  }
  // Every send ends before the step does (and before its buffers are rewritten).
  embedding_grads.push_back(std::move(embedding_grad_sent));
  for (auto* handles : {&sent_output, &sent_grad, &sent_routing, &sent_totals, &embedding_grads}) {
    for (dist::CommHandle& h : *handles) {
      if (Status s = h.wait(); !s.is_ok() && status.is_ok()) status = s;
    }
  }
  return status;
}

Status PipelineRunner::share_embedding() {
  if (!p_.model.shares_embedding() || embedding_copy_current_) return Status::ok();
  dist::Communicator& ends = *p_.grid.embedding();
  const model::PipelineStage& stage = p_.stage;
  const std::int64_t n = p_.model.embedding_elems();
  const std::string what = "the tied embedding's weights from pipeline stage 0 to stage " +
                           std::to_string(stage.stages - 1);
  if (stage.holds_embedding()) {
    STRATA_ASSIGN_OR_RETURN(const void* weights, p_.model.acquire_embedding(p_.provider));
    const Status sent = ends.send(weights, n, p_.config.precision, 1, what).wait();
    p_.model.release_embedding(p_.provider);
    STRATA_RETURN_IF_ERROR(sent);
  } else {
    STRATA_RETURN_IF_ERROR(
        p_.model.prepare(p_.provider, p_.config.micro_batch_size, p_.config.seq_len));
    STRATA_RETURN_IF_ERROR(
        ends.recv(p_.model.embedding_copy(), n, p_.config.precision, 0, what).wait());
  }
  embedding_copy_current_ = true;
  return Status::ok();
}

Result<float> PipelineRunner::forward(const model::LlamaModel::MicroBatch& mb) {
  const model::PipelineStage& stage = p_.stage;
  dist::Communicator& pipe = p_.grid.pipeline();
  const DType dt = p_.config.precision;
  STRATA_RETURN_IF_ERROR(share_embedding());
  float loss = 0;
  // Virtual stages in order; this stage runs its chunks among them.
  for (int chunk = 0; chunk < stage.virtual_stages; ++chunk) {
    STRATA_RETURN_IF_ERROR(p_.model.prepare(p_.provider, mb.batch, mb.seq));
    const model::LlamaModel::Boundary b = p_.model.boundary(mb.slot, chunk);
    const auto named = [&](int peer) {
      return "evaluation activations (chunk " + std::to_string(chunk) +
             ") between pipeline stages " + std::to_string(stage.stage) + " and " +
             std::to_string(peer);
    };
    if (!stage.first_chunk(chunk)) {
      const int from = stage.previous_stage(chunk);
      STRATA_RETURN_IF_ERROR(pipe.recv(b.input, b.elems, dt, from, named(from)).wait());
      if (b.routing_in != nullptr) {
        STRATA_RETURN_IF_ERROR(
            pipe.recv(b.routing_in, bytes(b), DType::kU8, from, named(from)).wait());
      }
    }
    STRATA_RETURN_IF_ERROR(p_.model.forward_chunk(p_.provider, mb, chunk, /*train=*/false));
    if (stage.last_chunk(chunk)) {
      loss = p_.model.loss(mb.slot);
    } else {
      const int to = stage.next_stage(chunk);
      // Waited at once: the next micro-batch rewrites the buffer.
      STRATA_RETURN_IF_ERROR(pipe.send(b.output, b.elems, dt, to, named(to)).wait());
      if (b.routing_out != nullptr) {
        STRATA_RETURN_IF_ERROR(
            pipe.send(b.routing_out, bytes(b), DType::kU8, to, named(to)).wait());
      }
    }
  }
  return loss;
}

std::string PipelineRunner::describe() const {
  const model::PipelineStage& st = p_.stage;
  if (!st.split()) return "";
  std::string layers;
  for (int v = 0; v < st.virtual_count(); ++v) {
    const std::int64_t b = st.bounds[static_cast<std::size_t>(v)],
                       e = st.bounds[static_cast<std::size_t>(v + 1)];
    layers += (v == 0               ? ""
               : v % st.stages == 0 ? " || "
                                    : " | ") +
              std::to_string(b) + (e - b > 1 ? "-" + std::to_string(e - 1) : "");
  }
  const PipelineShape shape = p_.config.pipeline_shape(p_.grid.data().world_size());
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "pipeline: %d stages, %s schedule%s, layers %s | %d micro-batches a step: "
                "bubble %.1f%% in theory | this rank: stage %d, %d micro-batches in flight\n",
                st.stages, std::string(pipeline_schedule_name(p_.config.pipeline_schedule)).c_str(),
                st.virtual_stages > 1
                    ? (" (" + std::to_string(st.virtual_stages) + " chunks a stage)").c_str()
                    : "",
                layers.c_str(), shape.micro_batches,
                100.0 * theoretical_bubble(p_.config.pipeline_schedule, shape), st.stage,
                st.in_flight);
  return buf;
}

}  // namespace strata::train
