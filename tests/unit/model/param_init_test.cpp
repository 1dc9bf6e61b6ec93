// Random initialization: Rng::discard against stepping, and init_group's parallel chunks against
// one thread drawing the same stream in order.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

#include "strata/core/rng.h"
#include "strata/model/param_layout.h"

namespace strata::model {
namespace {

TEST(RngTest, DiscardIsTheSameAsDrawing) {
  for (std::uint64_t n : {0ull, 1ull, 63ull, 64ull, 65ull, 1000ull, 131072ull, 1048579ull}) {
    SCOPED_TRACE(n);
    Rng drawn(12345), jumped(12345);
    for (std::uint64_t i = 0; i < n; ++i) drawn.next_u64();
    jumped.discard(n);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(jumped.state[w], drawn.state[w]);
    EXPECT_EQ(jumped.next_u64(), drawn.next_u64());
  }
  // Jumps compose: 2^40 + 3 in two parts or one.
  Rng a(7), b(7);
  a.discard((std::uint64_t{1} << 40) + 3);
  b.discard(std::uint64_t{1} << 40);
  b.discard(3);
  for (int w = 0; w < 4; ++w) EXPECT_EQ(a.state[w], b.state[w]);
}

// init_group as one thread draws it: every random tensor's elements in order from one stream.
std::vector<float> serial_init(const LlamaConfig& config, const ParamGroup& group,
                               std::uint64_t seed) {
  std::vector<float> out(static_cast<std::size_t>(group.num_elems), 0.0f);
  Rng rng(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(group.id) + 1);
  for (const auto& t : group.tensors) {
    float* p = out.data() + t.offset_elems;
    if (t.init == TensorInit::kOnes) {
      std::fill(p, p + t.num_elems, 1.0f);
    } else if (t.init != TensorInit::kZeros) {
      for (std::int64_t i = 0; i < t.num_elems; ++i)
        p[i] = static_cast<float>(rng.normal() * config.initializer_range);
    }
  }
  return out;
}

// Layer groups of ~0.3M elements: several 64Ki chunks, tensors that straddle chunk edges, biases
// and norms between them.
LlamaConfig several_chunks_config() {
  LlamaConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 192;
  c.intermediate_size = 520;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.qkv_bias = true;
  return c;
}

// init_group_range gives init_group's elements for any range: across tensors, inside one, the
// ones of a norm, the zeros of padding, a LoRA A drawn from its own stream.
TEST(InitGroupTest, ARangeIsThatPartOfTheWholeGroup) {
  const LlamaConfig c = several_chunks_config();
  LoraConfig lora;
  lora.r = 4;
  const ParamLayout layout = ParamLayout::build(c, lora);
  for (const auto& g : layout.groups()) {
    std::vector<float> whole(static_cast<std::size_t>(g.num_elems));
    init_group(c, g, 42, whole.data());
    const std::int64_t n = g.num_elems;
    for (const auto& [begin, count] :
         {std::pair{std::int64_t{0}, n}, std::pair{n / 5, n / 2}, std::pair{n - 3, std::int64_t{3}},
          std::pair{std::int64_t{65537}, std::int64_t{70000}}}) {
      if (begin + count > n) continue;
      std::vector<float> part(static_cast<std::size_t>(count), -1.0f);
      init_group_range(c, g, 42, begin, count, part.data());
      for (std::int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(part[static_cast<std::size_t>(i)]),
                  std::bit_cast<std::uint32_t>(whole[static_cast<std::size_t>(begin + i)]))
            << g.name << " [" << begin << ", +" << count << ") at " << i;
      }
    }
  }
}

TEST(InitGroupTest, ParallelChunksGiveTheSerialStreamBitForBit) {
  LlamaConfig c = several_chunks_config();
  c.mlp_bias = true;
  const ParamLayout layout = ParamLayout::build(c);
  for (std::uint64_t seed : {0ull, 42ull}) {
    for (const auto& g : layout.groups()) {
      SCOPED_TRACE(g.name + " seed " + std::to_string(seed));
      std::vector<float> got(static_cast<std::size_t>(g.num_elems), -1.0f);
      init_group(c, g, seed, got.data());
      const std::vector<float> want = serial_init(c, g, seed);
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
            << "element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace strata::model
