// Where a token file's loss mask lives: "<tokens>.mask", one byte per token (1: the loss counts
// predicting this token). strata tokenize writes it beside supervised data; the trainer finds it
// by this name.
#pragma once

#include <string>

namespace strata {

inline std::string loss_mask_path(const std::string& token_path) { return token_path + ".mask"; }

}  // namespace strata
