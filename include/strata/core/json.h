// Strict JSON helpers: typed field reads that collect every problem with its key path, and
// byte-size parsing ("2GiB").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata {

using Json = nlohmann::json;

// Parses "123", 123, "4KiB", "2GiB", "1.5GB", "512MB". Binary (KiB/MiB/GiB/TiB) and decimal
// (KB/MB/GB/TB) suffixes; "K"/"M"/"G" alone are binary.
Result<std::uint64_t> parse_bytes(const Json& value);
Result<std::uint64_t> parse_bytes(const std::string& text);
std::string format_bytes(std::uint64_t bytes);  // "1.50 GiB"

// A JSON file, // and /* */ comments allowed.
Result<Json> read_json_file(const std::string& path);
// Whether `text` is UTF-8, as JSON strings must be (a string that is not cannot be written out:
// nlohmann's dump() throws). Text from outside JSON (a command line) is checked with this.
bool is_utf8(const std::string& text);
// Writes JSON atomically: temp file, fsync, rename, fsync dir.
Status write_json_file(const std::string& path, const Json& value, int indent = 2);

// Reads typed fields from one JSON object and accumulates errors so a config reports all its
// problems at once. Keys are reported with their full dotted path.
class JsonReader {
 public:
  JsonReader(const Json& object, std::string path_prefix, std::vector<std::string>* errors);

  bool has(const std::string& key) const;
  const Json* raw(const std::string& key);  // marks key as known; nullptr if absent

  void read(const std::string& key, bool* out);
  void read(const std::string& key, std::int64_t* out, std::optional<std::int64_t> min = {},
            std::optional<std::int64_t> max = {});
  void read(const std::string& key, int* out, std::optional<std::int64_t> min = {},
            std::optional<std::int64_t> max = {});
  void read(const std::string& key, double* out, std::optional<double> min = {},
            std::optional<double> max = {});
  void read(const std::string& key, std::string* out);
  void read_choice(const std::string& key, std::string* out,
                   const std::vector<std::string>& allowed);
  void read_bytes(const std::string& key, std::uint64_t* out);
  void read(const std::string& key, std::vector<std::string>* out);
  void read(const std::string& key, std::vector<double>* out);
  void read(const std::string& key, std::vector<std::int64_t>* out);

  // Reports every key in the object that no read()/raw() call asked for, with the nearest
  // valid key where one is a few edits away, else the valid keys (or, where there are more than
  // a dozen and a hint is set, the hint: where the list is).
  void reject_unknown(const std::vector<std::string>& extra_known = {});
  void set_list_hint(std::string hint) { list_hint_ = std::move(hint); }
  void error(const std::string& key, const std::string& message);
  std::string key_path(const std::string& key) const;

 private:
  const Json& object_;
  std::string prefix_;
  std::vector<std::string>* errors_;
  std::set<std::string> known_;
  std::string list_hint_;
};

}  // namespace strata
