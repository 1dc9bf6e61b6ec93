// model::TensorGroup over a dist::Communicator.
#include "strata/zero/tensor_group.h"

#include "strata/model/param_layout.h"

namespace strata::zero {
namespace {

class GridTensorGroup final : public CommTensorGroup {
 public:
  GridTensorGroup(dist::Communicator& comm, device::Device& device, int kv_replicas,
                  std::unique_ptr<dist::Communicator> replicas)
      : comm_(comm), device_(device), kv_replicas_(kv_replicas), replicas_(std::move(replicas)) {}

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

  Status reduce_scatter_sum(const void* send, void* recv, std::int64_t count, DType dtype,
                            std::string_view what) override {
    device_.stream(device::StreamKind::kCompute).synchronize();
    return comm_.reduce_scatter(send, recv, count, dtype, dist::ReduceOp::kSum, what).wait();
  }

  int kv_replicas() const override { return kv_replicas_; }

  dist::CommStats replica_stats() const override {
    return replicas_ == nullptr ? dist::CommStats{} : replicas_->stats();
  }

  Status kv_replica_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    if (replicas_ == nullptr) return Status::ok();
    device_.stream(device::StreamKind::kCompute).synchronize();
    return replicas_->all_reduce(buffer, buffer, count, dtype, dist::ReduceOp::kSum, what).wait();
  }

 private:
  dist::Communicator& comm_;
  device::Device& device_;
  int kv_replicas_;
  std::unique_ptr<dist::Communicator> replicas_;  // this kv head's ranks; null: one rank each
};

}  // namespace

Result<std::unique_ptr<CommTensorGroup>> make_tensor_group(dist::Communicator& comm,
                                                           device::Device& device,
                                                           std::int64_t kv_heads) {
  const int size = comm.world_size();
  const int replicas = model::kv_head_replicas(kv_heads, size);
  std::unique_ptr<dist::Communicator> split;
  if (replicas > 1) {
    // ParamLayout::build's slices: kv head r / replicas on rank r.
    STRATA_ASSIGN_OR_RETURN(split,
                            comm.split(comm.rank() / replicas, comm.rank(), "kv head replicas",
                                       device::StreamKind::kTensorCollective));
  }
  return std::unique_ptr<CommTensorGroup>(
      new GridTensorGroup(comm, device, replicas, std::move(split)));
}

}  // namespace strata::zero
