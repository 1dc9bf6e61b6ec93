// The transient memory of a rank: device scratch pinned from take to give (ZeroProvider's
// gathered parameters and buckets, the model's workspace), the model's pinned host buffer
// (host_io), and its checkpointed activations, kept between the forward and the backward where
// the memory plan homes them. All of it is tensors of the rank's tiered store, which makes room
// for them by evicting what is not pinned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/mem/tiered_store.h"

namespace strata::zero {

class ScratchSpace {
 public:
  // `checkpoint_home`: where checkpointed activations wait for the backward. `store` must
  // outlive it.
  ScratchSpace(mem::TieredStore& store, Tier checkpoint_home)
      : store_(store), checkpoint_home_(checkpoint_home) {}

  struct Scratch {
    mem::Handle h = mem::Handle::kInvalid;
    void* data = nullptr;
    bool held() const { return data != nullptr; }
    std::byte* bytes() const { return static_cast<std::byte*>(data); }
  };
  // Scratch of `bytes` named `name` (in the store's errors), zero-filled on request. Tensors
  // are registered once per (name, size) and reused, so a layer's buffers come back from the
  // store's cache of dropped device copies.
  Result<Scratch> take(std::uint64_t bytes, const std::string& name, bool zero_fill = false);
  void give(Scratch& s);  // no-op when not held

  // The model's pinned host buffer (model::ParamProvider::host_io): a host copy of a transient
  // tensor, held until the next call asks for another size.
  Result<void*> host_io(std::uint64_t bytes, const std::string& what);

  // Checkpointed activations (model::ParamProvider's): transient tensors, one per index,
  // written on the device and, between the forward and the backward, left there or sent down to
  // their home tier as soon as written and fetched back for the backward.
  Result<void*> write_activation(int index, std::uint64_t bytes);
  Result<const void*> read_activation(int index);
  void prefetch_activation(int index);
  Status release_activation(int index, bool keep);

 private:
  mem::TieredStore& store_;
  Tier checkpoint_home_;
  std::map<std::pair<std::string, std::uint64_t>, std::vector<mem::Handle>> free_scratch_;
  mem::Handle host_io_ = mem::Handle::kInvalid;  // the model's, and its pinned copy
  void* host_io_data_ = nullptr;
  struct Checkpoint {
    mem::Handle h = mem::Handle::kInvalid;
    std::uint64_t bytes = 0;
    bool held = false, writing = false;
  };
  std::vector<Checkpoint> checkpoints_;
};

}  // namespace strata::zero
