// Seeded, serializable random number generation (state fits in a checkpoint).
#pragma once

#include <cstdint>

namespace strata {

// The i-th output of splitmix64 seeded with `key`: a counter-based hash, so element i of a
// random mask is computed wherever it is needed, on any backend, without a stream to advance.
inline constexpr std::uint64_t splitmix64_at(std::uint64_t key, std::uint64_t i) {
  std::uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

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
