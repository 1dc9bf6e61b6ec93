// ExpertGroup over a communicator: each exchange issued and waited for.
#include "strata/zero/expert_group.h"

namespace strata::zero {
namespace {

class CommExpertGroup final : public model::ExpertGroup {
 public:
  explicit CommExpertGroup(dist::Communicator& comm) : comm_(comm) {}
  int size() const override { return comm_.world_size(); }
  int rank() const override { return comm_.rank(); }
  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    return comm_.all_gather_host(send, recv, count, what);
  }
  Status all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, void* recv,
                      std::span<const std::int64_t> recv_counts, DType dtype,
                      std::string_view what) override {
    return comm_.all_to_all_v(send, send_counts, recv, recv_counts, dtype, what).wait();
  }

 private:
  dist::Communicator& comm_;
};

}  // namespace

std::unique_ptr<model::ExpertGroup> make_expert_group(dist::Communicator& comm) {
  return std::make_unique<CommExpertGroup>(comm);
}

}  // namespace strata::zero
