// Trainer: wires config -> device, swap space, the ZeRO provider, model, data; runs the loop.
#include "strata/train/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <sstream>

#include "src/train/checkpoint_saver.h"
#include "src/train/evaluator.h"
#include "src/train/pipeline_runner.h"
#include "src/train/step_batch.h"
#include "src/train/step_recorder.h"
#include "strata/core/clock.h"
#include "strata/core/file.h"
#include "strata/core/logging.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/io/swap.h"
#include "strata/mem/timeline.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/llama.h"
#include "strata/model/peft_adapter.h"
#include "strata/optim/schedule.h"
#include "strata/train/checkpoint.h"
#include "strata/train/data.h"
#include "strata/train/drive_record.h"
#include "strata/train/estimate.h"
#include "strata/train/pipeline_schedule.h"
#include "strata/train/quantized_cache.h"
#include "strata/train/resolve.h"
#include "strata/train/step_time.h"
#include "strata/zero/expert_group.h"
#include "strata/zero/tensor_group.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

struct Trainer::Impl {
  TrainConfig config;
  TrainOptions options;
  std::unique_ptr<model::ParamLayout> layout;  // this rank's: its slices of its stage's groups
  std::unique_ptr<model::ParamLayout> whole;   // the model's groups unsplit (checkpoints)
  std::unique_ptr<device::Device> device;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<mem::Timeline> timeline;         // before the provider, which records into it
  std::unique_ptr<QuantizedBaseCache> base_cache;  // finetune.quantized_cache
  std::unique_ptr<dist::Communicator> comm;
  std::unique_ptr<dist::ProcessGrid> grid;              // data x tensor x pipeline
  std::unique_ptr<zero::CommTensorGroup> tensor_group;  // the model's, with tensor parallelism
  std::unique_ptr<model::ExpertGroup> expert_group;     // the model's, with expert parallelism
  std::unique_ptr<zero::ZeroProvider> provider;
  std::unique_ptr<model::LlamaModel> model;
  model::ModelOptions model_options;  // this rank's: its tensor-parallel slice, its stage
  std::shared_ptr<TokenDataset> dataset;
  std::unique_ptr<SequenceSampler> sampler;
  optim::LrSchedule schedule;
  std::optional<optim::LossScaler> scaler;  // fp16's loss scaling
  std::int64_t step = 0;                    // optimizer steps completed
  // When this process's first step began, and the steps completed then (a resume's).
  std::int64_t run_begin_ns = 0, run_begin_step = 0;
  Estimate planned;        // what strata estimate says of this config, for the run to compare
  std::string resolution;  // ResolvedConfig::line(): the grid, the tiers, the accumulation
  std::vector<StepMetrics> history;
  std::ofstream metrics;
  // Checkpoints, synchronous or in the background; after the provider and the layouts, which a
  // save in flight reads until the saver is gone.
  std::unique_ptr<CheckpointSaver> saver;

  Status setup();
  Status keep_metrics_until(std::int64_t last);
  // `finish`: wait for the step's optimizer update before returning (the last step of a run).
  Result<StepMetrics> train_step(bool finish);
  // Without a pipeline: the step's micro-batches in turn; each one's loss (share weighted) to
  // (*losses)[micro-batch], its load-balancing loss (MoE) to (*aux)[micro-batch], the model's
  // time to *model_ms.
  Status run_micro_batches(const std::vector<StepMicroBatch>& micros, std::vector<double>* losses,
                           std::vector<double>* aux, double* model_ms);
  // The step's loss and load-balancing loss: every micro-batch's share-weighted value of every
  // stage and data-parallel rank, placed at its micro-batch's place in the global batch (rank r's
  // micro-batch k is the global batch's k * ranks + r) and summed in that order, the same bits on
  // any number of ranks: one collective a group of ranks, in which each place has one rank's
  // value and zeros (adding zeros is exact).
  Result<std::array<double, 2>> global_losses(const std::vector<double>& losses,
                                              const std::vector<double>& aux);
  // The update with the clip and unscale multiplier, or the step skipped (non-finite gradients,
  // an fp16 overflow, no target that counts) with the scaler told.
  Status update_or_skip(double scaled_norm, std::int64_t global_targets, StepMetrics* m);
  // Each step's counters: transfers, optimizer, peaks, collectives, saves' stalls.
  std::unique_ptr<StepRecorder> recorder;
  // The loss scale of the step about to run: the scaler's in fp16, else 1.
  double loss_scale() const { return scaler ? scaler->scale() : 1.0; }
  // The next micro-batch is this rank's (stage's) last of the step: the optimizer may start,
  // guessing the step's gradient multiplier is the loss scale's inverse (no clipping).
  void begin_last_micro_batch() {
    provider->begin_last_micro_batch(schedule.lr_at(step), step + 1, config.grad_clip > 0,
                                     static_cast<float>(1.0 / loss_scale()));
  }
  // With pipeline parallelism: this stage's part of each step and evaluation.
  std::unique_ptr<PipelineRunner> pipeline;
  std::unique_ptr<Evaluator> evaluator;  // with eval_data; reads the pipeline runner
  // Mean loss over eval_data (every rank's slice), into m's eval fields, when this step is due.
  Status evaluate(StepMetrics* m) {
    return evaluator ? evaluator->maybe_evaluate(m) : Status::ok();
  }
  Status write_trace() const;
  // The swap drive's sustained rates over the run, for the next strata estimate (rank 0).
  void record_drive() const;
  TrainerState state() const {
    TrainerState st;
    st.step = step;
    st.sequences_consumed = step * config.batch_size;
    st.seed = config.seed;
    st.world_size = comm->world_size();
    st.tensor_parallel_size = grid->shape().tensor;
    st.pipeline_parallel_size = grid->shape().pipeline;
    if (grid->shape().pipeline > 1) st.pipeline_layers = config.pipeline_layer_counts();
    if (scaler) st.loss_scaler = scaler->state();
    st.config = config.to_json();
    return st;
  }
};

Status Trainer::Impl::setup() {
  std::unique_ptr<model::HfCheckpointReader> reader;
  if (!config.model_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto opened, model::HfCheckpointReader::open(config.model_path));
    reader = std::make_unique<model::HfCheckpointReader>(std::move(opened));
  }
  if (reader) STRATA_RETURN_IF_ERROR(reader->validate(model::ParamLayout::build(config.model)));
  // LoRA from a PEFT adapter: it must be the adapter the config describes.
  std::unique_ptr<model::PeftAdapterReader> adapter;
  if (!config.finetune.adapter.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto opened, model::PeftAdapterReader::open(config.finetune.adapter));
    adapter = std::make_unique<model::PeftAdapterReader>(std::move(opened));
    STRATA_RETURN_IF_ERROR(config.finetune.check_adapter(adapter->config(), config.model.family));
    STRATA_RETURN_IF_ERROR(adapter->validate(config.whole_layout()));
  }

  STRATA_ASSIGN_OR_RETURN(device, device::create_device(config.device_options()));

  dist::CommOptions copts;
  copts.backend = config.dist_backend;
  copts.timeout = std::chrono::seconds(config.dist_timeout_s);
  if (options.make_communicator) {
    STRATA_ASSIGN_OR_RETURN(comm, options.make_communicator(*device));
  } else {
    STRATA_ASSIGN_OR_RETURN(comm, dist::create_communicator(copts, *device));
  }
  const int rank = comm->rank(), world = comm->world_size();
  // The config resolved as strata estimate resolves it: the grid, the placement, {rank} paths
  // and this rank's plan (the one estimate prints for it, and the one its provider runs).
  ResolveOptions ro;
  ro.world = world;
  ro.rank = rank;
  ro.comm = comm.get();
  ro.probe_device = device.get();
  if (!options.resume_dir.empty() && config.deterministic_reduction_auto) {
    // What the resumed run summed in: its saved config's deterministic_reduction (its
    // trainer_state's world size says whether it had several data-parallel ranks, where an older
    // checkpoint does not record it).
    STRATA_ASSIGN_OR_RETURN(const std::string ckpt, resolve_checkpoint(options.resume_dir));
    STRATA_ASSIGN_OR_RETURN(const TrainerState st, read_trainer_state(ckpt));
    const Json* saved = st.config.is_object() && st.config.contains("deterministic_reduction")
                            ? &st.config["deterministic_reduction"]
                            : nullptr;
    ro.resumed_deterministic =
        saved != nullptr && saved->is_boolean()
            ? saved->get<bool>()
            : st.world_size / (st.tensor_parallel_size * st.pipeline_parallel_size) > 1;
  }
  STRATA_ASSIGN_OR_RETURN(ResolvedConfig resolved, resolve_config(config, ro));
  resolution = resolved.line();
  config = std::move(resolved.config);
  planned = std::move(resolved.planned);
  if (rank == 0) {
    for (const std::string& c : resolved.choices) log_info(c);  // what "auto" chose, and why
  }
  if (rank != 0) options.progress = nullptr;  // rank 0 alone reports
  const dist::GridShape shape = resolved.shape;
  const int tp = shape.tensor;
  STRATA_ASSIGN_OR_RETURN(grid, dist::ProcessGrid::create(*comm, shape, *device));
  if (config.model.tie_word_embeddings) STRATA_RETURN_IF_ERROR(grid->link_embedding_stages());
  std::unique_ptr<dist::Communicator> save_comm;
  std::unique_ptr<dist::ProcessGrid> save_grid;
  if (config.save_async) {  // the saves' own communicators, made beside training's
    if (world > 1) {
      STRATA_ASSIGN_OR_RETURN(save_comm, comm->split(0, comm->rank(), "checkpoint saves",
                                                     device::StreamKind::kCollective));
      STRATA_ASSIGN_OR_RETURN(save_grid, dist::ProcessGrid::create(*save_comm, shape, *device));
    } else {
      save_grid = dist::ProcessGrid::single_rank(*device);
    }
  }
  const dist::GridCoord at = grid->coord();
  layout =
      std::make_unique<model::ParamLayout>(config.param_layout(at.tensor, at.pipeline, at.expert));
  whole = std::make_unique<model::ParamLayout>(config.whole_layout());
  // The process's own memory, now that its communicators exist and before anything large is
  // allocated: what the run's resident memory is predicted from.
  planned.measure_process();
  if (config.uses_nvme()) {
    STRATA_RETURN_IF_ERROR(make_rank_swap_dirs(config, rank));
    io::SwapOptions so = swap_options(config, rank);
    so.fault_injection = options.swap_faults;
    STRATA_ASSIGN_OR_RETURN(swap, io::SwapSpace::create(so));
  }

  // The model first: the memory plan counts its device workspace.
  model_options = config.model_options(at.pipeline, shape.data);
  model_options.tensor_parallel.rank = at.tensor;
  if (tp > 1) {
    STRATA_ASSIGN_OR_RETURN(
        tensor_group,
        zero::make_tensor_group(grid->tensor(), *device, config.model.num_key_value_heads));
    model_options.tensor_group = tensor_group.get();
  }
  model_options.expert_parallel.rank = at.expert;
  if (shape.expert > 1) {  // the tokens travel over the grid's expert group
    expert_group = zero::make_expert_group(grid->expert());
    model_options.expert_group = expert_group.get();
  }
  model = std::make_unique<model::LlamaModel>(config.model, *layout, *device, model_options);

  zero::ShardOptions sopts = shard_options(config, shape.data, at.pipeline);
  timeline = std::make_unique<mem::Timeline>(/*record_spans=*/!config.trace_file.empty());
  sopts.timeline = timeline.get();  // the plan (with this rank's free swap space) is `planned`
  const zero::ZeroOptions zopts = zero_options(config, shape.data);
  // Said when it lowers a size the config chose (the defaults are capped silently, as the
  // README says).
  const auto lowered = [](std::uint64_t used, std::uint64_t configured, std::uint64_t dflt) {
    return used < configured && configured != dflt;
  };
  if (comm->world_size() > 1 && comm->rank() == 0 &&
      (lowered(zopts.reduce_bucket_bytes, config.reduce_bucket_bytes,
               zero::kDefaultReduceBucketBytes) ||
       lowered(zopts.allgather_bucket_bytes, config.allgather_bucket_bytes,
               zero::kDefaultAllgatherBucketBytes))) {
    log_info("collective buckets capped at 1/16 of device_memory_limit: reduce " +
             format_bytes(zopts.reduce_bucket_bytes) + ", all-gather " +
             format_bytes(zopts.allgather_bucket_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(
      provider, zero::ZeroProvider::create(*layout, config.param_persistence_threshold, *device,
                                           swap.get(), *grid, zopts, sopts, &planned.plan));
  saver = std::make_unique<CheckpointSaver>(
      CheckpointSaver::Parts{config, *layout, *whole, *provider, *grid, rank == 0, options.progress,
                             options.async_save_started},
      std::move(save_comm), std::move(save_grid));
  recorder = std::make_unique<StepRecorder>(StepRecorder::Rooms{
      *provider, *device, *timeline, swap.get(), *grid, tensor_group.get(), planned});
  if (shape.pipeline > 1) {
    pipeline = std::make_unique<PipelineRunner>(
        PipelineRunner::Parts{config, *model, *provider, *grid, *timeline, model_options.pipeline});
  }
  const model::GroupSource seeded = [&](const model::ParamGroup& g, float* dst) {
    model::init_group(config.model, g, config.seed, dst);
    return Status::ok();
  };
  // Where the base weights come from: the model directory, else the seed.
  const model::GroupSource base_source = [&](const model::ParamGroup& g, float* dst) {
    return reader ? reader->read_group(g, dst) : seeded(g, dst);
  };
  // The frozen base a piece at a time: no fp32 copy of a whole group beside the working copy.
  const model::GroupRangeSource base_pieces = [&](const model::ParamGroup& g, std::int64_t begin,
                                                  std::int64_t count, float* dst) {
    if (reader) return reader->read_group_range(g, begin, count, dst);
    model::init_group_range(config.model, g, config.seed, begin, count, dst);
    return Status::ok();
  };

  if (const std::string& dir = config.finetune.quantized_cache; config.nf4_base() && !dir.empty()) {
    // Rank 0 claims the directory for this base, then the first data-parallel rank of each
    // tensor slice and stage writes what it quantizes.
    STRATA_ASSIGN_OR_RETURN(const Json identity, quantized_base_identity(config));
    if (rank == 0) STRATA_RETURN_IF_ERROR(QuantizedBaseCache::claim(dir, identity));
    if (world > 1) STRATA_RETURN_IF_ERROR(comm->barrier("finetune.quantized_cache claimed"));
    STRATA_ASSIGN_OR_RETURN(base_cache, QuantizedBaseCache::open(dir, identity, at.data == 0,
                                                                 model_options.tensor_parallel));
  }
  if (config.precision == DType::kF16) scaler.emplace(config.loss_scaler);
  if (!options.resume_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string ckpt, resolve_checkpoint(options.resume_dir));
    STRATA_ASSIGN_OR_RETURN(TrainerState st, read_trainer_state(ckpt));
    if (st.seed != config.seed) {
      log_warning("resuming " + ckpt + " with seed " + std::to_string(config.seed) +
                  " but it was trained with seed " + std::to_string(st.seed) +
                  "; the data order will differ from the original run");
    }
    STRATA_RETURN_IF_ERROR(load_checkpoint(ckpt, config.model, *layout, *whole,
                                           model_options.tensor_parallel, *provider, base_source,
                                           base_cache.get(), base_pieces)
                               .with_context("resuming from " + ckpt));
    step = st.step;
    const std::string note =
        moments_conversion_note(st, precision_name(config.optimizer.state_dtype));
    if (!note.empty()) log_info(note);
    if (scaler && st.loss_scaler) {
      STRATA_RETURN_IF_ERROR(
          scaler->restore(*st.loss_scaler).with_context(ckpt + "/trainer_state.json"));
    }
    log_info("resumed from " + ckpt + " at step " + std::to_string(step));
  } else {
    // Adapters (and modules_to_save) from `adapter`, else adapters from the seed; every other
    // tensor from the base: the checkpoint directory or the seed.
    const model::GroupSource source =
        adapter ? adapter->over(base_source)
                : model::split_source(
                      [](const model::TensorSpec& t) { return model::is_lora_tensor(t.name); },
                      seeded, base_source);
    STRATA_RETURN_IF_ERROR(provider->load_master(source, base_cache.get(), base_pieces));
  }
  if (base_cache && rank == 0) log_info(base_cache->describe());

  STRATA_ASSIGN_OR_RETURN(dataset, TokenDataset::open(config.data.path, config.data.format));
  if (dataset->num_tokens() < config.seq_len + 1) {
    return invalid_argument(
        "data file " + config.data.path + " has " + std::to_string(dataset->num_tokens()) +
        " tokens, fewer than seq_len + 1 = " + std::to_string(config.seq_len + 1));
  }
  sampler = std::make_unique<SequenceSampler>(dataset, config.seq_len, config.seed);
  STRATA_RETURN_IF_ERROR(attach_loss_mask(config.data.path, dataset->format(), sampler.get()));
  if (config.eval_data) {
    STRATA_ASSIGN_OR_RETURN(evaluator,
                            Evaluator::open({config, *model, *provider, *grid, pipeline.get()}));
  }

  schedule = config.schedule();

  if (!config.metrics_file.empty()) {
    std::error_code ec;
    const auto parent = std::filesystem::path(config.metrics_file).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    // A resume keeps the lines of the steps up to its checkpoint's: the steps after it, trained
    // before the run stopped, are trained again (each step once in the file).
    if (!options.resume_dir.empty()) STRATA_RETURN_IF_ERROR(keep_metrics_until(step));
    metrics.open(config.metrics_file, options.resume_dir.empty() ? std::ios::trunc : std::ios::app);
    if (!metrics)
      return io_error("cannot open metrics file " + config.metrics_file + " for writing");
  }
  return Status::ok();
}

// Rewrites the metrics file (atomically) without the lines of steps after `last`; a file that
// does not exist yet is left so.
Status Trainer::Impl::keep_metrics_until(std::int64_t last) {
  auto text = read_file(config.metrics_file);
  if (!text.is_ok()) return Status::ok();
  std::string kept;
  std::istringstream in(*text);
  std::string line;
  bool dropped = false;
  for (int number = 1; std::getline(in, line); ++number) {
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::exception&) {
      // A line cut short by the stop: nothing after it is kept either.
      dropped = true;
      break;
    }
    if (j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<std::int64_t>() > last) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (!dropped) return Status::ok();
  return write_file_atomic(config.metrics_file, kept);
}

Result<StepMetrics> Trainer::Impl::train_step(bool finish) {
  recorder->begin();
  StepMetrics m;
  m.step = step + 1;
  if (scaler) m.loss_scale = scaler->scale();
  const bool overflow = options.overflow_at && options.overflow_at(comm->rank(), m.step);
  STRATA_ASSIGN_OR_RETURN(
      const StepBatch batch,
      make_step_batch(config, *sampler, step, grid->data().world_size(), grid->data().rank(),
                      m.loss_scale.value_or(1.0), overflow));

  // The micro-batches: forward and backward, the gradients landing where the plan keeps them
  // (and the experts' traffic of this step's alone: an evaluation's before it is not).
  model->take_expert_traffic();
  std::vector<double> losses(batch.micros.size(), 0.0), aux(losses.size(), 0.0);
  double model_ms = 0;
  if (pipeline) {
    STRATA_RETURN_IF_ERROR(pipeline->run_step(
        batch.micros, [&] { begin_last_micro_batch(); }, &losses, &aux, &model_ms));
  } else {
    STRATA_RETURN_IF_ERROR(run_micro_batches(batch.micros, &losses, &aux, &model_ms));
  }
  m.compute_ms = recorder->compute_ms(model_ms);
  m.loss_tokens = batch.global_targets;
  STRATA_ASSIGN_OR_RETURN(const auto sums, global_losses(losses, aux));
  m.loss = sums[0];
  if (config.model.has_moe()) {
    m.aux_loss = sums[1];
    const model::ExpertTraffic t = model->take_expert_traffic();
    m.experts_run = t.run;
    m.experts_skipped = t.skipped;
    m.expert_bytes = t.bytes;
  }

  // The norm of the gradients as computed: times the loss scale in fp16. Every rank has the same
  // sum (an overflow on any rank makes it infinite on all), so all skip together.
  m.lr = schedule.lr_at(step);
  STRATA_ASSIGN_OR_RETURN(const double scaled_norm, provider->grad_norm());
  m.grad_norm = scaled_norm / m.loss_scale.value_or(1.0);

  // The optimizer step, or a skip.
  STRATA_RETURN_IF_ERROR(update_or_skip(scaled_norm, batch.global_targets, &m));
  if (pipeline && !layout->group(layout->embed_group()).frozen) pipeline->embedding_changed();
  // An overlapped update runs on into the next step's forward; the last step of a run waits.
  if (finish) STRATA_RETURN_IF_ERROR(provider->finish_step());
  ++step;

  recorder->finish(config.batch_size * config.seq_len, &m);
  return m;
}

Status Trainer::Impl::run_micro_batches(const std::vector<StepMicroBatch>& micros,
                                        std::vector<double>* losses, std::vector<double>* aux,
                                        double* model_ms) {
  const std::int64_t mb = config.micro_batch_size, seq = config.seq_len;
  for (std::size_t micro = 0; micro < micros.size(); ++micro) {
    const StepMicroBatch& mi = micros[micro];
    // The last micro-batch's gradients are final as they come: the update may start with them.
    if (micro + 1 == micros.size()) begin_last_micro_batch();
    const std::int64_t begin = now_ns();
    provider->set_micro_batch(static_cast<std::int64_t>(micro));
    STRATA_ASSIGN_OR_RETURN(
        float loss, model->forward_backward(*provider, mi.inputs.data(), mi.targets.data(), mb, seq,
                                            mi.grad_scale, mi.dropout_key));
    STRATA_RETURN_IF_ERROR(provider->finish_micro_batch());
    trace_pass(*timeline, "micro-batch " + std::to_string(micro), begin);
    *model_ms += model->last_timings().forward_ms + model->last_timings().backward_ms;
    (*losses)[micro] = static_cast<double>(loss) * mi.share;
    (*aux)[micro] = model->last_aux_loss() * mi.share;
  }
  return Status::ok();
}

Result<std::array<double, 2>> Trainer::Impl::global_losses(const std::vector<double>& losses,
                                                           const std::vector<double>& aux) {
  const int ranks = grid->data().world_size(), rank = grid->data().rank();
  const std::size_t micros = losses.size();
  const std::size_t places = micros * static_cast<std::size_t>(ranks);
  std::vector<double> all(2 * places, 0.0);  // the losses by global place, then the aux losses
  for (std::size_t k = 0; k < micros; ++k) {
    const std::size_t place = k * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(rank);
    all[place] = losses[k];
    all[places + place] = aux[k];
  }
  const int count = static_cast<int>(all.size());
  // The last stage's losses to every stage (the others hold zeros).
  if (grid->shape().pipeline > 1) {
    STRATA_RETURN_IF_ERROR(grid->pipeline().all_reduce_host(all.data(), count, dist::ReduceOp::kSum,
                                                            "loss (pipeline)"));
  }
  if (ranks > 1) {
    STRATA_RETURN_IF_ERROR(
        grid->data().all_reduce_host(all.data(), count, dist::ReduceOp::kSum, "loss"));
  }
  std::array<double, 2> sums = {0.0, 0.0};
  for (std::size_t p = 0; p < places; ++p) {
    sums[0] += all[p];
    sums[1] += all[places + p];
  }
  return sums;
}

Status Trainer::Impl::update_or_skip(double scaled_norm, std::int64_t global_targets,
                                     StepMetrics* out) {
  StepMetrics& m = *out;
  const double loss_scale = m.loss_scale.value_or(1.0);
  if (!std::isfinite(scaled_norm) || global_targets == 0) {
    // Every rank counts the same targets.
    m.skipped = true;
    STRATA_RETURN_IF_ERROR(provider->zero_grads());
    if (global_targets == 0) {
      log_warning("step " + std::to_string(m.step) +
                  ": no target of the batch counts; skipping the update");
    } else if (scaler) {
      STRATA_RETURN_IF_ERROR(
          scaler->update(/*overflow=*/true).with_context("step " + std::to_string(m.step)));
      log_info("step " + std::to_string(m.step) + ": the gradients overflowed at loss scale " +
               format_scale(loss_scale) + "; skipping the update (" +
               (scaler->scale() < loss_scale
                    ? "the scale is now " + format_scale(scaler->scale())
                    : std::string("the scale stays: the hysteresis allows this overflow")) +
               ")");
    } else {
      log_warning("step " + std::to_string(m.step) +
                  ": gradient norm is not finite; skipping the update");
    }
  } else {
    // Unscaled by the same multiplier that clips: exact, for a loss scale that is a power of two.
    const auto scale =
        static_cast<float>(optim::clip_scale(m.grad_norm, config.grad_clip) / loss_scale);
    STRATA_RETURN_IF_ERROR(provider->step(m.lr, m.step, scale));
    if (scaler) STRATA_RETURN_IF_ERROR(scaler->update(/*overflow=*/false));
  }
  return Status::ok();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainConfig& config,
                                                 const TrainOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  STRATA_RETURN_IF_ERROR(impl->setup());
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<std::string> Trainer::save() {
  Impl& s = *impl_;
  if (s.config.save_dir.empty()) {
    return failed_precondition("no checkpoint can be saved: save_dir is \"\" (no checkpoints)");
  }
  // Training's time lost to the save: a synchronous one whole, an asynchronous one's start.
  Stopwatch stall;
  Result<std::string> path = s.saver->save(s.state());
  s.recorder->add_save_stall(stall.elapsed_ms());
  return path;
}

const std::string& Trainer::last_checkpoint() const { return impl_->saver->last_checkpoint(); }

const TrainConfig& Trainer::resolved_config() const { return impl_->config; }

std::string Trainer::device_name() const { return impl_->device->name(); }

namespace {
// "fp16 (dynamic loss scale 65536, window 1000, hysteresis 2)"; the others by name.
std::string precision_with_scaling(const TrainConfig& config, const optim::LossScaler* scaler) {
  const std::string name(precision_name(config.precision));
  if (scaler == nullptr) return name;
  const optim::LossScalerConfig& l = config.loss_scaler;
  if (!scaler->dynamic()) return name + " (static loss scale " + format_scale(l.loss_scale) + ")";
  return name + " (dynamic loss scale " + format_scale(scaler->scale()) + ", window " +
         std::to_string(l.loss_scale_window) + ", hysteresis " + std::to_string(l.hysteresis) + ")";
}

}  // namespace

Status Trainer::Impl::write_trace() const {
  if (config.trace_file.empty()) return Status::ok();
  std::error_code ec;
  const auto parent = std::filesystem::path(config.trace_file).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  return timeline->write_chrome_trace(config.trace_file);
}

Status Trainer::run() {
  // The trace is written however the run ends: a failed step is when it helps most.
  Status s = run_loop();
  // However the run ends (a stop request included), the save in flight completes first.
  Status f = impl_->saver->finish();
  Status t = impl_->write_trace();
  if (!s.is_ok()) return s;
  STRATA_RETURN_IF_ERROR(f);
  STRATA_RETURN_IF_ERROR(t);
  impl_->record_drive();
  return Status::ok();
}

void Trainer::Impl::record_drive() const {
  if (!swap || comm->rank() != 0 || swap->engine_name() == "memory") return;
  const std::optional<DriveRecord> record = drive_record(history, swap->engine_name());
  if (!record) return;
  const std::string dir = swap_options(config, 0).paths.front();
  // The run is done and its results safe: a record that cannot be written costs the next
  // estimate its learned rates, nothing more.
  if (Status s = write_drive_record(dir, *record); !s.is_ok()) {
    log_warning("the swap drive's rates were not recorded for strata estimate: " + s.message());
    return;
  }
  if (options.progress != nullptr) {
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  "the swap drive sustained %.2f GB/s reading and %.2f GB/s writing, %.2f GB/s "
                  "each way at once, over %d step(s)",
                  record->read.per_s / 1e9, record->write.per_s / 1e9, record->mixed.per_s / 1e9,
                  record->steps);
    *options.progress << buf << "; recorded in " << dir << "/" << kDriveRecordFile
                      << " for strata estimate" << std::endl;
  }
}

Status Trainer::run_loop() {
  Impl& s = *impl_;
  while (s.step < s.config.max_steps) {
    if (s.options.before_step) s.options.before_step(s.comm->rank(), s.step + 1);
    if (s.run_begin_ns == 0) {
      s.run_begin_ns = now_ns();
      s.run_begin_step = s.step;
    }
    STRATA_ASSIGN_OR_RETURN(StepMetrics m, s.train_step(s.step + 1 == s.config.max_steps));
    STRATA_RETURN_IF_ERROR(s.evaluate(&m));
    m.elapsed_s = static_cast<double>(now_ns() - s.run_begin_ns) / 1e9;
    m.eta_s = m.elapsed_s / static_cast<double>(m.step - s.run_begin_step) *
              static_cast<double>(s.config.max_steps - m.step);
    s.history.push_back(m);
    if (s.options.progress != nullptr &&
        (m.step % s.config.log_every == 0 || m.step == s.config.max_steps || m.step == 1)) {
      *s.options.progress << progress_line(m, s.config.max_steps) << std::endl;
    }
    if (s.options.progress != nullptr && m.eval_loss) {
      *s.options.progress << eval_line(m, s.config.max_steps) << std::endl;
    }
    if (s.metrics.is_open()) {
      s.metrics << m.to_json().dump() << "\n";
      s.metrics.flush();
    }
    if (s.options.after_step) s.options.after_step(m);
    bool stop = s.options.stop_requested != nullptr && s.options.stop_requested->load();
    if (s.comm->world_size() > 1) {
      // A stop seen by any rank stops all of them at the same step, so they save together.
      double any = stop ? 1.0 : 0.0;
      STRATA_RETURN_IF_ERROR(
          s.comm->all_reduce_host(&any, 1, dist::ReduceOp::kSum, "stop request"));
      stop = any > 0;
    }
    // save_dir "" writes no checkpoint at all: dry runs and benchmarks at scale.
    const bool saving = !s.config.save_dir.empty();
    const bool periodic = s.config.save_every > 0 && s.step % s.config.save_every == 0;
    STRATA_RETURN_IF_ERROR(s.saver->poll());  // an asynchronous save that has ended
    if (saving && (stop || periodic || s.step == s.config.max_steps)) {
      STRATA_ASSIGN_OR_RETURN(std::string path, save());
      if (s.options.progress != nullptr) {
        *s.options.progress << (s.config.save_async ? "saving checkpoint " : "saved checkpoint ")
                            << path << (s.config.save_async ? " in the background" : "")
                            << std::endl;
      }
    }
    if (stop) {
      return cancelled("stopped by request after step " + std::to_string(s.step) +
                       (saving ? "; resume with --resume " + s.config.save_dir
                               : "; no checkpoint was written (save_dir is \"\")"));
    }
  }
  return Status::ok();
}

Status Trainer::run_steps(std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    auto m = impl_->train_step(i + 1 == n);
    if (m.is_ok()) {
      if (Status e = impl_->evaluate(&*m); !e) m = e;
    }
    if (!m.is_ok()) {
      impl_->write_trace().ignore();
      return m.status();
    }
    impl_->history.push_back(*m);
  }
  return impl_->write_trace();
}

const std::vector<StepMetrics>& Trainer::history() const { return impl_->history; }
std::int64_t Trainer::step() const { return impl_->step; }
bool Trainer::reports() const { return impl_->comm->rank() == 0; }

Trainer::Peaks Trainer::peaks() const { return peaks_of(impl_->history); }

double Trainer::steady_step_ms() const { return train::steady_step_ms(impl_->history); }

std::string Trainer::peaks_against_plan() const {
  const Impl& s = *impl_;
  const auto [device, host, nvme, rss] = peaks();
  const auto pair = [](const char* what, std::uint64_t got, std::uint64_t want, const char* verb) {
    return std::string(what) + " " + format_bytes(got) + " (" + verb + " " + format_bytes(want) +
           ")";
  };
  return "peaks: " + pair("device", device, s.planned.plan.peak(Tier::kDevice), "planned") + ", " +
         pair("host", host, s.planned.plan.peak(Tier::kHost), "planned") + ", " +
         pair("nvme", nvme, s.planned.plan.tier_bytes(Tier::kNvme), "planned") + ", " +
         pair("rss", rss, s.planned.rss_bytes, "predicted");
}

std::string Trainer::describe() const {
  const Impl& s = *impl_;
  const auto& c = s.config.model;
  int held = 0;  // this rank's stage's groups
  for (const auto& g : s.layout->groups()) held += g.num_elems > 0 ? 1 : 0;
  char buf[1024];
  std::snprintf(
      buf, sizeof(buf),
      "model: %lld parameters (%lld layers, hidden %lld, heads %lld/%lld kv, vocab %lld)\n"
      "precision %s | device %s (limit %s) | offload_param %s | offload_optimizer %s%s%s\n"
      "data: %s (%lld tokens, %s) | seq_len %lld | batch %lld = %lld micro-batches of %lld x %d "
      "data-parallel rank(s) | ZeRO stage %d, %d of %d parameter groups partitioned%s\n",
      static_cast<long long>(s.planned.parameters), static_cast<long long>(c.num_hidden_layers),
      static_cast<long long>(c.hidden_size), static_cast<long long>(c.num_attention_heads),
      static_cast<long long>(c.num_key_value_heads), static_cast<long long>(c.vocab_size),
      precision_with_scaling(s.config, s.scaler ? &*s.scaler : nullptr).c_str(),
      s.device->name().c_str(),
      s.config.device_memory_limit ? format_bytes(s.config.device_memory_limit).c_str() : "none",
      std::string(zero::offload_name(s.config.offload_param)).c_str(),
      (std::string(zero::offload_name(s.config.offload_optimizer)) +
       (s.planned.plan.any_device_steps()
            ? " (offload_optimizer_fraction " +
                  zero::fraction_text(s.planned.plan.offload_fraction) +
                  ", the rest stepped on the device)"
            : ""))
          .c_str(),
      s.swap ? " | swap engine " : "", s.swap ? s.swap->engine_name().c_str() : "",
      s.config.data.path.c_str(), static_cast<long long>(s.dataset->num_tokens()),
      std::string(token_format_name(s.dataset->format())).c_str(),
      static_cast<long long>(s.config.seq_len), static_cast<long long>(s.config.batch_size),
      static_cast<long long>(s.config.accumulation_steps(s.grid->data().world_size())),
      static_cast<long long>(s.config.micro_batch_size), s.grid->data().world_size(),
      s.config.zero_stage, s.planned.groups_partitioned, held,
      s.config.tensor_parallel_size > 1
          ? (" | each layer split over " + std::to_string(s.config.tensor_parallel_size) +
             " tensor-parallel ranks" +
             (s.config.sequence_parallel ? ", the tokens between them too (sequence parallel)"
                                         : ""))
                .c_str()
          : "");
  const std::string finetune = describe_finetune(s.config, *s.whole);
  const std::string cache = s.base_cache ? s.base_cache->describe() + "\n" : "";
  return buf + s.resolution + (s.pipeline ? s.pipeline->describe() : std::string()) +
         (finetune.empty() ? "" : finetune + "\n") + cache + s.provider->plan().describe();
}

}  // namespace strata::train
