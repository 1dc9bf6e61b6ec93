// ScratchSpace: device scratch, the model's host buffer and its checkpointed activations.
#include "strata/zero/scratch_space.h"

namespace strata::zero {

Result<ScratchSpace::Scratch> ScratchSpace::take(std::uint64_t bytes, const std::string& name,
                                                 bool zero_fill) {
  std::vector<mem::Handle>& free = free_scratch_[{name, bytes}];
  Scratch s;
  if (free.empty()) {
    mem::TensorSpec spec;
    spec.name = name;
    spec.size_bytes = bytes;
    spec.scratch = true;
    STRATA_ASSIGN_OR_RETURN(s.h, store_.add(spec));
  } else {
    s.h = free.back();
    free.pop_back();
  }
  auto data = store_.emplace(s.h, Tier::kDevice, zero_fill);
  if (!data.is_ok()) {
    free.push_back(s.h);
    return data.status();
  }
  s.data = *data;
  return s;
}

Result<void*> ScratchSpace::host_io(std::uint64_t bytes, const std::string& what) {
  if (host_io_ != mem::Handle::kInvalid) {
    const mem::TensorSpec& spec = store_.spec(host_io_);
    if (spec.size_bytes == bytes && spec.name == what) return host_io_data_;
    store_.unpin(host_io_, Tier::kHost);
    STRATA_RETURN_IF_ERROR(store_.discard(host_io_));
    host_io_data_ = nullptr;
  }
  mem::TensorSpec spec;
  spec.name = what;
  spec.size_bytes = bytes;
  spec.transient = true;
  STRATA_ASSIGN_OR_RETURN(host_io_, store_.add(spec));
  STRATA_ASSIGN_OR_RETURN(host_io_data_, store_.emplace(host_io_, Tier::kHost, true));
  return host_io_data_;
}

Result<void*> ScratchSpace::write_activation(int index, std::uint64_t bytes) {
  STRATA_CHECK(index >= 0, "negative activation index", index);
  if (checkpoints_.size() <= static_cast<std::size_t>(index)) {
    checkpoints_.resize(static_cast<std::size_t>(index) + 1);
  }
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.held) STRATA_RETURN_IF_ERROR(release_activation(index, false));  // after a failed step
  if (c.h == mem::Handle::kInvalid || c.bytes != bytes) {
    // A transient tensor: no home; a copy of another shape, if any, holds nothing.
    if (c.h != mem::Handle::kInvalid) STRATA_RETURN_IF_ERROR(store_.discard(c.h));
    mem::TensorSpec spec;
    spec.name = "checkpointed activation " + std::to_string(index);
    spec.size_bytes = bytes;
    spec.transient = true;
    STRATA_ASSIGN_OR_RETURN(c.h, store_.add(spec));
    c.bytes = bytes;
  }
  STRATA_ASSIGN_OR_RETURN(void* p, store_.emplace(c.h, Tier::kDevice, /*zero_fill=*/false));
  c.held = c.writing = true;
  return p;
}

Result<const void*> ScratchSpace::read_activation(int index) {
  STRATA_CHECK(index >= 0 && static_cast<std::size_t>(index) < checkpoints_.size() &&
                   checkpoints_[static_cast<std::size_t>(index)].h != mem::Handle::kInvalid,
               "activation read before it was written", index);
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  STRATA_CHECK(!c.held, "activation read while held", index);
  STRATA_ASSIGN_OR_RETURN(void* p, store_.acquire(c.h, Tier::kDevice));
  c.held = true;
  c.writing = false;
  return static_cast<const void*>(p);
}

void ScratchSpace::prefetch_activation(int index) {
  if (index < 0 || static_cast<std::size_t>(index) >= checkpoints_.size()) return;
  const Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.h != mem::Handle::kInvalid && !c.held) (void)store_.try_prefetch(c.h, Tier::kDevice);
}

Status ScratchSpace::release_activation(int index, bool keep) {
  STRATA_CHECK(index >= 0 && static_cast<std::size_t>(index) < checkpoints_.size() &&
                   checkpoints_[static_cast<std::size_t>(index)].held,
               "activation released but not held", index);
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.writing) store_.mark_dirty(c.h, Tier::kDevice);
  store_.unpin(c.h, Tier::kDevice);
  c.held = false;
  if (!keep) return store_.discard(c.h);
  if (!c.writing || checkpoint_home_ == Tier::kDevice) return Status::ok();
  // Homed off the device: down to its tier now, behind the compute, which goes on (an error
  // shows at the read).
  return store_.evict(c.h, Tier::kDevice, checkpoint_home_).status();
}

void ScratchSpace::give(Scratch& s) {
  if (!s.held()) return;
  store_.unpin(s.h, Tier::kDevice);
  (void)store_.discard(s.h);  // ok for an unpinned scratch tensor
  const mem::TensorSpec& spec = store_.spec(s.h);
  free_scratch_[{spec.name, spec.size_bytes}].push_back(s.h);
  s = Scratch{};
}

}  // namespace strata::zero
