// Test fixtures for LlamaModel: a ParamProvider over plain device buffers that poisons what the
// model released and logs every call, and helpers to fill parameters.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/model/llama.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"

namespace strata::model::testing {

// Parameters live as f32 on the host (the "master" copy); acquire_params converts a group to
// the compute dtype in a device buffer, release_params fills that buffer with NaN so any use
// after release shows up in the results. Gradients are accumulated into f32 host vectors.
class TestProvider final : public ParamProvider {
 public:
  TestProvider(const ParamLayout& layout, device::Device& device, DType dtype)
      : layout_(layout), device_(device), dtype_(dtype) {
    for (const auto& g : layout.groups()) {
      params.emplace_back(static_cast<std::size_t>(g.num_elems), 0.0f);
      grads.emplace_back(static_cast<std::size_t>(g.num_elems), 0.0f);
    }
    param_bufs_.resize(params.size());
    grad_bufs_.resize(params.size());
    held_.assign(params.size(), false);
  }

  Result<const void*> acquire_params(int group) override {
    log.push_back("P+" + std::to_string(group));
    if (fail_acquire_group == group)
      return io_error("injected failure for group " + std::to_string(group));
    EXPECT_FALSE(held_[group]) << "group " << group << " acquired twice";
    held_[group] = true;
    auto& buf = param_bufs_[group];
    const std::size_t bytes = params[group].size() * dtype_size(dtype_);
    if (buf.empty()) {
      auto r = device_.allocate(bytes, "test params");
      if (!r.is_ok()) return r.status();
      buf = std::move(r).value();
    }
    upload(params[group].data(), buf.data(), params[group].size());
    return static_cast<const void*>(buf.data());
  }

  void release_params(int group) override {
    log.push_back("P-" + std::to_string(group));
    EXPECT_TRUE(held_[group]) << "group " << group << " released but not held";
    held_[group] = false;
    std::vector<float> nan(params[group].size(), std::numeric_limits<float>::quiet_NaN());
    upload(nan.data(), param_bufs_[group].data(), nan.size());
  }

  void prefetch_params(int group) override { log.push_back("F" + std::to_string(group)); }

  // kWrite's buffer holds NaNs but in the gaps between tensors: an element of a tensor the model
  // leaves unwritten, or adds into, shows.
  Result<void*> acquire_grads(int group, GradientWrite write) override {
    log.push_back("G+" + std::to_string(group));
    EXPECT_FALSE(layout_.group(group).frozen) << "gradients of frozen group " << group;
    EXPECT_TRUE(grad_bufs_[group].empty()) << "gradients of group " << group << " acquired twice";
    auto r = device_.allocate(params[group].size() * dtype_size(dtype_), "test grads");
    if (!r.is_ok()) return r.status();
    grad_bufs_[group] = std::move(r).value();
    if (write == GradientWrite::kAdd) {
      device_.fill_zero(grad_bufs_[group].data(), grad_bufs_[group].size(),
                        device_.stream(device::StreamKind::kCompute));
    } else {
      std::vector<float> nan(params[group].size(), std::numeric_limits<float>::quiet_NaN());
      for (const auto& [first, last] : layout_.group(group).gaps(layout_.group(group).num_elems)) {
        std::fill(nan.begin() + first, nan.begin() + last, 0.0f);
      }
      upload(nan.data(), grad_bufs_[group].data(), nan.size());
    }
    return grad_bufs_[group].data();
  }

  Status release_grads(int group) override {
    log.push_back("G-" + std::to_string(group));
    auto& buf = grad_bufs_[group];
    EXPECT_FALSE(buf.empty()) << "gradients of group " << group << " released but not held";
    if (buf.empty()) return internal_error("not held");
    auto host = device_.allocate_pinned(buf.size(), "test gradient readback");
    if (!host.is_ok()) return host.status();
    auto& s = device_.stream(device::StreamKind::kCompute);
    device_.copy_to_host(host->data(), buf.data(), buf.size(), s);
    s.synchronize();
    std::vector<float> f(params[group].size());
    convert(host->data(), dtype_, f.data(), DType::kF32, f.size());
    for (std::size_t i = 0; i < f.size(); ++i) grads[group][i] += f[i];
    buf.reset();
    return Status::ok();
  }

  // One device buffer, replaced when the size changes (the model asks every step).
  Result<void*> workspace(std::uint64_t bytes, const std::string& what) override {
    if (workspace_.size() != bytes) {
      workspace_.reset();
      auto r = device_.allocate(bytes, what);
      if (!r.is_ok()) return r.status();
      workspace_ = std::move(r).value();
    }
    return workspace_.data();
  }

  Result<void*> host_io(std::uint64_t bytes, const std::string& what) override {
    if (!host_io_ || host_io_->size() != bytes) {
      host_io_.reset();
      auto r = device_.allocate_pinned(bytes, what);
      if (!r.is_ok()) return r.status();
      host_io_ = std::move(r).value();
    }
    return host_io_->data();
  }

  // Checkpointed activations: one device buffer each. Released with `keep`, the data moves to
  // the host and the device buffer is poisoned with NaN until read again, as an activation homed
  // off the device would be; released without, it is poisoned and forgotten, so a read the model
  // did not announce shows up in the results.
  Result<void*> write_activation(int index, std::uint64_t bytes) override {
    Activation& a = activation(index);
    EXPECT_FALSE(a.held) << "activation " << index << " written while held";
    if (a.buf.size() != bytes) {
      auto r = device_.allocate(bytes, "test activation");
      if (!r.is_ok()) return r.status();
      a.buf = std::move(r).value();
    }
    a.held = true;
    a.has_data = true;
    ++activation_writes;
    return a.buf.data();
  }
  Result<const void*> read_activation(int index) override {
    Activation& a = activation(index);
    EXPECT_FALSE(a.held) << "activation " << index << " read while held";
    EXPECT_TRUE(a.has_data) << "activation " << index << " read but never kept";
    if (!a.has_data) return failed_precondition("activation not kept");
    auto& s = device_.stream(device::StreamKind::kCompute);
    device_.copy_to_device(a.buf.data(), a.host->data(), a.buf.size(), s);
    s.synchronize();
    a.held = true;
    ++activation_reads;
    return static_cast<const void*>(a.buf.data());
  }
  Status release_activation(int index, bool keep) override {
    Activation& a = activation(index);
    EXPECT_TRUE(a.held) << "activation " << index << " released but not held";
    a.held = false;
    auto& s = device_.stream(device::StreamKind::kCompute);
    if (keep) {
      auto host = device_.allocate_pinned(a.buf.size(), "test activation copy");
      if (!host.is_ok()) return host.status();
      a.host = std::move(host).value();
      device_.copy_to_host(a.host->data(), a.buf.data(), a.buf.size(), s);
      s.synchronize();
    }
    a.has_data = keep;
    auto nan = device_.allocate_pinned(a.buf.size(), "test activation poison");
    if (!nan.is_ok()) return nan.status();
    std::memset(nan->data(), 0xff, a.buf.size());  // NaN in f32 and bf16 alike
    device_.copy_to_device(a.buf.data(), nan->data(), a.buf.size(), s);
    s.synchronize();
    return Status::ok();
  }
  int activation_writes = 0, activation_reads = 0;

  bool any_held() const {
    for (std::size_t g = 0; g < held_.size(); ++g) {
      if (held_[g] || !grad_bufs_[g].empty()) return true;
    }
    for (const Activation& a : activations_) {
      if (a.held) return true;
    }
    return false;
  }
  void zero_grads() {
    for (auto& g : grads) std::fill(g.begin(), g.end(), 0.0f);
  }
  // A tensor's parameters or gradients by HF name.
  float* param(const std::string& name) { return find(name, params); }
  float* grad(const std::string& name) { return find(name, grads); }

  std::vector<std::vector<float>> params, grads;  // f32, per group
  std::vector<std::string> log;
  int fail_acquire_group = -1;

 private:
  void upload(const float* src, void* dst, std::size_t n) {
    auto host = device_.allocate_pinned(n * dtype_size(dtype_), "test parameter upload");
    STRATA_CHECK(host.is_ok(), "pinned test buffer", host.status().to_string());
    convert(src, DType::kF32, host->data(), dtype_, n);
    auto& s = device_.stream(device::StreamKind::kCompute);
    device_.copy_to_device(dst, host->data(), host->size(), s);
    s.synchronize();
  }
  float* find(const std::string& name, std::vector<std::vector<float>>& store) {
    const auto loc = layout_.find(name);
    STRATA_CHECK(loc.has_value(), "no tensor", name);
    return store[loc->group].data() + loc->tensor->offset_elems;
  }

  struct Activation {
    device::DeviceBuffer buf;
    std::optional<device::PinnedBuffer> host;
    bool held = false, has_data = false;
  };
  Activation& activation(std::size_t index) {
    if (activations_.size() <= index) activations_.resize(index + 1);
    return activations_[index];
  }

  const ParamLayout& layout_;
  device::Device& device_;
  DType dtype_;
  std::vector<Activation> activations_;
  std::optional<device::PinnedBuffer> host_io_;
  std::vector<device::DeviceBuffer> param_bufs_, grad_bufs_;
  std::vector<bool> held_;
  device::DeviceBuffer workspace_;
};

struct GoldenBatch {
  std::vector<std::int32_t> inputs, targets;
  std::int64_t batch = 0, seq = 0;
};

// The batch of llama_golden.py's file (inputs and targets given) or of family_golden.py's (every
// window of `seq` tokens of one sequence, targets shifted by one).
inline GoldenBatch batch_of(const Json& golden) {
  GoldenBatch b;
  b.seq = golden.at("seq");
  if (golden.contains("inputs")) {
    b.inputs = golden.at("inputs").get<std::vector<std::int32_t>>();
    b.targets = golden.at("targets").get<std::vector<std::int32_t>>();
    b.batch = golden.at("batch");
    return b;
  }
  const auto tokens = golden.at("tokens").get<std::vector<std::int32_t>>();
  b.batch = golden.at("windows");
  for (std::int64_t g = 0; g < b.batch; ++g) {
    for (std::int64_t i = 0; i < b.seq; ++i) {
      b.inputs.push_back(tokens[static_cast<std::size_t>(g * b.seq + i)]);
      b.targets.push_back(tokens[static_cast<std::size_t>(g * b.seq + i + 1)]);
    }
  }
  return b;
}

inline LlamaConfig tiny_config(bool tied) {
  LlamaConfig c;
  c.vocab_size = 17;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = tied;
  return c;
}

// Random parameters with enough spread that every path carries a visible gradient: weights
// ~ N(0, std^2), norm weights ~ 1 + N(0, 0.2^2), padding zero.
inline void fill_params(const ParamLayout& layout, TestProvider& p, std::uint64_t seed,
                        double std = 0.3) {
  Rng rng(seed);
  for (const auto& g : layout.groups()) {
    for (const auto& t : g.tensors) {
      float* x = p.params[g.id].data() + t.offset_elems;
      for (std::int64_t i = 0; i < t.num_elems; ++i) {
        x[i] = static_cast<float>(t.init == TensorInit::kOnes ? 1.0 + 0.2 * rng.normal()
                                                              : std * rng.normal());
      }
    }
  }
}

inline std::unique_ptr<device::Device> make_device(std::uint64_t limit = 0) {
  device::DeviceOptions o;
  o.memory_limit_bytes = limit;
  auto d = device::create_device(o);
  STRATA_CHECK(d.is_ok(), "cannot create the CPU device", d.status().to_string());
  return std::move(d).value();
}

}  // namespace strata::model::testing
