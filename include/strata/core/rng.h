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
  // Standard normal (Box-Muller, no cached spare so state is exactly the 4 words). Two draws,
  // unless the first uniform is 0 (probability 2^-53 a call), which draws again.
  double normal();
  // normal()'s transform of two uniforms (u1 in (0, 1)), for code that draws them itself.
  static double box_muller(double u1, double u2);
  std::uint64_t uniform_int(std::uint64_t bound);  // [0, bound)
  // Advances the state as `draws` calls of next_u64 would, in O(log draws): the step is linear
  // over GF(2), so it is a 256x256 bit matrix whose powers of two are computed once.
  void discard(std::uint64_t draws);

  std::uint64_t state[4];
};

}  // namespace strata
