// StreamedAdam: sub-group pipeline over optimizer state in NVMe storage. Sub-group i lives in
// staging slot i % num_buffers; the read of sub-group j is issued once the write-back of the
// slot's previous occupant (j - num_buffers) has finished, up to max(1, num_buffers - 2)
// sub-groups ahead of the one being updated.
#include "strata/optim/streamed_adam.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "strata/core/check.h"
#include "strata/core/clock.h"

namespace strata::optim {
namespace {

// Sub-groups start at 4096-byte offsets in 2-byte arrays (a bf16 gradient), so in fp32 too.
constexpr std::int64_t kAlignElems = static_cast<std::int64_t>(io::kIoAlignBytes / 2);
constexpr int kStateArrays = 3;  // master, exp_avg, exp_avg_sq: read and written back
constexpr int kGradArray = 3;    // the gradient, when streamed: read only
constexpr int kMaxArrays = 4;
// A transfer's handle: plane 0 of array k at [k], the state arrays' second planes at
// [kMaxArrays + k].
constexpr int kMaxTransfers = kMaxArrays + kStateArrays;
const char* const kTransferNames[kMaxTransfers] = {"master weights",
                                                   "exp_avg",
                                                   "exp_avg_sq",
                                                   "gradients",
                                                   "master weights' compensation",
                                                   "exp_avg's block scales",
                                                   "exp_avg_sq's block scales"};

int arrays_for(const StreamedAdamOptions& o) { return o.stream_grads ? kMaxArrays : kStateArrays; }

std::int64_t round_up(std::int64_t n, std::int64_t a) { return (n + a - 1) / a * a; }

std::int64_t sub_group_elems_for(const StreamedAdamOptions& o) {
  // Powers of two: the largest is a multiple of the others.
  const std::int64_t align =
      std::max({kAlignElems, o.master_layout.align_elems(), o.moment_layout.align_elems()});
  std::int64_t sub = round_up(std::max<std::int64_t>(o.sub_group_size, 1), align);
  if (o.max_segment_elems > 0) sub = std::min(sub, round_up(o.max_segment_elems, align));
  return sub;
}

struct SubGroup {
  std::size_t segment;
  std::int64_t begin;  // first element within the segment
  std::int64_t count;
  bool last;  // the segment's last sub-group
};

}  // namespace

std::size_t StreamedAdam::staging_bytes_for(const StreamedAdamOptions& options) {
  return static_cast<std::size_t>(sub_group_elems_for(options)) * sizeof(float) *
         static_cast<std::size_t>(std::max(options.num_buffers, 2) * arrays_for(options));
}

StreamedAdam::StreamedAdam(CpuAdam& adam, const StreamedAdamOptions& options,
                           std::int64_t sub_group_elems, std::span<std::byte> staging)
    : adam_(&adam), options_(options), sub_group_elems_(sub_group_elems), staging_(staging) {}

float* StreamedAdam::slot(std::size_t sub, int array) {
  const auto nb = static_cast<std::size_t>(options_.num_buffers);
  const auto arrays = static_cast<std::size_t>(arrays_for(options_));
  const std::size_t index = (sub % nb) * arrays + static_cast<std::size_t>(array);
  return reinterpret_cast<float*>(
      staging_.data() + index * static_cast<std::size_t>(sub_group_elems_) * sizeof(float));
}

Result<StreamedAdam> StreamedAdam::create(CpuAdam& adam, const StreamedAdamOptions& options,
                                          std::span<std::byte> staging) {
  if (options.sub_group_size <= 0) {
    return invalid_argument("sub_group_size " + std::to_string(options.sub_group_size) +
                            " must be a positive number of elements");
  }
  const std::int64_t sub = sub_group_elems_for(options);
  const auto slot_bytes = static_cast<std::uint64_t>(sub) * sizeof(float);
  if (options.master_layout.bytes(sub) > slot_bytes ||
      options.moment_layout.bytes(sub) > slot_bytes) {
    return invalid_argument("StreamedAdam: optimizer state of more than 4 bytes an element");
  }
  if (options.num_buffers < 2) {
    return invalid_argument("StreamedAdam num_buffers " + std::to_string(options.num_buffers) +
                            " must be at least 2 (3 overlaps read, update and write-back)");
  }
  const std::size_t need = staging_bytes_for(options);
  if (staging.size() < need ||
      reinterpret_cast<std::uintptr_t>(staging.data()) % io::kIoAlignBytes != 0) {
    return invalid_argument("StreamedAdam: staging of " + std::to_string(staging.size()) +
                            " bytes for sub_group_size " + std::to_string(options.sub_group_size) +
                            " x " + std::to_string(options.num_buffers) + " buffers; it needs " +
                            std::to_string(need) + " bytes, 4096-aligned");
  }
  return StreamedAdam(adam, options, sub_group_elems_for(options), staging.first(need));
}

Result<StreamedStepReport> StreamedAdam::step(std::span<const StreamedSegment> segments,
                                              SegmentStorage& storage,
                                              const device::AdamWArgs& hyper,
                                              const SegmentDone& on_segment_done,
                                              const SegmentBegin& on_segment_begin,
                                              const SegmentReady& on_segment_ready) {
  StreamedStepReport report;
  STRATA_CHECK(
      options_.master_layout == master_layout(hyper.master_dtype, hyper.master_rounding) &&
          options_.moment_layout == moment_layout(hyper.state_dtype),
      "StreamedAdam: the step's master and state dtypes are not the layouts it was made for");
  STRATA_CHECK(!(on_segment_ready && options_.check_finite),
               "StreamedAdam: gradients supplied when ready cannot be scanned before the step");
  // Each segment's gradient: as given, or from on_segment_ready before its first read.
  std::vector<SegmentGrad> grads(segments.size());
  // Plan: the sub-groups of every segment that has a finite gradient, in order.
  std::vector<SubGroup> plan;
  for (std::size_t s = 0; s < segments.size(); ++s) {
    const StreamedSegment& seg = segments[s];
    const bool streamed_grad = seg.grad_streamed;
    grads[s] = SegmentGrad{seg.grad, seg.grad_streamed};
    STRATA_CHECK(
        seg.num_elems >= 0 && (seg.num_elems == 0 || seg.grad != nullptr || on_segment_ready ||
                               (streamed_grad && options_.stream_grads)),
        "StreamedAdam: a segment without a gradient", seg.name, seg.num_elems);
    STRATA_CHECK(!(streamed_grad && options_.check_finite),
                 "StreamedAdam: a streamed gradient cannot be scanned before the step", seg.name);
    if (options_.check_finite && !adam_->all_finite(seg.grad, seg.grad_dtype, seg.num_elems)) {
      report.skipped_segments.push_back(s);
      continue;
    }
    if (seg.num_elems == 0) {
      plan.push_back(SubGroup{s, 0, 0, true});
      continue;
    }
    for (std::int64_t b = 0; b < seg.num_elems; b += sub_group_elems_) {
      const std::int64_t count = std::min(sub_group_elems_, seg.num_elems - b);
      plan.push_back(SubGroup{s, b, count, b + count == seg.num_elems});
    }
  }

  const auto nb = static_cast<std::size_t>(options_.num_buffers);
  const std::size_t lookahead = std::max<std::size_t>(1, nb - 2);
  std::vector<std::array<io::IoHandle, kMaxTransfers>> reads(nb), writes(nb);
  // Waits for one transfer of sub-group `sub`; an error names where it happened.
  auto wait_one = [&](io::IoHandle& h, std::size_t sub, int k, bool is_read) -> Status {
    if (!h.valid()) return Status::ok();
    Stopwatch w;
    Status st = h.wait();
    report.io_wait_s += w.elapsed_s();
    h = io::IoHandle();
    if (st.is_ok()) return st;
    const SubGroup& sg = plan[sub];
    const StreamedSegment& seg = segments[sg.segment];
    return st.with_context(std::string(is_read ? "reading " : "writing ") + kTransferNames[k] +
                           " of '" + std::string(seg.name) + "' (elements " +
                           std::to_string(sg.begin) + ".." + std::to_string(sg.begin + sg.count) +
                           " of " + std::to_string(seg.num_elems) + ") " +
                           (is_read ? "from" : "to") + " NVMe");
  };
  // Every transfer of the slot that sub-group `sub` occupies; the first error wins.
  auto wait_slot = [&](std::vector<std::array<io::IoHandle, kMaxTransfers>>& handles,
                       std::size_t sub, bool is_read) -> Status {
    Status first;
    for (int k = 0; k < kMaxTransfers; ++k) {
      Status st = wait_one(handles[sub % nb][static_cast<std::size_t>(k)], sub, k, is_read);
      if (!st.is_ok() && first.is_ok()) first = st;
    }
    return first;
  };
  // Which sub-group's transfers each slot holds, to name it if they fail while draining.
  std::vector<std::size_t> read_owner(nb, 0), write_owner(nb, 0);
  // Whether the reads of sub-group `sub` may start: its segment's gradient exists (asked of
  // on_segment_ready before the segment's first read; `wait`: until it does).
  auto gradient_ready = [&](std::size_t sub, bool wait) -> Result<bool> {
    const SubGroup& sg = plan[sub];
    const StreamedSegment& seg = segments[sg.segment];
    if (sg.begin != 0 || !on_segment_ready) return true;
    STRATA_ASSIGN_OR_RETURN(std::optional<SegmentGrad> g, on_segment_ready(sg.segment, wait));
    if (!g) return false;
    STRATA_CHECK(seg.num_elems == 0 || g->grad != nullptr || (g->streamed && options_.stream_grads),
                 "StreamedAdam: a segment made ready without a gradient", seg.name);
    grads[sg.segment] = *g;
    return true;
  };
  auto start_transfers = [&](std::size_t sub, bool is_read) -> Status {
    const SubGroup& sg = plan[sub];
    const StreamedSegment& seg = segments[sg.segment];
    if (sg.count == 0) return Status::ok();
    (is_read ? read_owner : write_owner)[sub % nb] = sub;
    for (int k = 0; k < kStateArrays; ++k) {
      // The master weights as master_layout says, the moments as moment_layout says.
      const StateLayout& l = k == 0 ? options_.master_layout : options_.moment_layout;
      auto& handles = (is_read ? reads : writes)[sub % nb];
      const auto array = static_cast<StreamedArray>(k);
      const auto move = [&](io::IoHandle& h, std::uint64_t offset, std::byte* at,
                            std::uint64_t raw) {
        const auto bytes =
            static_cast<std::size_t>(round_up(static_cast<std::int64_t>(raw), io::kIoAlignBytes));
        if (is_read) {
          h = storage.read(sg.segment, array, offset, at, bytes);
          report.bytes_read += bytes;
        } else {
          h = storage.write(sg.segment, array, offset, at, bytes);
          report.bytes_written += bytes;
        }
      };
      auto* at = reinterpret_cast<std::byte*>(slot(sub, k));
      move(handles[static_cast<std::size_t>(k)], l.plane_bytes(sg.begin), at,
           l.plane_bytes(sg.count));
      if (l.has_aux()) {
        move(handles[static_cast<std::size_t>(kMaxArrays + k)],
             l.aux_offset(seg.num_elems) + l.aux_plane_bytes(sg.begin),
             at + l.aux_offset(sub_group_elems_), l.aux_plane_bytes(sg.count));
      }
    }
    if (is_read && grads[sg.segment].streamed) {
      const auto esize = static_cast<std::int64_t>(dtype_size(seg.grad_dtype));
      const auto bytes = static_cast<std::size_t>(round_up(sg.count * esize, io::kIoAlignBytes));
      reads[sub % nb][kGradArray] =
          storage.read(sg.segment, StreamedArray::kGrad,
                       static_cast<std::uint64_t>(sg.begin * esize), slot(sub, kGradArray), bytes);
      report.bytes_read += bytes;
    }
    return Status::ok();
  };

  Status error;
  std::size_t next_read = 0;
  void* param_out = nullptr;  // of the segment being updated
  for (std::size_t i = 0; i < plan.size() && error.is_ok(); ++i) {
    // Keep `lookahead` sub-groups of reads in flight; a slot is reused once written back.
    // Reads ahead do not wait for a gradient that is still to come; the update of the
    // sub-group does.
    for (; next_read < plan.size() && next_read <= i + lookahead; ++next_read) {
      auto go = gradient_ready(next_read, /*wait=*/next_read == i);
      if (!go.is_ok()) {
        error = go.status();
        break;
      }
      if (!*go) break;
      if (next_read >= nb) error = wait_slot(writes, next_read - nb, false);
      if (error.is_ok()) error = start_transfers(next_read, true);
      if (!error.is_ok()) break;
    }
    if (!error.is_ok()) break;
    error = wait_slot(reads, i, true);
    if (!error.is_ok()) break;

    const SubGroup& sg = plan[i];
    const StreamedSegment& seg = segments[sg.segment];
    if (sg.begin == 0) {
      param_out = seg.param_out;
      if (on_segment_begin) {
        Result<void*> out = on_segment_begin(sg.segment);
        if (!out.is_ok()) {
          error = out.status();
          break;
        }
        param_out = *out;
      }
    }
    if (sg.count > 0 && options_.update) {
      device::AdamWArgs a = hyper;
      a.param = slot(i, 0);
      a.exp_avg = slot(i, 1);
      a.exp_avg_sq = slot(i, 2);
      // The slots' second planes lie where a sub-group's would (its first elements' units).
      attach_aux_planes(a, sub_group_elems_, a.param, a.exp_avg, a.exp_avg_sq);
      a.grad = grads[sg.segment].streamed
                   ? static_cast<const void*>(slot(i, kGradArray))
                   : static_cast<const std::byte*>(grads[sg.segment].grad) +
                         static_cast<std::size_t>(sg.begin) * dtype_size(seg.grad_dtype);
      a.grad_dtype = seg.grad_dtype;
      a.n = sg.count;
      a.param_out = param_out == nullptr
                        ? nullptr
                        : static_cast<std::byte*>(param_out) +
                              static_cast<std::size_t>(sg.begin) * dtype_size(seg.out_dtype);
      a.out_dtype = seg.out_dtype;
      a.rounding_seed = seg.rounding_seed;
      a.element_offset = seg.element_offset + static_cast<std::uint64_t>(sg.begin);
      Stopwatch compute;
      // Gradients were scanned per segment above (or the caller vouched for them).
      const StepOutcome outcome = adam_->step(a, /*check_finite=*/false);
      STRATA_CHECK(outcome == StepOutcome::kUpdated, "unchecked step skipped");
      report.compute_s += compute.elapsed_s();
    }
    error = start_transfers(i, false);
    if (error.is_ok() && sg.last && on_segment_done) error = on_segment_done(sg.segment);
  }
  // Drain everything still in flight (the staging buffers must outlive their transfers); the
  // last write-backs finish here, so their errors count too.
  for (std::size_t s = 0; s < nb; ++s) {
    Status r = wait_slot(reads, read_owner[s], true);
    Status w = wait_slot(writes, write_owner[s], false);
    if (error.is_ok()) error = !r.is_ok() ? r : w;
  }
  if (!error.is_ok()) return error;
  return report;
}

}  // namespace strata::optim
