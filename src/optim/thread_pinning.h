// Binds the oneTBB workers of one task_arena (and, for the length of a step, the thread that
// runs it) to one core each with hwloc.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <memory>

namespace strata::optim::detail {

class ArenaPinning {
 public:
  // Starts observing `arena` (which must outlive the result). Returns null, after one warning,
  // when hwloc cannot read the topology or the process may run on no core.
  static std::unique_ptr<ArenaPinning> create(tbb::task_arena& arena);
  virtual ~ArenaPinning() = default;

  // Binds the calling thread to the arena's slot-0 core until the returned guard is destroyed,
  // then restores the binding it had (so a step never leaves the caller's affinity changed).
  class CallerBinding {
   public:
    virtual ~CallerBinding() = default;
  };
  virtual std::unique_ptr<CallerBinding> bind_caller() = 0;
};

}  // namespace strata::optim::detail
