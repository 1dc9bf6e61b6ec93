// xoshiro256** seeded by splitmix64.
#include "strata/core/rng.h"

#include <array>
#include <cmath>
#include <numbers>
#include <vector>

namespace strata {
namespace {
std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// xoshiro256's state transition (next_u64 without the output): linear over GF(2).
void advance(std::uint64_t* s) {
  const std::uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
}

// A 256x256 bit matrix over GF(2) by columns: column j is the image of state bit j.
using Bits = std::array<std::uint64_t, 4>;
using Matrix = std::array<Bits, 256>;

Bits transform(const Matrix& m, const Bits& v) {
  Bits out{};
  for (int j = 0; j < 256; ++j) {
    if ((v[static_cast<std::size_t>(j / 64)] >> (j % 64)) & 1u) {
      const Bits& c = m[static_cast<std::size_t>(j)];
      for (std::size_t w = 0; w < 4; ++w) out[w] ^= c[w];
    }
  }
  return out;
}

// powers[k] = the transition applied 2^k times, k = 0..63.
const std::vector<Matrix>& transition_powers() {
  static const std::vector<Matrix> powers = [] {
    std::vector<Matrix> p(64);
    for (int j = 0; j < 256; ++j) {
      Bits e{};
      e[static_cast<std::size_t>(j / 64)] = std::uint64_t{1} << (j % 64);
      advance(e.data());
      p[0][static_cast<std::size_t>(j)] = e;
    }
    for (std::size_t k = 1; k < p.size(); ++k) {
      for (std::size_t j = 0; j < 256; ++j) p[k][j] = transform(p[k - 1], p[k - 1][j]);
    }
    return p;
  }();
  return powers;
}
}  // namespace

Rng::Rng(std::uint64_t seed) {
  for (auto& s : state) s = splitmix64(seed);
}

std::uint64_t Rng::next_u64() {
  const std::uint64_t result = rotl(state[1] * 5, 7) * 9;
  advance(state);
  return result;
}

void Rng::discard(std::uint64_t draws) {
  if (draws < 64) {  // cheaper stepped than jumped
    for (; draws > 0; --draws) advance(state);
    return;
  }
  const std::vector<Matrix>& powers = transition_powers();
  Bits s{state[0], state[1], state[2], state[3]};
  for (std::size_t k = 0; draws != 0; ++k, draws >>= 1) {
    if (draws & 1u) s = transform(powers[k], s);
  }
  for (std::size_t w = 0; w < 4; ++w) state[w] = s[w];
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::box_muller(double u1, double u2) {
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

double Rng::normal() {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return box_muller(u1, u2);
}

std::uint64_t Rng::uniform_int(std::uint64_t bound) {
  // Lemire's nearly-divisionless method would be faster; bias here is < 2^-40 for our bounds.
  return bound == 0 ? 0 : next_u64() % bound;
}

}  // namespace strata
