// model::TensorGroup over a dist::Communicator.
#include "strata/zero/tensor_group.h"

namespace strata::zero {
namespace {

class CommTensorGroup final : public model::TensorGroup {
 public:
  CommTensorGroup(dist::Communicator& comm, device::Device& device)
      : comm_(comm), device_(device) {}

  int size() const override { return comm_.world_size(); }
  int rank() const override { return comm_.rank(); }

  Status all_reduce_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    device_.stream(device::StreamKind::kCompute).synchronize();
    return comm_.all_reduce(buffer, buffer, count, dtype, dist::ReduceOp::kSum, what).wait();
  }

  Status all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                    std::string_view what) override {
    device_.stream(device::StreamKind::kCompute).synchronize();
    return comm_.all_gather(send, recv, count, dtype, what).wait();
  }

 private:
  dist::Communicator& comm_;
  device::Device& device_;
};

}  // namespace

std::unique_ptr<model::TensorGroup> make_tensor_group(dist::Communicator& comm,
                                                      device::Device& device) {
  return std::make_unique<CommTensorGroup>(comm, device);
}

}  // namespace strata::zero
