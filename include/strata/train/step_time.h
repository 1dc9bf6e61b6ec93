// A training step's predicted time, from the plan and rates measured on this machine by short
// probes (strata estimate). Each rate says whether it was measured or assumed, and how.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"

namespace strata::train {

struct Rate {
  double per_s = 0;  // the median of its intervals where timed in several
  bool measured = false;
  std::string how;  // "sgemm 1024^3 on cpu, 0.3 s" or why it is assumed
  // The spread where timed in intervals: the slowest and the fastest interval's rate (0: one
  // figure). A virtual disk's rate swings severalfold under sustained traffic.
  double low_per_s = 0, high_per_s = 0;
  bool has_spread() const { return low_per_s > 0 && high_per_s > 0; }
};

// Several timings of one rate: their median (of an even count, the mean of the middle two), with
// the spread when there are several.
Rate median_rate(std::vector<double> rates, std::string how);

// Milliseconds to move or compute `bytes_or_flops` at `rate` (0 where the rate is unknown).
double ms(double bytes_or_flops, const Rate& rate);

struct MachineRates {
  Rate gemm_flops;  // matrix products in the compute dtype, on the config's device
  // The LM head's products as the model runs them, a chunk of tokens at a time against the
  // vocabulary (a large vocabulary's chunks are a few dozen tokens: skinny products, slower
  // than a layer's); unmeasured: gemm_flops.
  Rate head_gemm_flops;
  // A layer's attention projections (q, k, v, o) at the run's micro-batch; unmeasured:
  // gemm_flops, which is the MLP's.
  Rate attention_gemm_flops;
  // Small models only: forward and backward passes per second of one decoder layer, and of the
  // embedding, head and loss, at the run's micro-batch on its device. Where measured they give
  // the compute time in place of the FLOPs at the GEMM rate.
  Rate layer_passes;
  Rate end_passes;
  Rate memory_bytes;  // host memory copy bandwidth (CPU Adam's bound, CPU-device copies)
  // The device's own memory bandwidth (its AdamW's bound: offload_optimizer_fraction below 1),
  // from an element-wise add on the device.
  Rate device_memory_bytes;
  Rate nvme_read_bytes;  // the swap engine on the first swap path, as configured
  Rate nvme_write_bytes;
  // Each direction's, reading and writing at once (probed, or recorded by strata io-bench): the
  // NVMe-streamed optimizer's reads and writes overlap at this rate.
  Rate nvme_mixed_bytes;
  Rate comm_bytes;        // collective bus bandwidth per rank within a node (several ranks only)
  Rate inter_node_bytes;  // a node's link to the others, each way (several nodes only)
  Json to_json() const;
};

// Short probes (about a second in all): a GEMM on `device` (nullptr: a device of the config's
// kind made for the probe alone, sized for it), for a model whose layers are small the forward
// and backward of 1- and 2-layer models of its shape, a host memory copy, and, when anything lives
// on NVMe, a write and read of a temporary swap file through the configured swap engine (deleted
// afterwards). A device that cannot be made, or no swap paths, leave those rates unmeasured with
// the reason.
MachineRates calibrate(const TrainConfig& config, device::Device* device = nullptr);

// Tokens the LM head and the loss run at once in a micro-batch of `config` (ModelOptions::
// lm_head_chunk_tokens, or the model's own choice where it is 0: every token while the
// vocabulary, this rank's share of it, is at most twice the hidden size, else as many as make
// the chunk's logits twice the hidden states' bytes).
std::int64_t head_rows_of(const TrainConfig& config);

// The GPUs strata estimate --gpu knows: "h100", "h200", "a100", "l40s", "4090", "3090".
inline constexpr const char* kNamedGpus = "h100, h200, a100, l40s, 4090, 3090";
// A named GPU's matrix-product rate in the config's compute dtype (fp32: TF32 tensor cores where
// allow_tf32, else its fp32 units), from its published dense peak times the share of the peak
// cuBLAS reached on an H200 (776 of 989 TFLOP/s in bf16 at 8192^3, bench/RESULTS.md): what
// strata estimate predicts with on a machine without the GPU. An error naming the GPUs it knows.
Result<Rate> named_gpu_gemm_rate(const std::string& gpu, const TrainConfig& config);
// strata estimate --gpu NAME: the named GPU's rate in `rates` in place of what this machine
// measured for the matrix products, and the layers' passes at that rate. Errors: an unknown
// name, a config whose device is "cpu".
Status use_named_gpu(const std::string& gpu, const TrainConfig& config, MachineRates* rates);

// An offloaded frozen base (LoRA's, QLoRA's) and the room device_memory_limit leaves its copies
// on the device beside the plan and the prefetch window (none without a limit, or with the
// parameters on the device): what fits stays there between passes
// (sched::PrefetchOptions::stable), a pass fetches the rest twice.
struct FrozenResidency {
  double frozen_bytes = 0;  // the offloaded frozen groups' working copies
  double room_bytes = 0;
  // The share of the base that stays on the device (1 with no base offloaded).
  double resident_share() const {
    return frozen_bytes > 0 ? std::min(1.0, room_bytes / frozen_bytes) : 1.0;
  }
  double refetched_bytes() const { return std::max(0.0, frozen_bytes - room_bytes); }
};
FrozenResidency frozen_residency(const TrainConfig& config, const Estimate& e);

struct StepTime {
  double compute_ms = 0;    // forward + backward FLOPs (recompute included) at the GEMM rate
  double transfer_ms = 0;   // parameters to the device and gradients off it, NVMe legs included
  double optimizer_ms = 0;  // the update: CPU Adam's memory traffic, or its NVMe streaming
  // offload_optimizer_fraction below 1: the device's AdamW over the groups it keeps, after
  // backward and before the next forward (nothing hides it); optimizer_ms is then the
  // offloaded share's.
  double device_optimizer_ms = 0;
  double comm_ms = 0;  // ZeRO collectives (beside compute)
  // Tensor parallelism's all-reduces of the activations (or all-gathers and reduce-scatters):
  // compute waits for each, so they add to it.
  double tensor_ms = 0;
  // Expert parallelism's token exchanges: compute waits for each.
  double expert_ms = 0;
  // Pipeline stages: the time compute waits in the bubble (fill and drain, and the costliest
  // stage's excess over the average one's), and the sends of the first micro-batch's activations
  // and last's gradients across every boundary, which nothing hides.
  double bubble_ms = 0;
  double boundary_ms = 0;
  double serial_ms = 0;      // the step with the update after compute
  double overlapped_ms = 0;  // with the update beside compute (0 where the plan never overlaps)
  double step_ms = 0;        // the whole step, for the plan's schedule
  std::string schedule;      // how the parts were combined
  // The step at the drive's slowest and fastest measured intervals (Rate's spread), where
  // anything lives on NVMe and its rates were timed in intervals; else 0.
  double slowest_ms = 0, fastest_ms = 0;
  Json to_json() const;
};

// The collectives of one step on `ranks` ranks (tensor_parallel_size of them splitting each layer,
// pipeline_parallel_size stages) at `rates`. ZeRO's: of each rank's slice of its stage's share of
// the model's `parameters`, under stage 3 each micro-batch's gathered twice (forward and
// backward; the embedding and the LM head once) and its gradients reduced, under stages 1 and 2
// each micro-batch's gradients reduced and the updated parameters gathered once, over the
// data-parallel ranks, each sending (D - 1) / D of it: to the peers on its node at the rate within
// a node, to the others through its node's link, which the node's ranks share (ranks_per_node;
// none: one node). Tensor parallelism's: per micro-batch and layer of a stage two all-reduces of
// the micro-batch's b s h activations forward (again where checkpointing recomputes the forward)
// and two in backward, and the embedding's and lm_head's, each sending 2 (T - 1) / T of its
// payload; with LoRA, each adapted projection's whole adapter copy's gradient summed per
// micro-batch (and k's and v's lora_B over their kv replicas).
double zero_comm_ms(const TrainConfig& config, double parameters, int ranks,
                    const MachineRates& rates);
double tensor_parallel_ms(const TrainConfig& config, int ranks, const MachineRates& rates);
// Expert parallelism's exchanges on the critical path: per micro-batch and MoE layer, each
// token's k rows of hidden sent to their experts and the outputs back, in forward (again where
// checkpointing recomputes it) and in backward, (E - 1) / E of them to other ranks under balanced
// routing, over the expert group's E data-parallel ranks. Under expert parallelism ZeRO's
// collectives (zero_comm_ms) move each rank's 1 / E of the experts.
double expert_parallel_ms(const TrainConfig& config, int ranks, const MachineRates& rates);
// Pipeline parallelism's boundary sends on the critical path: one micro-batch's b s h
// activations (its rows alone under sequence parallelism) across each of the P V - 1
// boundaries forward, and its gradients back; with tied embeddings, the embedding's V h sent
// from the first stage to the last. Between nodes (a stage's T x D ranks at least a node's), at
// the node link's rate shared by the node's ranks.
double pipeline_boundary_ms(const TrainConfig& config, int ranks, const MachineRates& rates);
// The pipeline's sends in the steady state: every micro-batch's activations forward and
// gradients back across a middle stage's boundaries, beside the compute.
double pipeline_traffic_ms(const TrainConfig& config, int ranks, const MachineRates& rates);

// The step of `e` (rank 0 of its ranks) on a machine with `rates`. Transfers are taken to
// overlap compute (the prefetcher's aim); the update adds to the step under the serial
// schedule and overlaps compute under the others.
StepTime predict_step(const TrainConfig& config, const Estimate& e, const MachineRates& rates);

// offload_optimizer_fraction "auto" for `config` (its optimizer offloaded): of the fractions
// 0, 1/16, ..., 1, the one whose predicted step is lowest (the host's share hidden beside compute
// where the schedule overlaps, the device's share after backward), the larger on a tie (less
// device memory), raised until the plan fits device_memory_limit. `why` says what was chosen,
// with the times it weighed.
struct FractionChoice {
  double fraction = 1.0;  // the fraction to run with (a sixteenth)
  StepTime step;
  std::string why;
  double planned = 1.0;  // the share of the trained elements its plan offloads (whole groups)
};
// `device_budget_bytes`: device_memory_limit, or the device's own memory (0: no limit).
Result<FractionChoice> choose_offload_fraction(const TrainConfig& config, int ranks,
                                               const MachineRates& rates,
                                               std::uint64_t device_budget_bytes);

// What would let `config`, refused as it stands for a budget too small, run on `ranks` ranks:
// the smallest device_memory_limit one of its open placements needs under the host budget as it
// is, or the smallest host_memory_limit under the device budget as it is (a plan moves gradients
// to NVMe before it asks for more host memory), rounded up, the placements that fit the budgets as
// they are, and the largest smaller micro_batch_size that fits: "; to fit: raise host_memory_limit
// to 6.20 GiB (cpu/cpu), or offload_param cpu and offload_optimizer nvme, or micro_batch_size 2".
// Empty when none does.
std::string changes_to_fit(const TrainConfig& config, int ranks);
// Changes to the training itself, each on a line of its own with what the plan then needs of the
// device and the host and how much less that is: compact optimizer states (int8 moments, bf16
// master weights), LoRA and QLoRA (a full fine-tune), one micro-batch a step (no fp32 gradient
// sums), activation checkpointing or its offload to the host, and swap paths with everything on
// NVMe (none set); each marked where it alone fits the budgets. Empty when none applies.
std::string other_changes(const TrainConfig& config, int ranks);

// estimate(), and a refusal for a budget too small with changes_to_fit's smallest changes that
// would let it run: what strata train and strata estimate tell a user.
Result<Estimate> estimate_with_changes(const TrainConfig& config, int ranks,
                                       const EstimateOptions& options = {});

// offload_param / offload_optimizer "auto": of the placements the config leaves open, the one with
// the lowest predicted step that fits device_memory_limit, host_memory_limit and the free space
// of the swap paths (fewer offloads win a tie). `why` says what was chosen and how the others
// fared. Fails, listing why each was refused, when none fits.
struct PlacementChoice {
  Tier param = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  StepTime step;
  std::string why;
};
Result<PlacementChoice> choose_placement(const TrainConfig& config, int ranks,
                                         const MachineRates& rates);

// parallelism "auto": of the grids of `ranks` ranks (tensor x pipeline x data) that can split the
// model and the batch, and the placements the config leaves open, the one with the lowest
// predicted step whose plan fits the budgets on the first rank of every stage (fewer splits win a
// tie: data parallelism before pipelines before tensor splits). The step counts the ZeRO and
// tensor-parallel collectives, the pipeline's bubble and its boundary sends at `rates`. `why`
// says what was chosen and how each other grid fared. Fails, listing why each was refused, when
// none fits.
struct GridChoice {
  int tensor = 1, pipeline = 1, data = 1;
  Tier param = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  StepTime step;
  std::string why;
  int expert = 1;  // expert_parallel_size (mixtures of experts)
  // `config` on this grid with this placement (on_grid; the placement no longer "auto").
  TrainConfig applied_to(const TrainConfig& config) const;
};
// `config` split `tensor` x `pipeline` (the rest data-parallel, its experts shared out over
// `expert` of those): its schedule kept where it interleaves stages, else 1F1B; each stage's
// layers balanced; sequence parallelism only with a tensor split; parallelism no longer "auto".
TrainConfig on_grid(const TrainConfig& config, int tensor, int pipeline, int expert = 1);
Result<GridChoice> choose_grid(const TrainConfig& config, int ranks, const MachineRates& rates);

}  // namespace strata::train
