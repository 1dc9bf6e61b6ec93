// A checkpoint's manifests as a resume reads them: the save directory's `latest` file (which
// step directory), the step's trainer_state.json (step, data position, seed, the grid that saved
// it, the loss scaler), and that grid checked against a small model. Input: `latest`'s text, a
// line "---", then trainer_state.json (no "---": trainer_state.json alone, no `latest`).
#include <filesystem>

#include "strata/model/llama_config.h"
#include "strata/train/trainer_state.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(trainer_state) {
  using namespace strata::fuzz;
  namespace fs = std::filesystem;
  static const strata::model::LlamaConfig config = [] {
    strata::model::LlamaConfig c = small_llama(4);
    write_input("save/step-00000001/model/config.json", "{}");
    return c;
  }();
  auto [latest, state] = split_once(as_text(data), "\n---\n");
  if (state.empty() && latest == as_text(data)) std::swap(latest, state);
  std::error_code ec;
  fs::remove(scratch() + "/save/latest", ec);
  if (!latest.empty()) write_input("save/latest", latest);
  write_input("save/step-00000001/trainer_state.json", state);
  (void)strata::train::resolve_checkpoint(scratch() + "/save");
  auto st = strata::train::read_trainer_state(scratch() + "/save/step-00000001");
  if (!st.is_ok()) return;
  (void)strata::train::saved_grid(*st, config, "trainer_state.json");
}
