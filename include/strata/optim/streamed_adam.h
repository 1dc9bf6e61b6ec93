// StreamedAdam: the AdamW step for optimizer state that lives in the NVMe swap space, pipelined
// in sub-groups (read sub-group i+1 while i is updated and i-1 is written back) through a fixed
// set of aligned staging buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/device/ops.h"
#include "strata/io/swap.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/state_layout.h"

namespace strata::optim {

// The arrays of a segment that the step streams.
enum class StreamedArray : int { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kGrad = 3 };

// Where the segments' arrays live (the tiered store's NVMe homes, in Strata's optimizer step):
// asynchronous reads and writes of 4096-aligned ranges, in bytes from the array's start, into and
// out of the staging the step was given. The step writes master, exp_avg and exp_avg_sq back
// (where to is the storage's choice: over what was read, or to other homes, so that a step can
// be abandoned or redone from the state read) and only reads the gradient.
class SegmentStorage {
 public:
  virtual ~SegmentStorage() = default;
  virtual io::IoHandle read(std::size_t segment, StreamedArray array, std::uint64_t offset,
                            void* dst, std::size_t bytes) = 0;
  virtual io::IoHandle write(std::size_t segment, StreamedArray array, std::uint64_t offset,
                             const void* src, std::size_t bytes) = 0;
};

// One parameter group (or shard): its master weights and moments (of the step's master_dtype
// and state_dtype) in the storage, each num_elems elements; its gradient in host memory or
// (grad_streamed) in the storage too, read with the state; its output copy in host memory.
struct StreamedSegment {
  std::string_view name;  // named in errors
  // Null without grad_streamed: SegmentReady supplies it.
  const void* grad = nullptr;
  bool grad_streamed = false;  // read from the storage; needs options.stream_grads, no check_finite
  DType grad_dtype = DType::kF32;
  std::int64_t num_elems = 0;
  void* param_out = nullptr;  // optional, out_dtype; see SegmentBegin
  DType out_dtype = DType::kBF16;
  // bf16 master weights' stochastic rounding (device::AdamWArgs): the segment's seed and its
  // first element's place in its group.
  std::uint64_t rounding_seed = 0;
  std::uint64_t element_offset = 0;
};

struct StreamedAdamOptions {
  // Elements per sub-group (DeepSpeed's sub_group_size), rounded up to a multiple of 2048 so
  // every sub-group starts at a 4096-byte offset (O_DIRECT) in 4- and 2-byte arrays alike.
  // Segments need not be multiples.
  std::int64_t sub_group_size = 1 << 22;
  // Sub-groups covered by staging (master, exp_avg, exp_avg_sq each). 3 lets the read of i+1,
  // the update of i and the write of i-1 overlap; 2 serializes the write behind the next read.
  int num_buffers = 3;
  // The largest segment the step will see: caps the staging at what one sub-group can need.
  // 0 means sub_group_size.
  std::int64_t max_segment_elems = 0;
  // Scan each segment's gradient for NaN/Inf before any I/O and skip the segments that have one
  // (no read, no write). Off when the caller already checked (Strata's trainer checks the global
  // gradient norm before the step).
  bool check_finite = true;
  // false: every read and write-back of the step, through the same staging and pipeline, but no
  // update (the state goes back unchanged): the I/O-only baseline of bench_cpu_adam.
  bool update = true;
  // Staging for gradients read from the storage (StreamedSegment::grad_streamed) beside the state.
  bool stream_grads = false;
  // How the master weights and the moments lie in the storage (the step's master_dtype,
  // master_rounding and state_dtype must match): a second plane (Kahan compensation, 8-bit
  // block scales) is moved as a range of its own, and sub-groups are rounded up so that its
  // ranges start on 4096-byte boundaries too (8-bit moments: 65,536 elements).
  StateLayout master_layout{};
  StateLayout moment_layout{};
};

struct StreamedStepReport {
  std::vector<std::size_t> skipped_segments;  // indices with a non-finite gradient
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  double io_wait_s = 0;  // time the pipeline waited on reads or writes
  double compute_s = 0;  // time in CpuAdam::step
};

// Move-only. Uses `adam` and its staging, which must outlive it.
class StreamedAdam {
 public:
  // `staging`: at least staging_bytes_for(options) bytes, 4096-aligned; pinned and registered
  // with the storage's I/O by its owner (the tiered store's pool), so no request pins pages.
  static Result<StreamedAdam> create(CpuAdam& adam, const StreamedAdamOptions& options,
                                     std::span<std::byte> staging);

  // Called after a segment's last sub-group was updated (its param_out is complete; its state
  // may still be in flight to the storage), in segment order, never for a skipped segment.
  // An error stops the step.
  using SegmentDone = std::function<Status(std::size_t segment)>;
  // Called before a segment's first sub-group is updated: where its output goes (null: none).
  // Overrides the segment's param_out, so output buffers need exist only while their segment
  // is being updated.
  using SegmentBegin = std::function<Result<void*>(std::size_t segment)>;
  // Called before the first read of a segment's state, to supply its gradient (for a segment
  // given without one) once it exists. Reads run a sub-group ahead of the update: there the
  // call has `wait` false and returns nullopt when the gradient is not there yet (the read waits
  // for the update to reach it); with `wait` true it blocks until the gradient exists. An error
  // stops the step. Needs check_finite off.
  struct SegmentGrad {
    const void* grad = nullptr;  // host memory, or
    bool streamed = false;       // read from the storage (options.stream_grads)
  };
  using SegmentReady =
      std::function<Result<std::optional<SegmentGrad>>(std::size_t segment, bool wait)>;

  // One AdamW step over every segment, in order, its arrays read from and written to `storage`.
  // `hyper` supplies lr, betas, eps, weight_decay, step, grad_scale and adamw_mode (its pointers
  // and n are ignored). The result is bit-identical to CpuAdam::step over the same arrays in
  // memory. On an I/O error the transfers in flight are drained and the error names the
  // segment, the array and the sub-group; segments before it are updated, the failing one may be
  // partly updated.
  Result<StreamedStepReport> step(std::span<const StreamedSegment> segments,
                                  SegmentStorage& storage, const device::AdamWArgs& hyper,
                                  const SegmentDone& on_segment_done = {},
                                  const SegmentBegin& on_segment_begin = {},
                                  const SegmentReady& on_segment_ready = {});

  std::int64_t sub_group_elems() const { return sub_group_elems_; }
  // Staging the step uses for these options (for memory budgets): num_buffers slots of one
  // sub-group per array.
  static std::size_t staging_bytes_for(const StreamedAdamOptions& options);

 private:
  StreamedAdam(CpuAdam& adam, const StreamedAdamOptions& options, std::int64_t sub_group_elems,
               std::span<std::byte> staging);
  float* slot(std::size_t sub, int array);

  CpuAdam* adam_;
  StreamedAdamOptions options_;
  std::int64_t sub_group_elems_;
  // num_buffers * arrays sub-group slots ([slot * arrays + array]; arrays: master, exp_avg,
  // exp_avg_sq, and the gradient when streamed).
  std::span<std::byte> staging_;
};

}  // namespace strata::optim
