// A config resolved once for a run or an estimate (resolve.h).
#include "strata/train/resolve.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/zero/plan.h"

namespace strata::train {

namespace {

// Every rank must run the same config; a mismatch would silently desynchronize them.
Status check_same_config(const TrainConfig& config, dist::Communicator& comm) {
  const std::uint64_t mine = std::hash<std::string>{}(config.to_json().dump());
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.world_size()));
  STRATA_RETURN_IF_ERROR(comm.all_gather_host(&mine, all.data(), 1, "config hash"));
  for (int r = 0; r < comm.world_size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != all[0]) {
      return invalid_argument("rank " + std::to_string(r) +
                              " runs a different config than rank 0; start every rank with "
                              "the same config and --set flags (a path written with ~ is each "
                              "node's own home directory: write it in full where they differ)");
    }
  }
  return Status::ok();
}

std::string gb_per_s(double bytes_per_s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g GB/s", bytes_per_s / 1e9);
  return buf;
}

// The run's nodes, from each rank's host name: the node of each rank (numbered by their first
// rank) and the host name of this one.
struct Nodes {
  std::vector<int> of_rank;
  int count = 1;
  std::string host;
  // Ranks on the node with the fewest.
  int smallest() const {
    std::vector<int> n(static_cast<std::size_t>(count), 0);
    for (const int k : of_rank) ++n[static_cast<std::size_t>(k)];
    return *std::min_element(n.begin(), n.end());
  }
};
Result<Nodes> find_nodes(dist::Communicator& comm) {
  Nodes nodes;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  nodes.host = name;
  const std::uint64_t mine = std::hash<std::string>{}(nodes.host);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.world_size()));
  STRATA_RETURN_IF_ERROR(comm.all_gather_host(&mine, all.data(), 1, "host names"));
  std::vector<std::uint64_t> seen;
  for (const std::uint64_t h : all) {
    const auto at = std::find(seen.begin(), seen.end(), h);
    nodes.of_rank.push_back(static_cast<int>(at - seen.begin()));
    if (at == seen.end()) seen.push_back(h);
  }
  nodes.count = static_cast<int>(seen.size());
  return nodes;
}

// Each tensor-parallel group inside one node (Megatron's rule: its all-reduces run every layer).
Status check_tensor_groups(const Nodes& nodes, int tensor, int rank) {
  for (std::size_t r = 0; r < nodes.of_rank.size(); ++r) {
    const std::size_t first = r - r % static_cast<std::size_t>(tensor);
    if (nodes.of_rank[r] == nodes.of_rank[first]) continue;
    return invalid_argument(
        "tensor_parallel_size " + std::to_string(tensor) + " puts ranks " + std::to_string(first) +
        " and " + std::to_string(r) +
        " in one tensor-parallel group, but they run on different nodes (this rank, " +
        std::to_string(rank) + ", on " + nodes.host +
        "): a tensor group's all-reduces run every layer and must stay inside a node. Start the "
        "ranks node by node (mpirun's default, --map-by slot; not --map-by node) with a multiple "
        "of " +
        std::to_string(tensor) + " ranks on each node");
  }
  return Status::ok();
}

// Rank 0's values for every rank of a run (timings differ between ranks, and ranks choosing
// differently would not run the same collectives); the values as they are without one.
Status take_rank_zeros(dist::Communicator* comm, std::vector<std::uint64_t>* values,
                       const char* what) {
  if (comm == nullptr || comm->world_size() == 1) return Status::ok();
  const auto n = static_cast<int>(values->size());
  std::vector<std::uint64_t> all(values->size() * static_cast<std::size_t>(comm->world_size()));
  STRATA_RETURN_IF_ERROR(comm->all_gather_host(values->data(), all.data(), n, what));
  values->assign(all.begin(), all.begin() + n);
  return Status::ok();
}

}  // namespace

Result<ResolvedConfig> resolve_config(TrainConfig config, const ResolveOptions& options) {
  ResolvedConfig r;
  const int world = options.world;
  if (options.comm != nullptr && world > 1) {
    STRATA_RETURN_IF_ERROR(check_same_config(config, *options.comm));
  }
  // Where the ranks run: the node layout the step model and the grid planner use.
  std::optional<Nodes> nodes;
  if (options.comm != nullptr && world > 1) {
    STRATA_ASSIGN_OR_RETURN(nodes, find_nodes(*options.comm));
    if (nodes->count > 1) {
      config.ranks_per_node = nodes->smallest();
      r.choices.push_back(
          "nodes: " + std::to_string(nodes->count) + ", at least " +
          std::to_string(config.ranks_per_node) +
          " rank(s) each (by host name); collectives between them at " +
          (config.inter_node_bytes_per_s > 0
               ? gb_per_s(config.inter_node_bytes_per_s) + " (inter_node_bytes_per_s)"
               : std::string("the rate within a node (inter_node_bytes_per_s "
                             "not given)")));
    } else {
      config.ranks_per_node = world;
    }
  }
  const auto rates = [&]() -> Result<const MachineRates*> {
    if (!r.rates) {
      // Measured on the micro-batch the run will have (where gradient_accumulation_steps leaves
      // it to the ranks: as if every rank were data-parallel, the grid being still open).
      TrainConfig probe = config;
      if (!probe.resolve_batch(world).is_ok()) (void)probe.resolve_batch(1);
      MachineRates measured = calibrate(probe, options.probe_device);
      if (!options.gpu.empty()) {
        STRATA_RETURN_IF_ERROR(use_named_gpu(options.gpu, config, &measured));
      }
      r.rates = std::move(measured);
    }
    return &*r.rates;
  };
  if (config.parallelism_auto) {
    STRATA_ASSIGN_OR_RETURN(const MachineRates* measured, rates());
    STRATA_ASSIGN_OR_RETURN(GridChoice choice, choose_grid(config, world, *measured));
    std::vector<std::uint64_t> v = {
        static_cast<std::uint64_t>(choice.tensor), static_cast<std::uint64_t>(choice.pipeline),
        static_cast<std::uint64_t>(choice.param), static_cast<std::uint64_t>(choice.optimizer),
        static_cast<std::uint64_t>(choice.expert)};
    STRATA_RETURN_IF_ERROR(take_rank_zeros(options.comm, &v, "grid"));
    choice.tensor = static_cast<int>(v[0]);
    choice.pipeline = static_cast<int>(v[1]);
    choice.param = static_cast<Tier>(v[2]);
    choice.optimizer = static_cast<Tier>(v[3]);
    choice.expert = static_cast<int>(v[4]);
    config = choice.applied_to(config);
    r.choices.push_back("grid: " + choice.why);
  }
  // tensor_parallel_size consecutive ranks split each layer, pipeline_parallel_size stages hold
  // the layers in turn; ZeRO shards over the rest.
  const int tp = config.tensor_parallel_size, pp = config.pipeline_parallel_size;
  if (options.comm != nullptr) {
    if (world % (tp * pp) != 0) {
      return invalid_argument((pp > 1 ? "tensor_parallel_size " + std::to_string(tp) +
                                            " x pipeline_parallel_size " + std::to_string(pp) +
                                            " = " + std::to_string(tp * pp)
                                      : "tensor_parallel_size " + std::to_string(tp)) +
                              " must divide the " + std::to_string(world) + " ranks this run has");
    }
  }
  // The batch over the data-parallel ranks (estimate names --ranks where the grid does not
  // divide them).
  if (world % (tp * pp) == 0) {
    STRATA_RETURN_IF_ERROR(config.resolve_batch(world / (tp * pp)));
    if (config.sequence_parallel && (config.micro_batch_size * config.seq_len) % tp != 0) {
      return invalid_argument("sequence_parallel: tensor_parallel_size " + std::to_string(tp) +
                              " must divide the " +
                              std::to_string(config.micro_batch_size * config.seq_len) +
                              " tokens of a micro-batch (micro_batch_size x seq_len)");
    }
  }
  if (options.comm != nullptr) {
    STRATA_RETURN_IF_ERROR(check_pipeline_shape(config, world / (tp * pp)));
  }
  if (nodes && tp > 1) STRATA_RETURN_IF_ERROR(check_tensor_groups(*nodes, tp, options.rank));
  r.shape = {world / (tp * pp), tp, pp, config.expert_parallel_size};
  if (r.shape.data % r.shape.expert != 0) {
    return invalid_argument("expert_parallel_size " + std::to_string(r.shape.expert) +
                            " must divide the " + std::to_string(r.shape.data) +
                            " data-parallel ranks this run has");
  }
  if (config.deterministic_reduction_auto) {
    // Several data-parallel ranks (or a resume of a run that had it): the same bits on any number
    // of them; one rank alone keeps a running sum (no partial sums to hold).
    config.deterministic_reduction =
        r.shape.data > 1 || options.resumed_deterministic.value_or(false);
    config.deterministic_reduction_auto = false;
    if (config.deterministic_reduction && config.accumulation_steps(r.shape.data) >= 4) {
      r.choices.push_back(
          "deterministic_reduction: on (" +
          std::string(r.shape.data > 1 ? "several data-parallel ranks" : "the resumed run had it") +
          "): gradients summed in the canonical tree, the same bits on any power-of-two number "
          "of ranks; false keeps one running sum and frees the partial sums' memory");
    }
  }
  if (config.offload_param_auto || config.offload_optimizer_auto) {
    STRATA_ASSIGN_OR_RETURN(const MachineRates* measured, rates());
    STRATA_ASSIGN_OR_RETURN(PlacementChoice choice, choose_placement(config, world, *measured));
    std::vector<std::uint64_t> v = {static_cast<std::uint64_t>(choice.param),
                                    static_cast<std::uint64_t>(choice.optimizer)};
    STRATA_RETURN_IF_ERROR(take_rank_zeros(options.comm, &v, "placement"));
    config.offload_param = static_cast<Tier>(v[0]);
    config.offload_optimizer = static_cast<Tier>(v[1]);
    r.choices.push_back("placement: " + choice.why);
  }
  if (config.offload_optimizer_fraction_auto) {
    if (config.offload_optimizer != Tier::kDevice && !config.save_async) {
      std::uint64_t budget = config.device_memory_limit;
      if (budget == 0 && options.probe_device != nullptr) {
        budget = options.probe_device->memory_stats().limit_bytes;
      }
      // The rates are measured with the fraction still "auto" (the device's memory probe).
      STRATA_ASSIGN_OR_RETURN(const MachineRates* measured, rates());
      config.offload_optimizer_fraction_auto = false;
      Result<FractionChoice> choice = choose_offload_fraction(config, world, *measured, budget);
      // Every rank runs rank 0's choice (the ranks' budgets may differ); a rank that found none
      // says so with NaN, so that all of them meet in the exchange before any returns.
      std::vector<std::uint64_t> v = {std::bit_cast<std::uint64_t>(
          choice.is_ok() ? choice->fraction : std::numeric_limits<double>::quiet_NaN())};
      STRATA_RETURN_IF_ERROR(take_rank_zeros(options.comm, &v, "offload_optimizer_fraction"));
      const double chosen = std::bit_cast<double>(v[0]);
      if (std::isnan(chosen)) {
        return choice.is_ok() ? failed_precondition(
                                    "offload_optimizer_fraction \"auto\": rank 0 "
                                    "found no share that fits its device")
                              : choice.status();
      }
      config.offload_optimizer_fraction = chosen;
      if (choice.is_ok()) r.choices.push_back("offload_optimizer_fraction: " + choice->why);
    } else {
      config.offload_optimizer_fraction_auto = false;
      config.offload_optimizer_fraction = 1.0;  // nothing to split (save_async: all offloaded)
    }
  }
  // Before anything large is allocated: the process's own memory is what estimate measures.
  EstimateOptions plan_options;
  plan_options.rank = options.rank;
  STRATA_ASSIGN_OR_RETURN(r.planned, estimate_with_changes(config, world, plan_options));
  // Metrics and a trace of each rank where the path says {rank}, else of rank 0 alone.
  for (std::string* path : {&config.metrics_file, &config.trace_file}) {
    if (const auto at = path->find("{rank}"); at != std::string::npos) {
      path->replace(at, 6, std::to_string(options.rank));
    } else if (options.rank != 0) {
      path->clear();
    }
  }
  r.config = std::move(config);
  return r;
}

std::string ResolvedConfig::describe() const {
  std::string s;
  for (const std::string& c : choices) s += c + "\n";
  return s + line();
}

std::string ResolvedConfig::line() const {
  std::string s;
  const std::int64_t accum = config.accumulation_steps(shape.data);
  s += "resolved: data " + std::to_string(shape.data) + " x tensor " +
       std::to_string(shape.tensor) + " x pipeline " + std::to_string(shape.pipeline) +
       (shape.expert > 1 ? ", experts over " + std::to_string(shape.expert) : "") +
       " | offload param " + std::string(zero::offload_name(config.offload_param)) +
       ", optimizer " + std::string(zero::offload_name(config.offload_optimizer)) + " | " +
       std::to_string(accum) + " micro-batch" + (accum == 1 ? "" : "es") + " of " +
       std::to_string(config.micro_batch_size) +
       " a step on each data-parallel rank, gradients summed " +
       (std::string(planned.grad_accumulation()) == "none"
            ? "nowhere (one micro-batch: kept as computed)"
            : "on the " + std::string(planned.grad_accumulation())) +
       "\n";
  return s;
}

}  // namespace strata::train
