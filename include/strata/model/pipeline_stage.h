// Pipeline parallelism's split of the model: which layers one stage holds. The layers are cut
// into P * V consecutive runs, the virtual stages; stage s holds runs s, P + s, 2P + s, ...
// (its chunks 0..V-1, Megatron's interleaving; V = 1 is one run a stage). The embedding sits on
// virtual stage 0 (stage 0's chunk 0), the final norm, the LM head and the loss on the last
// (stage P-1's chunk V-1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::model {

struct PipelineStage {
  int stages = 1;          // P
  int virtual_stages = 1;  // V: chunks of layers a stage holds
  int stage = 0;           // this rank's
  // P * V + 1 layer indices: virtual stage v holds layers [bounds[v], bounds[v + 1]). Empty:
  // one stage holding every layer.
  std::vector<std::int64_t> bounds;
  // Micro-batches whose activations the stage holds at once: its schedule's most (the model keeps
  // as many sets).
  int in_flight = 1;

  bool split() const { return stages > 1; }
  int virtual_count() const { return stages * virtual_stages; }
  // The virtual stage chunk `chunk` of this stage is.
  int virtual_of(int chunk) const { return chunk * stages + stage; }
  // Layers [begin, end) of this stage's chunk `chunk`, of a model with `layers` layers.
  std::int64_t chunk_begin(int chunk) const {
    return bounds.empty() ? 0 : bounds[static_cast<std::size_t>(virtual_of(chunk))];
  }
  std::int64_t chunk_end(int chunk, std::int64_t layers) const {
    return bounds.empty() ? layers : bounds[static_cast<std::size_t>(virtual_of(chunk) + 1)];
  }
  // The stage holding layer `layer`, and which of this stage's chunks does (-1: none).
  int stage_holding(std::int64_t layer, std::int64_t layers) const;
  int chunk_of(std::int64_t layer, std::int64_t layers) const;
  bool holds_layer(std::int64_t layer, std::int64_t layers) const {
    return chunk_of(layer, layers) >= 0;
  }
  bool holds_embedding() const { return stage == 0; }
  bool holds_head() const { return stage == stages - 1; }
  // Chunk `chunk` begins with the embedding / ends with the head.
  bool first_chunk(int chunk) const { return virtual_of(chunk) == 0; }
  bool last_chunk(int chunk) const { return virtual_of(chunk) == virtual_count() - 1; }
  // The stages holding the virtual stages before and after chunk `chunk`'s.
  int previous_stage(int chunk) const { return (virtual_of(chunk) - 1) % stages; }
  int next_stage(int chunk) const { return (virtual_of(chunk) + 1) % stages; }
};

// The stage of `stages` x `virtual_stages` whose virtual stage v holds counts[v] layers
// (counts: P * V positive numbers).
PipelineStage pipeline_stage(int stages, int virtual_stages, int stage,
                             const std::vector<std::int64_t>& counts);

// Every reason `counts` cannot cut `layers` layers into P * V virtual stages, naming the values.
std::vector<std::string> pipeline_layers_problems(const std::vector<std::int64_t>& counts,
                                                  int stages, int virtual_stages,
                                                  std::int64_t layers);

}  // namespace strata::model
