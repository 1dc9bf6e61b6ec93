// HF checkpoint directories: write/read round trips, sharded indexes, validation against a layout.
#include "strata/model/hf_checkpoint.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "strata/core/json.h"
#include "tests/testing/temp_dir.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

LlamaConfig checkpoint_config(bool tied = false) {
  LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  return c;
}

// Every group's values, random (norm weights too, so a swapped tensor would show), padding zero.
std::vector<std::vector<float>> make_values(const LlamaConfig& config, const ParamLayout& layout,
                                            std::uint64_t seed) {
  std::vector<std::vector<float>> values;
  for (const auto& g : layout.groups()) {
    std::vector<float> v(static_cast<std::size_t>(g.num_elems));
    init_group(config, g, seed, v.data());
    for (const auto& t : g.tensors) {
      if (t.init != TensorInit::kOnes) continue;
      for (std::int64_t i = 0; i < t.num_elems; ++i) v[t.offset_elems + i] += 0.01f * (i % 7);
    }
    values.push_back(std::move(v));
  }
  return values;
}

GroupSource source_of(const std::vector<std::vector<float>>& values, int* calls = nullptr) {
  return [&values, calls](const ParamGroup& g, float* dst) {
    if (calls != nullptr) ++*calls;
    std::memcpy(dst, values[g.id].data(), values[g.id].size() * sizeof(float));
    return Status::ok();
  };
}

struct Tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
  DType dtype = DType::kF32;
};

// The layout's tensors with their values, ready to write by hand (extra/modified in tests).
std::vector<Tensor> layout_tensors(const ParamLayout& layout,
                                   const std::vector<std::vector<float>>& values) {
  std::vector<Tensor> out;
  for (const auto& g : layout.groups()) {
    for (const auto& t : g.tensors) {
      const float* p = values[g.id].data() + t.offset_elems;
      out.push_back({t.name, t.shape, std::vector<float>(p, p + t.num_elems)});
    }
  }
  return out;
}

void write_tensors(const std::string& path, const std::vector<Tensor>& tensors) {
  SafetensorsWriter writer;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& t : tensors) {
    writer.add(t.name, t.dtype, t.shape);
    by_name[t.name] = &t;
  }
  const Status s = writer.write(path, [&](const SafetensorsEntry& e, void* dst) {
    const Tensor& t = *by_name.at(e.name);
    if (t.dtype == DType::kU16) {
      std::memset(dst, 0, e.end - e.begin);
    } else {
      convert(t.values.data(), DType::kF32, dst, t.dtype, t.values.size());
    }
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
}

void write_config(const std::string& dir, const LlamaConfig& config) {
  ASSERT_TRUE(write_json_file(dir + "/config.json", config.to_json()).is_ok());
}

void expect_groups_equal(const HfCheckpointReader& reader, const ParamLayout& layout,
                         const std::vector<std::vector<float>>& expected) {
  for (const auto& g : layout.groups()) {
    std::vector<float> got(static_cast<std::size_t>(g.num_elems), 123.0f);
    const Status s = reader.read_group(g, got.data());
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_EQ(std::memcmp(got.data(), expected[g.id].data(), got.size() * sizeof(float)), 0)
        << "group " << g.name;
  }
}

void expect_contains(const Status& s, const std::string& needle) {
  EXPECT_NE(s.message().find(needle), std::string::npos)
      << "message: " << s.message() << "\nexpected to contain: " << needle;
}

TEST(HfCheckpoint, WriteThenReadF32IsBitExact) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 42);
  int calls = 0;
  const std::string ckpt = dir.file("ckpt/nested");  // created on demand
  const Status s =
      write_hf_checkpoint(ckpt, config, layout, DType::kF32, source_of(values, &calls));
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(calls, layout.num_groups());  // one read per group, cached across its tensors

  auto config_json = read_json_file(ckpt + "/config.json");
  ASSERT_TRUE(config_json.is_ok());
  EXPECT_EQ((*config_json)["torch_dtype"], "float32");
  auto file = SafetensorsReader::open(ckpt + "/model.safetensors");
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->entries().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(file->entries().back().name, "lm_head.weight");

  auto reader = HfCheckpointReader::open(ckpt);
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  EXPECT_EQ(reader->config().to_json(), config.to_json());
  const Status v = reader->validate(layout);
  EXPECT_TRUE(v.is_ok()) << v.to_string();
  expect_groups_equal(*reader, layout, values);
}

TEST(HfCheckpoint, Bf16RoundTripEqualsRoundedValues) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 7);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), config, layout, DType::kBF16, source_of(values)).is_ok());

  auto config_json = read_json_file(dir.file("config.json"));
  ASSERT_TRUE(config_json.is_ok());
  EXPECT_EQ((*config_json)["torch_dtype"], "bfloat16");
  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  EXPECT_TRUE(reader->validate(layout).is_ok());
  auto rounded = values;
  for (auto& g : rounded)
    for (auto& x : g) x = bf16_to_f32(f32_to_bf16(x));
  expect_groups_equal(*reader, layout, rounded);
}

// Any element range of a group reads what the whole group holds there (bf16 on disk, converted),
// across tensor boundaries and padding.
TEST(HfCheckpoint, AGroupRangeReadsThatPartOfTheGroup) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 9);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), config, layout, DType::kBF16, source_of(values)).is_ok());
  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  for (const auto& g : layout.groups()) {
    std::vector<float> whole(static_cast<std::size_t>(g.num_elems));
    ASSERT_TRUE(reader->read_group(g, whole.data()).is_ok());
    const std::int64_t n = g.num_elems;
    for (const auto& [begin, count] :
         {std::pair{std::int64_t{0}, n}, std::pair{n / 3, n / 2}, std::pair{n - 7, std::int64_t{7}},
          std::pair{std::int64_t{5}, std::int64_t{1}}}) {
      std::vector<float> part(static_cast<std::size_t>(count), -1.0f);
      ASSERT_TRUE(reader->read_group_range(g, begin, count, part.data()).is_ok());
      for (std::int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(part[static_cast<std::size_t>(i)], whole[static_cast<std::size_t>(begin + i)])
            << g.name << " [" << begin << ", +" << count << ") at " << i;
      }
    }
  }
}

TEST(HfCheckpoint, F16WritesTorchDtype) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 8);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), config, layout, DType::kF16, source_of(values)).is_ok());
  auto config_json = read_json_file(dir.file("config.json"));
  ASSERT_TRUE(config_json.is_ok());
  EXPECT_EQ((*config_json)["torch_dtype"], "float16");
  auto file = SafetensorsReader::open(dir.file("model.safetensors"));
  ASSERT_TRUE(file.is_ok());
  for (const auto& e : file->entries()) EXPECT_EQ(e.dtype, DType::kF16) << e.name;
  EXPECT_EQ(write_hf_checkpoint(dir.path(), config, layout, DType::kU16, source_of(values)).code(),
            StatusCode::kInvalidArgument);
}

TEST(HfCheckpoint, FailingSourceLeavesExistingCheckpointUntouched) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 1);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), config, layout, DType::kF32, source_of(values)).is_ok());
  auto before = read_file(dir.file("model.safetensors"));
  ASSERT_TRUE(before.is_ok());

  const auto other = make_values(config, layout, 2);
  const Status s = write_hf_checkpoint(
      dir.path(), config, layout, DType::kF32, [&](const ParamGroup& g, float* dst) {
        if (g.name == "layers.1") return io_error("swap read failed");
        std::memcpy(dst, other[g.id].data(), other[g.id].size() * 4);
        return Status::ok();
      });
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  expect_contains(s, "swap read failed");
  expect_contains(s, "layers.1");
  auto after = read_file(dir.file("model.safetensors"));
  ASSERT_TRUE(after.is_ok());
  EXPECT_EQ(*after, *before);
}

TEST(HfCheckpoint, TiedEmbeddingsTolerateRedundantHeadAndRotaryBuffers) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config(/*tied=*/true);
  const ParamLayout layout = ParamLayout::build(config);
  ASSERT_FALSE(layout.find("lm_head.weight").has_value());
  const auto values = make_values(config, layout, 3);
  auto tensors = layout_tensors(layout, values);
  tensors.push_back({"lm_head.weight", {32, 16}, tensors[0].values});
  tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {2}, {1.0f, 0.5f}});
  write_config(dir.path(), config);
  write_tensors(dir.file("model.safetensors"), tensors);

  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  const Status v = reader->validate(layout);
  EXPECT_TRUE(v.is_ok()) << v.to_string();
  expect_groups_equal(*reader, layout, values);

  // Anything else that the layout does not know is still an error.
  tensors.push_back({"model.extra.weight", {2}, {1.0f, 2.0f}});
  write_tensors(dir.file("model.safetensors"), tensors);
  auto again = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(again.is_ok());
  const Status bad = again->validate(layout);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  expect_contains(bad,
                  "unexpected tensor 'model.extra.weight' in " + dir.file("model.safetensors"));
}

TEST(HfCheckpoint, ShardedCheckpointWithIndex) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto values = make_values(config, layout, 9);
  const auto tensors = layout_tensors(layout, values);
  const std::size_t half = tensors.size() / 2;
  const std::vector<Tensor> first(tensors.begin(), tensors.begin() + half);
  const std::vector<Tensor> second(tensors.begin() + half, tensors.end());
  write_tensors(dir.file("model-00001-of-00002.safetensors"), first);
  write_tensors(dir.file("model-00002-of-00002.safetensors"), second);
  Json weight_map = Json::object();
  for (const auto& t : first) weight_map[t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : second) weight_map[t.name] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(
      write_json_file(dir.file("model.safetensors.index.json"),
                      Json{{"metadata", {{"total_size", 1234}}}, {"weight_map", weight_map}})
          .is_ok());
  write_config(dir.path(), config);

  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  const Status v = reader->validate(layout);
  EXPECT_TRUE(v.is_ok()) << v.to_string();
  expect_groups_equal(*reader, layout, values);

  // An index pointing at a shard that lacks the tensor is corrupt.
  weight_map[first[0].name] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(
      write_json_file(dir.file("model.safetensors.index.json"), Json{{"weight_map", weight_map}})
          .is_ok());
  auto wrong = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kDataLoss);
  expect_contains(wrong.status(),
                  "'" + first[0].name + "' is in shard 'model-00002-of-00002.safetensors'");
}

TEST(HfCheckpoint, MissingShardNamesIndexAndShard) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  const auto tensors = layout_tensors(layout, make_values(config, layout, 5));
  write_tensors(dir.file("model-00001-of-00002.safetensors"), tensors);
  Json weight_map = Json::object();
  for (const auto& t : tensors) weight_map[t.name] = "model-00001-of-00002.safetensors";
  weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(
      write_json_file(dir.file("model.safetensors.index.json"), Json{{"weight_map", weight_map}})
          .is_ok());
  write_config(dir.path(), config);

  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(reader.is_ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  expect_contains(reader.status(), dir.file("model.safetensors.index.json"));
  expect_contains(reader.status(), "model-00002-of-00002.safetensors");

  ASSERT_TRUE(
      write_json_file(dir.file("model.safetensors.index.json"), Json{{"weights", 1}}).is_ok());
  auto bad_index = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(bad_index.is_ok());
  expect_contains(bad_index.status(), "weight_map");
}

TEST(HfCheckpoint, ValidateReportsEveryProblemAtOnce) {
  TempDir dir;
  const LlamaConfig config = checkpoint_config();
  const ParamLayout layout = ParamLayout::build(config);
  auto tensors = layout_tensors(layout, make_values(config, layout, 6));
  std::vector<Tensor> kept;
  for (auto& t : tensors) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") continue;  // missing
    if (t.name == "model.layers.0.self_attn.k_proj.weight") {     // wrong shape
      t.shape = {16, 16};
      t.values.resize(256);
    }
    if (t.name == "model.norm.weight") t.dtype = DType::kU16;  // not a float type
    kept.push_back(t);
  }
  write_config(dir.path(), config);
  write_tensors(dir.file("model.safetensors"), kept);

  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  const Status s = reader->validate(layout);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  expect_contains(s, "checkpoint " + dir.path());
  expect_contains(s,
                  "missing tensor 'model.layers.1.mlp.up_proj.weight' (expected shape [24, 16])");
  expect_contains(s, "tensor 'model.layers.0.self_attn.k_proj.weight' in " +
                         dir.file("model.safetensors") + " has shape [16, 16], expected [8, 16]");
  expect_contains(s, "tensor 'model.norm.weight' in " + dir.file("model.safetensors") +
                         " has dtype U16, expected F32, BF16 or F16");
  expect_contains(s, "3 problems");

  std::vector<float> buf(static_cast<std::size_t>(layout.group(2).num_elems));
  const Status missing = reader->read_group(layout.group(2), buf.data());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  expect_contains(missing, "model.layers.1.mlp.up_proj.weight");
  std::vector<float> buf1(static_cast<std::size_t>(layout.group(1).num_elems));
  const Status wrong_shape = reader->read_group(layout.group(1), buf1.data());
  EXPECT_EQ(wrong_shape.code(), StatusCode::kInvalidArgument);
  expect_contains(wrong_shape, "k_proj");
}

TEST(HfCheckpoint, MissingFilesAreNamed) {
  TempDir dir;
  auto no_dir = HfCheckpointReader::open(dir.file("absent"));
  ASSERT_FALSE(no_dir.is_ok());
  EXPECT_EQ(no_dir.status().code(), StatusCode::kNotFound);
  expect_contains(no_dir.status(), dir.file("absent"));

  auto no_config = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(no_config.is_ok());
  expect_contains(no_config.status(), dir.file("config.json"));

  write_config(dir.path(), checkpoint_config());
  auto no_weights = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(no_weights.is_ok());
  EXPECT_EQ(no_weights.status().code(), StatusCode::kNotFound);
  expect_contains(no_weights.status(), dir.path());
  expect_contains(no_weights.status(), "model.safetensors,");
  expect_contains(no_weights.status(), "model.safetensors.index.json");

  ASSERT_TRUE(write_file_atomic(dir.file("config.json"), std::string("{\"vocab_size\": ")).is_ok());
  auto bad_json = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(bad_json.is_ok());
  expect_contains(bad_json.status(), dir.file("config.json"));

  Json bad_config = checkpoint_config().to_json();
  bad_config["hidden_act"] = "gelu";
  ASSERT_TRUE(write_json_file(dir.file("config.json"), bad_config).is_ok());
  auto unsupported = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(unsupported.is_ok());
  expect_contains(unsupported.status(), dir.file("config.json"));
  expect_contains(unsupported.status(), "hidden_act");
}

TEST(HfCheckpoint, CorruptWeightFileIsReportedWithItsPath) {
  TempDir dir;
  write_config(dir.path(), checkpoint_config());
  ASSERT_TRUE(write_file_atomic(dir.file("model.safetensors"), std::string("garbage")).is_ok());
  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_FALSE(reader.is_ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss);
  expect_contains(reader.status(), dir.file("model.safetensors"));
}

}  // namespace
}  // namespace strata::model

namespace strata::model {
namespace {

// Tensor parallelism: each of T ranks holds slices of the whole tensors, Megatron's way. A
// slice drawn from the seed, or read from a checkpoint, is the whole tensor's part to the bit;
// the ranks' slices cover every element of a split tensor once (a kv head held whole on T / kv
// ranks, each of its elements that many times), and whole tensors are whole on every rank.
TEST(TensorParallelLayout, SlicesAreTheWholeTensorsPartsFromTheSeedAndTheCheckpoint) {
  TempDir dir;
  LlamaConfig config = checkpoint_config();
  config.qkv_bias = config.o_bias = config.mlp_bias = config.qk_norm = true;
  const ParamLayout whole = ParamLayout::build(config);
  const auto values = make_values(config, whole, 5);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), config, whole, DType::kF32, source_of(values)).is_ok());
  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  for (int size : {2, 4}) {
    SCOPED_TRACE("T = " + std::to_string(size));
    std::map<std::string, std::vector<int>> covered;  // times each whole element is held
    std::map<std::string, std::vector<int>> counted;  // and counted in the gradient norm
    for (int rank = 0; rank < size; ++rank) {
      const ParamLayout part = ParamLayout::build(config, std::nullopt, false, {size, rank});
      ASSERT_TRUE(reader->validate(part).is_ok()) << reader->validate(part).to_string();
      ASSERT_EQ(part.num_groups(), whole.num_groups());
      for (const auto& g : part.groups()) {
        std::vector<float> seeded(static_cast<std::size_t>(g.num_elems));
        std::vector<float> read(seeded.size());
        init_group(config, g, 5, seeded.data());
        ASSERT_TRUE(reader->read_group(g, read.data()).is_ok());
        std::vector<float> want_seeded(static_cast<std::size_t>(whole.group(g.id).num_elems));
        init_group(config, whole.group(g.id), 5, want_seeded.data());
        for (const auto& t : g.tensors) {
          const auto w = whole.find(t.name);
          ASSERT_TRUE(w.has_value()) << t.name;
          EXPECT_EQ(t.full_shape(), w->tensor->shape) << t.name;
          auto& times = covered[t.name];
          times.resize(static_cast<std::size_t>(t.full_elems()));
          auto& norm = counted[t.name];
          norm.resize(times.size());
          // A rank's duplicates come last in its groups; every element counts on one rank.
          const bool duplicate = t.offset_elems >= g.duplicate_begin;
          EXPECT_EQ(duplicate, rank % (size / t.slice.parts) != 0) << t.name << " rank " << rank;
          t.for_each_run(
              0, t.num_elems, [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
                for (std::int64_t i = 0; i < n; ++i) {
                  const auto local = static_cast<std::size_t>(t.offset_elems + first + i);
                  const auto at =
                      static_cast<std::size_t>(w->tensor->offset_elems + full_first + i);
                  ASSERT_EQ(seeded[local], want_seeded[at]) << t.name << "[" << first + i << "]";
                  ASSERT_EQ(read[local], values[static_cast<std::size_t>(g.id)][at])
                      << t.name << "[" << first + i << "]";
                  ++times[static_cast<std::size_t>(full_first + i)];
                  norm[static_cast<std::size_t>(full_first + i)] += duplicate ? 0 : 1;
                }
              });
        }
      }
    }
    for (const auto& [name, times] : covered) {
      const bool kv =
          name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos;
      const bool whole_on_each = name.find("norm") != std::string::npos ||
                                 name.find("o_proj.bias") != std::string::npos ||
                                 name.find("down_proj.bias") != std::string::npos;
      const int want = whole_on_each ? size : kv ? size / 2 : 1;  // 2 kv heads
      for (std::size_t i = 0; i < times.size(); ++i) {
        ASSERT_EQ(times[i], want) << name << "[" << i << "]";
        ASSERT_EQ(counted[name][i], 1) << name << "[" << i << "]";
      }
    }
  }
}

TEST(TensorParallelLayout, ASplitTheModelDoesNotAllowIsNamed) {
  LlamaConfig config = checkpoint_config();
  config.vocab_size = 30;
  config.num_attention_heads = 12;
  config.num_key_value_heads = 3;
  config.intermediate_size = 20;
  const auto problems = tensor_parallel_problems(config, 8);
  ASSERT_EQ(problems.size(), 4u);
  EXPECT_EQ(problems[0], "tensor_parallel_size 8 must divide num_attention_heads (12)");
  EXPECT_EQ(problems[1],
            "tensor_parallel_size 8 must divide num_key_value_heads (3) or be a multiple of it");
  EXPECT_EQ(problems[2], "tensor_parallel_size 8 must divide intermediate_size (20)");
  EXPECT_EQ(problems[3], "tensor_parallel_size 8 must divide vocab_size (30)");
  const auto three = tensor_parallel_problems(config, 3);
  ASSERT_EQ(three.size(), 1u);
  EXPECT_EQ(three[0], "tensor_parallel_size 3 must divide intermediate_size (20)");
  EXPECT_TRUE(tensor_parallel_problems(config, 1).empty());
}

}  // namespace
}  // namespace strata::model
