// Strict JSON reading: typed fields, ranges, unknown-key rejection, byte sizes.
#include "strata/core/json.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "strata/core/file.h"

namespace strata {

Result<std::uint64_t> parse_bytes(const std::string& text) {
  std::size_t pos = 0;
  double number = 0;
  try {
    number = std::stod(text, &pos);
  } catch (...) {
    return invalid_argument("'" + text +
                            "' is not a byte size; expected e.g. 1048576, \"512MiB\" or \"2GiB\"");
  }
  std::string unit = text.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  double mult = 1;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "K" || unit == "KiB")
    mult = 1024.0;
  else if (unit == "M" || unit == "MiB")
    mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB" || unit == "kB")
    mult = 1e3;
  else if (unit == "MB")
    mult = 1e6;
  else if (unit == "GB")
    mult = 1e9;
  else if (unit == "TB")
    mult = 1e12;
  else
    return invalid_argument("'" + text + "' has unknown unit '" + unit +
                            "'; expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB");
  const double bytes = number * mult;
  if (!(bytes >= 0) || bytes > 1.8e19)
    return invalid_argument("'" + text + "' is not a valid byte size (negative or too large)");
  return static_cast<std::uint64_t>(std::llround(bytes));
}

Result<std::uint64_t> parse_bytes(const Json& value) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer()) {
    if (value.get<std::int64_t>() < 0)
      return invalid_argument("byte size " + value.dump() + " is negative");
    return value.get<std::uint64_t>();
  }
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (d < 0 || d != std::floor(d))
      return invalid_argument("byte size " + value.dump() + " is not a whole non-negative number");
    return static_cast<std::uint64_t>(d);
  }
  if (value.is_string()) return parse_bytes(value.get<std::string>());
  return invalid_argument("byte size " + value.dump() +
                          " must be a number or a string like \"2GiB\"");
}

std::string format_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, units[u]);
  return buf;
}

Result<Json> read_json_file(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::string text, read_file(path));
  try {
    // Comments (// and /* */) are allowed, so a config can say what it is for.
    return Json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for 1e999
    return data_loss(path + " is not valid JSON: " + e.what());
  }
}

bool is_utf8(const std::string& text) {
  try {
    (void)Json(text).dump();  // nlohmann's own UTF-8 check, the one dump() applies
    return true;
  } catch (const Json::type_error&) {
    return false;
  }
}

Status write_json_file(const std::string& path, const Json& value, int indent) {
  return write_file_atomic(path, value.dump(indent) + "\n");
}

JsonReader::JsonReader(const Json& object, std::string path_prefix,
                       std::vector<std::string>* errors)
    : object_(object), prefix_(std::move(path_prefix)), errors_(errors) {}

std::string JsonReader::key_path(const std::string& key) const {
  return prefix_.empty() ? key : prefix_ + "." + key;
}

void JsonReader::error(const std::string& key, const std::string& message) {
  errors_->push_back("'" + key_path(key) + "': " + message);
}

bool JsonReader::has(const std::string& key) const {
  return object_.is_object() && object_.contains(key) && !object_.at(key).is_null();
}

const Json* JsonReader::raw(const std::string& key) {
  known_.insert(key);
  if (!has(key)) return nullptr;
  return &object_.at(key);
}

void JsonReader::read(const std::string& key, bool* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (!v->is_boolean()) return error(key, "expected true or false, got " + v->dump());
  *out = v->get<bool>();
}

void JsonReader::read(const std::string& key, std::int64_t* out, std::optional<std::int64_t> min,
                      std::optional<std::int64_t> max) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  std::int64_t x = 0;
  if (v->is_number_integer()) {
    x = v->get<std::int64_t>();
  } else if (v->is_number_float() && v->get<double>() == std::floor(v->get<double>()) &&
             std::abs(v->get<double>()) < 9e18) {
    x = static_cast<std::int64_t>(v->get<double>());
  } else {
    return error(key, "expected an integer, got " + v->dump());
  }
  if (min && x < *min)
    return error(key, "must be >= " + std::to_string(*min) + ", got " + std::to_string(x));
  if (max && x > *max)
    return error(key, "must be <= " + std::to_string(*max) + ", got " + std::to_string(x));
  *out = x;
}

void JsonReader::read(const std::string& key, int* out, std::optional<std::int64_t> min,
                      std::optional<std::int64_t> max) {
  std::int64_t x = *out;
  const std::size_t before = errors_->size();
  read(key, &x, min ? min : std::optional<std::int64_t>(INT32_MIN),
       max ? max : std::optional<std::int64_t>(INT32_MAX));
  if (errors_->size() == before) *out = static_cast<int>(x);
}

void JsonReader::read(const std::string& key, double* out, std::optional<double> min,
                      std::optional<double> max) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (!v->is_number()) return error(key, "expected a number, got " + v->dump());
  const double x = v->get<double>();
  if (!std::isfinite(x)) return error(key, "must be finite");
  std::ostringstream os;
  if (min && x < *min) {
    os << "must be >= " << *min << ", got " << x;
    return error(key, os.str());
  }
  if (max && x > *max) {
    os << "must be <= " << *max << ", got " << x;
    return error(key, os.str());
  }
  *out = x;
}

void JsonReader::read(const std::string& key, std::string* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (!v->is_string()) return error(key, "expected a string, got " + v->dump());
  *out = v->get<std::string>();
}

void JsonReader::read_choice(const std::string& key, std::string* out,
                             const std::vector<std::string>& allowed) {
  std::string s = *out;
  const std::size_t before = errors_->size();
  read(key, &s);
  if (errors_->size() != before) return;
  for (const auto& a : allowed) {
    if (a == s) {
      *out = s;
      return;
    }
  }
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : "|") + a;
  error(key, "got '" + s + "'; expected one of " + list);
}

void JsonReader::read_bytes(const std::string& key, std::uint64_t* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  auto r = parse_bytes(*v);
  if (!r.is_ok()) return error(key, r.status().message());
  *out = *r;
}

void JsonReader::read(const std::string& key, std::vector<std::string>* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (v->is_string()) {
    *out = {v->get<std::string>()};
    return;
  }
  if (!v->is_array()) return error(key, "expected a list of strings, got " + v->dump());
  std::vector<std::string> r;
  for (const auto& e : *v) {
    if (!e.is_string()) return error(key, "expected a list of strings, got element " + e.dump());
    r.push_back(e.get<std::string>());
  }
  *out = std::move(r);
}

void JsonReader::read(const std::string& key, std::vector<double>* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (!v->is_array()) return error(key, "expected a list of numbers, got " + v->dump());
  std::vector<double> r;
  for (const auto& e : *v) {
    if (!e.is_number()) return error(key, "expected a list of numbers, got element " + e.dump());
    r.push_back(e.get<double>());
  }
  *out = std::move(r);
}

void JsonReader::read(const std::string& key, std::vector<std::int64_t>* out) {
  const Json* v = raw(key);
  if (v == nullptr) return;
  if (!v->is_array()) return error(key, "expected a list of whole numbers, got " + v->dump());
  std::vector<std::int64_t> r;
  for (const auto& e : *v) {
    if (!e.is_number_integer()) {
      return error(key, "expected a list of whole numbers, got element " + e.dump());
    }
    r.push_back(e.get<std::int64_t>());
  }
  *out = std::move(r);
}

namespace {

// Edits (insertions, deletions, substitutions and swaps of neighbours, case ignored) between a
// and b: how far a mistyped key is from a valid one.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  const auto lower = [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  };
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = lower(a[i - 1]) == lower(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) &&
          lower(a[i - 2]) == lower(b[j - 1])) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

void JsonReader::reject_unknown(const std::vector<std::string>& extra_known) {
  if (!object_.is_object()) return;
  for (const auto& k : extra_known) known_.insert(k);
  for (auto it = object_.begin(); it != object_.end(); ++it) {
    if (known_.count(it.key()) != 0) continue;
    // The nearest valid key, when it is near: a third of the key's letters (at least 2) or
    // fewer edits away.
    const std::string& key = it.key();
    std::string nearest;
    std::size_t best = std::max<std::size_t>(2, key.size() / 3) + 1;
    for (const auto& k : known_) {
      if (const std::size_t d = edit_distance(key, k); d < best) best = d, nearest = k;
    }
    if (!nearest.empty()) {
      error(key, "unknown key; did you mean '" + key_path(nearest) + "'?");
      continue;
    }
    if (!list_hint_.empty() && known_.size() > 12) {
      error(key, "unknown key (" + list_hint_ + ")");
      continue;
    }
    std::string valid;
    for (const auto& k : known_) valid += (valid.empty() ? "" : ", ") + k;
    error(key, "unknown key; valid keys here are: " + valid);
  }
}

}  // namespace strata
