// Seeded, serializable random number generation (state fits in a checkpoint).
#pragma once

#include <cstdint>

namespace strata {

// splitmix64-seeded xoshiro256**: fast, reproducible across platforms, state is 4 words.
class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0);
  std::uint64_t next_u64();
  // Uniform in [0, 1).
  double uniform();
  // Standard normal (Box-Muller, no cached spare so state is exactly the 4 words).
  double normal();
  std::uint64_t uniform_int(std::uint64_t bound);  // [0, bound)

  std::uint64_t state[4];
};

}  // namespace strata
