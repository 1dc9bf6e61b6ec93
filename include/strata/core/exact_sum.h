// ExactSum: a sum of non-negative doubles with no rounding, so the same terms give the same bits
// in any order and any grouping. Gradient norms use it: each fixed chunk of a gradient's sum of
// squares is one term, and the chunks' sums meet across micro-batches, shards and ranks without
// the partition changing a bit.
#pragma once

#include <cstdint>

namespace strata {

// A fixed-point integer of kLimbs limbs of 32 bits (limb i weighs 2^(32 i + kLowBit)), each
// held in an int64 so that additions carry lazily, plus the sum of the non-finite terms. Plain
// data: a device writes it (the CUDA backend adds limbs with integer atomics, which commute).
// Exact for terms that are multiples of 2^kLowBit below 2^kHighBit: every sum of squares of
// f32, bf16 or f16 values (at least 2^-298 when not zero, at most 2^265 for 256 of them).
struct ExactSum {
  static constexpr int kLimbs = 20;
  static constexpr int kLimbBits = 32;
  static constexpr int kLowBit = -320;
  static constexpr int kHighBit = kLowBit + kLimbBits * (kLimbs - 1);  // the top limb carries
  // Doubles of to_doubles: the limbs, then the non-finite terms' sum.
  static constexpr int kDoubles = kLimbs + 1;

  std::int64_t limbs[kLimbs] = {};
  double special = 0;  // the sum of the infinite and NaN terms (0 when none)

  // Adds x >= 0 (a NaN or infinity goes to `special`; bits below 2^kLowBit are dropped; a term
  // at or above 2^kHighBit counts as infinity).
  void add(double x);
  ExactSum& operator+=(const ExactSum& other);
  // Carries every limb into [0, 2^32), the top one excepted: one form per value.
  void normalize();
  // The sum, rounded to a double (the same double for the same sum), plus `special`.
  double value() const;
  bool operator==(const ExactSum& other) const;

  // The normalized limbs and `special` as kDoubles doubles, each limb exactly: a host all-reduce
  // that adds these over up to 2^20 ranks, in any order, gives the exact sum's doubles.
  void to_doubles(double* out) const;
  static ExactSum from_doubles(const double* in);
};

}  // namespace strata
