// A long token sequence (u16 ids below 256, as a .u16 file holds them) and the model config
// that reads it at 32K positions with Llama 3's rope scaling, for the long-sequence tests of
// both backends.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/json.h"

namespace strata::testing {

// n + 1 token ids (n targets) as little-endian u16 bytes.
inline std::string long_sequence_u16(std::int64_t n) {
  std::string bytes;
  std::uint64_t x = 7;
  for (std::int64_t i = 0; i <= n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const auto t = static_cast<std::uint16_t>((i * 7 + static_cast<std::int64_t>(x >> 60)) % 256);
    bytes += static_cast<char>(t & 0xff);
    bytes += static_cast<char>(t >> 8);
  }
  return bytes;
}

// A 2-layer model of these sizes over 32768 positions, rope scaled as Llama 3's.
inline Json long_context_model(int hidden, int intermediate, int heads, int kv_heads) {
  Json m = Json::parse(R"({"vocab_size": 256, "num_hidden_layers": 2,
      "rope_theta": 500000.0, "max_position_embeddings": 32768,
      "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})");
  m["hidden_size"] = hidden;
  m["intermediate_size"] = intermediate;
  m["num_attention_heads"] = heads;
  m["num_key_value_heads"] = kv_heads;
  return m;
}

}  // namespace strata::testing
