// Text generation from a checkpoint: greedy or sampled decoding with a KV cache, parameters
// served through the tiered store (resident on the device when they fit its budget, else each
// layer fetched from host memory as it is needed, as in training). Under mpirun the model is
// split over the launch's ranks (tensor parallelism), each holding its slices.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/model/llama_config.h"

namespace strata::train {

struct GenerateOptions {
  std::string model_dir;  // a Hugging Face checkpoint directory (a step-*/model included)
  // A PEFT LoRA adapter directory (a LoRA run's step-N included) applied unmerged on top of
  // model_dir; "" for none.
  std::string adapter_dir;
  device::DeviceKind device = device::DeviceKind::kCpu;
  std::uint64_t device_memory_limit = 0;  // required on CUDA; 0 = none on the CPU backend
  DType dtype = DType::kF32;              // compute dtype (f32 or bf16)
  int threads = 0;                        // CPU backend; 0 = every core
  std::int64_t max_new_tokens = 128;
  double temperature = 0.0;  // 0: greedy
  std::int64_t top_k = 0;    // sample among the k most likely (0: all)
  double top_p = 1.0;        // nucleus: the smallest set whose probability reaches top_p
  std::uint64_t seed = 0;
};

struct GenerateStats {
  std::int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_ms = 0, decode_ms = 0;  // the prompt's forward; every later token's
  bool streamed = false;                 // the parameters did not all fit the device budget
};

class Generator {
 public:
  // Reads config.json and the weights (an error names the file), makes the device and the store.
  static Result<std::unique_ptr<Generator>> open(const GenerateOptions& options);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Decodes after `prompt` until a token of `stop_ids` (which is reported, then ends), or
  // max_new_tokens; on_token sees each token as it is chosen and may return false to stop.
  Status generate(std::span<const std::int32_t> prompt, std::span<const std::int32_t> stop_ids,
                  const std::function<bool(std::int32_t)>& on_token);

  const model::LlamaConfig& config() const;
  // This process's rank of the launch (0 alone). Launched with mpirun -np N, the model is split
  // over the N ranks (tensor parallelism); every rank decodes the same tokens and rank 0 reports.
  int rank() const;
  // config.json's eos_token_id (a number or a list); empty when it has none.
  std::vector<std::int32_t> eos_ids() const;
  const GenerateStats& stats() const;
  // "model: ... | device cpu | parameters resident on the device" (or "streamed").
  std::string describe() const;

 private:
  struct Impl;
  explicit Generator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Picks the next token from logits [vocab]: the first largest for temperature 0, else a sample
// of softmax(logits / temperature) restricted to the top_k and top_p sets, drawn with `u`
// uniform in [0, 1).
std::int32_t pick_token(std::span<const float> logits, double temperature, std::int64_t top_k,
                        double top_p, double u);

}  // namespace strata::train
