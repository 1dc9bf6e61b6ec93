// What the model asks for: a layer's weights on the device, and somewhere to put its gradients.
// The model knows nothing of where parameters live; zero implements this interface. The model's
// device workspace comes from here too, so one budget covers everything on the device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::model {

// How the model fills a gradient buffer it asks for (ParamProvider::acquire_grads).
enum class GradientWrite : std::uint8_t {
  kAdd,    // zero-filled: the model adds into it
  kWrite,  // the model writes each tensor whole; only the gaps between tensors are zeroed
};

class ParamProvider {
 public:
  virtual ~ParamProvider() = default;

  // Device pointer to the group's parameters in the compute dtype, laid out as ParamLayout says.
  // Valid until release_params(group). Blocks until the data is on the device.
  virtual Result<const void*> acquire_params(int group) = 0;
  virtual void release_params(int group) = 0;
  // The model will call acquire_params(group) soon; start moving it. Optional.
  virtual void prefetch_params(int /*group*/) {}

  // Device buffer of the group's size in the compute dtype for this micro-batch's gradient: with
  // kAdd zero-filled, the model accumulating (+=) into it; with kWrite the model writes every
  // element of each of the group's tensors before it reads any (one product per tensor, beta 0),
  // and the provider zeroes only what lies between them (alignment, padding).
  virtual Result<void*> acquire_grads(int group, GradientWrite write) = 0;
  // The group's gradient for this micro-batch is complete: the provider takes it off the device
  // (accumulating into its own gradient store) and frees the buffer.
  virtual Status release_grads(int group) = 0;

  // Device memory of `bytes` for the model's activations and scratch, under the same budget as
  // the parameters; `what` names it in errors. Valid until the next workspace call (which
  // replaces it) or the provider's end.
  virtual Result<void*> workspace(std::uint64_t bytes, const std::string& what) = 0;
  // Pinned host memory of `bytes` for the model's own copies to and from the device (token ids
  // in, losses or logits out), under the provider's host budget; `what` names it. Valid until
  // the next host_io call (which replaces it) or the provider's end.
  virtual Result<void*> host_io(std::uint64_t bytes, const std::string& what) = 0;

  // Checkpointed activations (activation_checkpointing): the input of each block, and the final
  // hidden state, kept from the forward until the backward reads them. The provider keeps each
  // one, numbered 0..num_layers, where its memory plan homes checkpointed activations (on the
  // device, or in host memory or on NVMe, moved off after the forward and back for the
  // backward); the model only says when it writes, reads and is done with one.
  // A device buffer of `bytes` to write activation `index` into; the model holds it until
  // release_activation.
  virtual Result<void*> write_activation(int index, std::uint64_t bytes) = 0;
  // Activation `index` as written, on the device, held until release_activation.
  virtual Result<const void*> read_activation(int index) = 0;
  // The model will read activation `index` soon; start bringing it back. Optional.
  virtual void prefetch_activation(int /*index*/) {}
  // Done with it: `keep` when it will be read again (it may leave the device), else its data is
  // no longer needed.
  virtual Status release_activation(int index, bool keep) = 0;

  // Mixture of experts: `rows` holds, for each expert of one MoE layer, the token rows this
  // rank's micro-batch routes to it; it becomes their sum over the data-parallel ranks, so that
  // every rank acquires, gathers and reduces the same experts (those with rows on some rank) in
  // the same order, as its collectives require. A collective: every data-parallel rank calls it
  // for the same layers in the same order. One rank: unchanged. `what` names the layer.
  virtual Status sum_expert_rows(std::vector<double>& /*rows*/, const std::string& /*what*/) {
    return Status::ok();
  }
  // Whether acquire_params(group) is a collective every data-parallel rank must join (ZeRO-3's
  // gather of a partitioned group): an expert a rank's tokens did not choose is acquired then
  // all the same, and otherwise not at all.
  virtual bool acquire_is_collective(int /*group*/) const { return false; }
};

}  // namespace strata::model
