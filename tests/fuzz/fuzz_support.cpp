#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tests/fuzz/fuzz_target.h"

namespace strata::fuzz {

std::map<std::string, Target>& targets() {
  static std::map<std::string, Target> all;
  return all;
}

bool register_target(const char* name, Target target) {
  targets().emplace(name, std::move(target));
  return true;
}

namespace {

std::string make_scratch() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path base =
      fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
  std::string dir = (base / "strata-fuzz-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) {
    std::perror(("strata fuzz: mkdtemp " + dir).c_str());
    std::abort();
  }
  static const std::string removed_at_exit = dir;
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(removed_at_exit, ignored);
  });
  return dir;
}

}  // namespace

const std::string& scratch() {
  static const std::string dir = make_scratch();
  return dir;
}

std::string write_input(const std::string& name, std::string_view bytes) {
  const std::string path = scratch() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "strata fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

std::string write_safetensors(const std::string& name, const model::SafetensorsWriter& tensors) {
  const std::string path = scratch() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  const Status s = tensors.write(path, [](const model::SafetensorsEntry& e, void* dst) {
    std::memset(dst, 0, e.end - e.begin);
    return Status::ok();
  });
  if (!s.is_ok()) {
    std::fprintf(stderr, "strata fuzz: %s\n", s.to_string().c_str());
    std::abort();
  }
  return path;
}

model::LlamaConfig small_llama(int layers) {
  model::LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  return c;
}

std::pair<std::string_view, std::string_view> split_once(std::string_view text,
                                                         std::string_view separator) {
  const auto at = text.find(separator);
  if (at == std::string_view::npos) return {text, {}};
  return {text.substr(0, at), text.substr(at + separator.size())};
}

}  // namespace strata::fuzz
