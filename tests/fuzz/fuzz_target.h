// Fuzz harnesses: each *_fuzz.cpp defines one target with STRATA_FUZZ_TARGET(name) { ... },
// a function of the input bytes that feeds them to one parser of outside input through the
// same entry point a user's file reaches, and returns 0.
//
// Two builds of the same sources:
//   STRATA_SANITIZE=fuzzer (clang): each harness is its own libFuzzer executable
//     (LLVMFuzzerTestOneInput), under AddressSanitizer and UndefinedBehaviorSanitizer;
//     tools/fuzz.sh runs them.
//   any other build: the harnesses register by name in strata_fuzz_replay, a test that runs
//     every seed of tests/fuzz/corpus/<name> and every regression of tests/fuzz/regressions/<name>
//     through them, so what the fuzzer once found stays fixed in the ordinary suite.
//
// A harness that must hand the parser a file writes it with fuzz::write_input into a directory
// of its own (fuzz::scratch), on tmpfs where there is one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "strata/model/llama_config.h"
#include "strata/model/safetensors.h"

namespace strata::fuzz {

using Target = std::function<void(std::span<const std::uint8_t>)>;

// Every harness linked into this binary, by name (the replay build).
std::map<std::string, Target>& targets();
bool register_target(const char* name, Target target);

// A directory private to this process, created on first use and removed at exit.
const std::string& scratch();
// Writes `bytes` to scratch()/name (replacing it) and returns the path. Aborts on a write error:
// the harness, not the parser, is then at fault.
std::string write_input(const std::string& name, std::string_view bytes);
inline std::string_view as_text(std::span<const std::uint8_t> data) {
  return {reinterpret_cast<const char*>(data.data()), data.size()};
}
// Writes scratch()/name as the project's SafetensorsWriter writes `tensors` (zeros); aborts on
// an error, as write_input does. Returns the path.
std::string write_safetensors(const std::string& name, const model::SafetensorsWriter& tensors);

// A small Llama (vocabulary 32, hidden 16, 4 heads, 2 KV heads) of `layers` layers, for the
// harnesses that check what they read against a model.
model::LlamaConfig small_llama(int layers);

// Splits `text` at the first occurrence of `separator`: {before, after}; {text, ""} without one.
std::pair<std::string_view, std::string_view> split_once(std::string_view text,
                                                         std::string_view separator);

}  // namespace strata::fuzz

#if defined(STRATA_FUZZ_ENTRY)
#define STRATA_FUZZ_TARGET(name)                                                      \
  static void strata_fuzz_body(std::span<const std::uint8_t> data);                   \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    strata_fuzz_body({data, size});                                                   \
    return 0;                                                                         \
  }                                                                                   \
  static void strata_fuzz_body(std::span<const std::uint8_t> data)
#else
#define STRATA_FUZZ_TARGET(name)                                      \
  static void strata_fuzz_##name(std::span<const std::uint8_t> data); \
  [[maybe_unused]] static const bool strata_fuzz_registered_##name =  \
      ::strata::fuzz::register_target(#name, strata_fuzz_##name);     \
  static void strata_fuzz_##name(std::span<const std::uint8_t> data)
#endif
