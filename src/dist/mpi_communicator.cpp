// MPI communicator: non-blocking MPI collectives waited on with a deadline, so a dead or stuck
// peer ends the run with a message instead of a hang. Needs a host-addressable device.
#include "strata/build_config.h"

#if STRATA_HAVE_MPI

#include <mpi.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "src/dist/mpi_communicator.h"
#include "strata/device/device.h"

namespace strata::dist {
namespace {

// Elementwise sums for 16-bit floats, which MPI has no type for: convert, add in f32, round.
template <typename Half, float (*ToF32)(Half), Half (*FromF32)(float)>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = FromF32(ToF32(a[i]) + ToF32(b[i]));
}

// MPI is process-wide state: initialized once, finalized when the last communicator goes away.
struct MpiRuntime {
  std::mutex mu;
  int users = 0;
  bool we_initialized = false;
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op f16_sum = MPI_OP_NULL;
};
MpiRuntime& runtime() {
  static MpiRuntime rt;  // the one process-wide MPI state; MPI itself is a process singleton
  return rt;
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

class MpiRequestState final : public CommHandle::State {
 public:
  MpiRequestState(MPI_Request req, std::string what, int rank,
                  std::chrono::steady_clock::time_point deadline, std::function<void()> finish)
      : req_(req),
        what_(std::move(what)),
        rank_(rank),
        deadline_(deadline),
        finish_(std::move(finish)) {}
  Status wait() override {
    // Poll with backoff: blocking MPI_Wait cannot time out, and spinning would steal the core
    // from the compute threads of oversubscribed ranks.
    int done = 0;
    auto sleep = std::chrono::microseconds(0);
    for (;;) {
      const int rc = MPI_Test(&req_, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        return internal_error("rank " + std::to_string(rank_) + ": " + what_ +
                              " failed: " + mpi_error_string(rc));
      }
      if (done) break;
      if (std::chrono::steady_clock::now() > deadline_) {
        return unavailable("rank " + std::to_string(rank_) + ": " + what_ +
                           " did not complete in time; a peer rank may have died or be stuck "
                           "(raise dist_timeout_s if it is only slow)");
      }
      if (sleep < std::chrono::microseconds(1000)) sleep += std::chrono::microseconds(20);
      std::this_thread::sleep_for(sleep);
    }
    if (finish_) finish_();
    return Status::ok();
  }

 private:
  MPI_Request req_;
  std::string what_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
  std::function<void()> finish_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, const CommOptions& options, device::Device& device)
      : comm_(comm), timeout_(options.timeout), device_(device) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
  }
  ~MpiCommunicator() override {
    MPI_Comm_free(&comm_);
    MpiRuntime& rt = runtime();
    std::lock_guard lock(rt.mu);
    if (--rt.users == 0 && rt.we_initialized) {
      MPI_Op_free(&rt.bf16_sum);
      MPI_Op_free(&rt.f16_sum);
      MPI_Finalize();
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "mpi"; }

  CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                        std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.all_gather_bytes += bytes * static_cast<std::size_t>(world_);
    stats_.bytes_sent += bytes;
    ++stats_.collectives;
    MPI_Request req;
    const void* src =
        send == static_cast<const std::byte*>(recv) + bytes * static_cast<std::size_t>(rank_)
            ? MPI_IN_PLACE
            : send;
    const int rc = MPI_Iallgather(src, static_cast<int>(count), type_of(dtype), recv,
                                  static_cast<int>(count), type_of(dtype), comm_, &req);
    return issue(rc, req, "all_gather", what, {});
  }

  CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                            ReduceOp op, std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.reduce_scatter_bytes += bytes * static_cast<std::size_t>(world_);
    stats_.bytes_sent += bytes * static_cast<std::size_t>(world_);
    ++stats_.collectives;
    MPI_Request req;
    const int rc = MPI_Ireduce_scatter_block(send, recv, static_cast<int>(count), type_of(dtype),
                                             sum_of(dtype), comm_, &req);
    return issue(rc, req, "reduce_scatter", what, averager(op, recv, count, dtype));
  }

  CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                        std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.all_reduce_bytes += bytes;
    stats_.bytes_sent += bytes;
    ++stats_.collectives;
    MPI_Request req;
    const int rc = MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                                  type_of(dtype), sum_of(dtype), comm_, &req);
    return issue(rc, req, "all_reduce", what, averager(op, recv, count, dtype));
  }

  CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                       std::string_view what) override {
    ++stats_.collectives;
    MPI_Request req;
    const int rc = MPI_Ibcast(buffer, static_cast<int>(count), type_of(dtype), root, comm_, &req);
    return issue(rc, req, "broadcast", what, {});
  }

  Status barrier(std::string_view what) override {
    MPI_Request req;
    const int rc = MPI_Ibarrier(comm_, &req);
    return issue(rc, req, "barrier", what, {}).wait();
  }

  Status all_reduce_host(double* values, int count, ReduceOp op, std::string_view what) override {
    MPI_Request req;
    const int rc = MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_SUM, comm_, &req);
    const int world = world_;
    return issue(rc, req, "all_reduce", what,
                 [=] {
                   if (op == ReduceOp::kAvg) {
                     for (int i = 0; i < count; ++i) values[i] /= world;
                   }
                 })
        .wait();
  }

  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    MPI_Request req;
    const int rc =
        MPI_Iallgather(send, count, MPI_UINT64_T, recv, count, MPI_UINT64_T, comm_, &req);
    return issue(rc, req, "all_gather", what, {}).wait();
  }

  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                     std::string_view what) override {
    MPI_Request req;
    const int rc = MPI_Igather(send, static_cast<int>(count), type_of(dtype), recv,
                               static_cast<int>(count), type_of(dtype), root, comm_, &req);
    return issue(rc, req, "gather", what, {}).wait();
  }

 private:
  static MPI_Datatype type_of(DType dtype) {
    switch (dtype) {
      case DType::kF32:
        return MPI_FLOAT;
      case DType::kBF16:
      case DType::kF16:
      case DType::kU16:
        return MPI_UINT16_T;
      case DType::kU32:
        return MPI_UINT32_T;
      case DType::kI32:
        return MPI_INT32_T;
      case DType::kI64:
        return MPI_INT64_T;
      case DType::kU8:
        return MPI_UINT8_T;
    }
    return MPI_BYTE;
  }
  static MPI_Op sum_of(DType dtype) {
    if (dtype == DType::kBF16) return runtime().bf16_sum;
    if (dtype == DType::kF16) return runtime().f16_sum;
    return MPI_SUM;
  }
  std::function<void()> averager(ReduceOp op, void* recv, std::int64_t count, DType dtype) const {
    if (op != ReduceOp::kAvg || world_ == 1) return {};
    const float inv = 1.0f / static_cast<float>(world_);
    const float world = static_cast<float>(world_);
    return [=] {
      for (std::int64_t i = 0; i < count; ++i) {
        const auto idx = static_cast<std::size_t>(i);
        switch (dtype) {
          case DType::kF32:
            static_cast<float*>(recv)[idx] /= world;
            break;
          case DType::kBF16: {
            auto* p = static_cast<bf16*>(recv) + idx;
            *p = f32_to_bf16(bf16_to_f32(*p) * inv);
            break;
          }
          case DType::kF16: {
            auto* p = static_cast<f16*>(recv) + idx;
            *p = f32_to_f16(f16_to_f32(*p) * inv);
            break;
          }
          default:
            break;
        }
      }
    };
  }
  CommHandle issue(int rc, MPI_Request req, const char* op, std::string_view what,
                   std::function<void()> finish) {
    const std::string label = std::string(op) + " '" + std::string(what) + "'";
    if (rc != MPI_SUCCESS) {
      struct Failed final : CommHandle::State {
        Status s;
        Status wait() override { return s; }
      };
      auto f = std::make_shared<Failed>();
      f->s = internal_error("rank " + std::to_string(rank_) + ": " + label +
                            " failed: " + mpi_error_string(rc));
      return CommHandle(f);
    }
    return CommHandle(std::make_shared<MpiRequestState>(
        req, label, rank_, std::chrono::steady_clock::now() + timeout_, std::move(finish)));
  }

  MPI_Comm comm_;
  std::chrono::seconds timeout_;
  device::Device& device_;
  int rank_ = 0, world_ = 1;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const CommOptions& options,
                                                            device::Device& device) {
  if (!device.host_addressable()) {
    return unavailable(
        "the MPI communicator needs host-addressable buffers (device \"cpu\"); on "
        "GPUs use dist_backend \"nccl\"");
  }
  return make_mpi_host_communicator(options, device);
}

Result<std::unique_ptr<Communicator>> make_mpi_host_communicator(const CommOptions& options,
                                                                 device::Device& device) {
  MpiRuntime& rt = runtime();
  std::lock_guard lock(rt.mu);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      return unavailable("MPI_Init_thread failed; is this process started by mpirun?");
    }
    rt.we_initialized = true;
    MPI_Op_create(&half_sum<bf16, bf16_to_f32, f32_to_bf16>, 1, &rt.bf16_sum);
    MPI_Op_create(&half_sum<f16, f16_to_f32, f32_to_f16>, 1, &rt.f16_sum);
  }
  MPI_Comm comm;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &comm) != MPI_SUCCESS)
    return internal_error("MPI_Comm_dup failed");
  // Errors come back as return codes, so they become a Status naming the rank and operation.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  ++rt.users;
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(comm, options, device));
}

}  // namespace strata::dist

#endif  // STRATA_HAVE_MPI
