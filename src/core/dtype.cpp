// dtype names, f16 conversions (bf16 is inline in the header) and chunked sums of squares.
#include "strata/core/dtype.h"

#include <cstddef>

#include "strata/core/check.h"

namespace strata {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kU32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
    case DType::kU16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kU16:
      return "u16";
    case DType::kU32:
      return "u32";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kU16:
      return "U16";
    case DType::kU32:
      return "U32";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view n) {
  if (n == "f32" || n == "fp32" || n == "F32" || n == "float32") return DType::kF32;
  if (n == "bf16" || n == "BF16" || n == "bfloat16") return DType::kBF16;
  if (n == "f16" || n == "fp16" || n == "F16" || n == "float16") return DType::kF16;
  if (n == "u16" || n == "U16" || n == "uint16") return DType::kU16;
  if (n == "u32" || n == "U32" || n == "uint32") return DType::kU32;
  if (n == "i32" || n == "I32" || n == "int32") return DType::kI32;
  if (n == "i64" || n == "I64" || n == "int64") return DType::kI64;
  if (n == "u8" || n == "U8" || n == "uint8") return DType::kU8;
  return std::nullopt;
}

float f16_to_f32(f16 h) {
  const std::uint32_t sign = (h.bits & 0x8000u) << 16;
  std::uint32_t exp = (h.bits >> 10) & 0x1f;
  std::uint32_t mant = h.bits & 0x3ff;
  std::uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      out = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(out);
}

f16 f32_to_f16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{static_cast<std::uint16_t>(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return f16{static_cast<std::uint16_t>(sign | 0x7c00u)};  // overflow
  if (abs < 0x38800000u) {  // result is subnormal or zero in f16
    // Add a magic number so the FPU performs round-to-nearest-even at the f16 subnormal LSB.
    const float magic = std::bit_cast<float>(0x3f000000u);  // 0.5 shifts LSB to 2^-24
    float a = std::bit_cast<float>(abs) + magic;
    std::uint32_t r = std::bit_cast<std::uint32_t>(a) - 0x3f000000u;
    return f16{static_cast<std::uint16_t>(sign | r)};
  }
  std::uint32_t mant_odd = (abs >> 13) & 1u;
  std::uint32_t v = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112<<23) and round
  return f16{static_cast<std::uint16_t>(sign | (v >> 13))};
}

namespace {

// One loop per pair of dtypes: no per-element dispatch, so each loop is a plain elementwise map.
template <typename Load, typename Store>
void convert_with(const void* src, void* dst, std::size_t n, Load load, Store store) {
  for (std::size_t i = 0; i < n; ++i) store(dst, i, load(src, i));
}

float load_f32(const void* p, std::size_t i) { return static_cast<const float*>(p)[i]; }
float load_bf16(const void* p, std::size_t i) {
  return bf16_to_f32(static_cast<const bf16*>(p)[i]);
}
float load_f16(const void* p, std::size_t i) { return f16_to_f32(static_cast<const f16*>(p)[i]); }
void store_f32(void* p, std::size_t i, float x) { static_cast<float*>(p)[i] = x; }
void store_bf16(void* p, std::size_t i, float x) { static_cast<bf16*>(p)[i] = f32_to_bf16(x); }
void store_f16(void* p, std::size_t i, float x) { static_cast<f16*>(p)[i] = f32_to_f16(x); }

bool is_float_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

template <typename Load>
void convert_from(const void* src, Load load, void* dst, DType dst_dtype, std::size_t n) {
  switch (dst_dtype) {
    case DType::kF32:
      return convert_with(src, dst, n, load, store_f32);
    case DType::kBF16:
      return convert_with(src, dst, n, load, store_bf16);
    case DType::kF16:
      return convert_with(src, dst, n, load, store_f16);
    default:
      STRATA_CHECK(false, "convert: unsupported destination dtype", dtype_name(dst_dtype));
  }
}

}  // namespace

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, n * dtype_size(src_dtype));
    return;
  }
  STRATA_CHECK(is_float_dtype(src_dtype), "convert: unsupported source dtype",
               dtype_name(src_dtype));
  STRATA_CHECK(is_float_dtype(dst_dtype), "convert: unsupported destination dtype",
               dtype_name(dst_dtype));
  switch (src_dtype) {
    case DType::kF32:
      return convert_from(src, load_f32, dst, dst_dtype, n);
    case DType::kBF16:
      return convert_from(src, load_bf16, dst, dst_dtype, n);
    default:
      return convert_from(src, load_f16, dst, dst_dtype, n);
  }
}

namespace {
// Element i of the chunk goes to lane i % kSumSquaresLanes; each lane sums in order; the lanes
// are added as a fixed tree. A square of a float is exact in double, so a fused multiply-add
// gives the same bits as a multiply then an add: every SIMD path can match this loop.
template <typename T, typename Load>
double squares_of(const void* x, std::size_t n, Load load) {
  static_assert(kSumSquaresLanes == 8);
  const T* v = static_cast<const T*>(x);
  double lane[kSumSquaresLanes] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const double d = load(v[i]);
    lane[i % kSumSquaresLanes] += d * d;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
}  // namespace

double sum_squares_chunk(const void* x, DType dtype, std::size_t n) {
  switch (dtype) {
    case DType::kF32:
      return squares_of<float>(x, n, [](float f) { return f; });
    case DType::kBF16:
      return squares_of<bf16>(x, n, [](bf16 h) { return bf16_to_f32(h); });
    case DType::kF16:
      return squares_of<f16>(x, n, [](f16 h) { return f16_to_f32(h); });
    default:
      STRATA_CHECK(false, "sum_squares: unsupported dtype", dtype_name(dtype));
  }
  return 0.0;
}

}  // namespace strata
