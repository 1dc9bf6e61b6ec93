// Token files (u16, u32, llm.c .bin, text) and the loss mask beside them, as a run samples them.
// Input: a byte choosing the format, a byte choosing seq_len (1-64), the token file, and
// optionally "MASK" followed by the mask file.
#include <vector>

#include "strata/core/token_files.h"
#include "strata/train/data.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(token_data) {
  using namespace strata::fuzz;
  using namespace strata::train;
  if (data.size() < 2) return;
  const TokenFormat format = kTokenFormats[data[0] % kTokenFormats.size()];
  const std::int64_t seq_len = 1 + data[1] % 64;
  const auto [tokens, mask] = split_once(as_text(data.subspan(2)), "MASK");
  const std::string path = write_input("tokens.bin", tokens);
  auto dataset = TokenDataset::open(path, format);
  if (!dataset.is_ok()) return;
  if (!SequenceSampler::check(**dataset, seq_len).is_ok()) return;
  SequenceSampler sampler(*dataset, seq_len, /*seed=*/data[1]);
  if (!mask.empty()) {
    auto m = TokenDataset::open(write_input("tokens.bin.mask", mask), TokenFormat::kText);
    if (m.is_ok() && !sampler.set_mask(*m).is_ok()) return;
  }
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(seq_len)), targets(inputs.size());
  // Two epochs' worth where there are few windows: the second epoch reshuffles.
  const std::int64_t count = std::min<std::int64_t>(2 * sampler.num_windows(), 8);
  for (std::int64_t g = 0; g < count; ++g) {
    (void)sampler.sequence(g, /*vocab_size=*/300, inputs.data(), targets.data());
    (void)sampler.count_targets(g);
  }
}
