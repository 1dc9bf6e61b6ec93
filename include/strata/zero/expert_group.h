// The model's ExpertGroup over a communicator (the process grid's expert group).
#pragma once

#include <memory>

#include "strata/dist/communicator.h"
#include "strata/model/expert_group.h"

namespace strata::zero {

// `comm` must outlive it; its counters count the exchanges.
std::unique_ptr<model::ExpertGroup> make_expert_group(dist::Communicator& comm);

}  // namespace strata::zero
