// safetensors reader/writer: round trips, reference bytes, every malformed header, atomic writes.
#include "strata/model/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "strata/core/rng.h"
#include "tests/testing/temp_dir.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file whose header is `header` verbatim followed by `data_bytes` bytes of data.
void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes) {
  write_bytes(path, le64(header.size()) + header + std::string(data_bytes, '\x01'));
}

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng.next_u64() & 0xff);
  return v;
}

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Opens `path` expecting a data_loss error that names the file and contains `needle`.
void expect_data_loss(const std::string& path, const std::string& needle) {
  auto r = SafetensorsReader::open(path);
  ASSERT_FALSE(r.is_ok()) << "expected an error mentioning: " << needle;
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(needle), std::string::npos)
      << "message: " << r.status().message() << "\nexpected to contain: " << needle;
}

TEST(Safetensors, RoundTripSeveralDtypesAndShapes) {
  TempDir dir;
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
  };
  const std::vector<Spec> specs = {
      {"w.f32", DType::kF32, {3, 5}},    {"w.bf16", DType::kBF16, {7}},
      {"w.f16", DType::kF16, {2, 1, 3}}, {"ids.u16", DType::kU16, {4}},
      {"ids.i64", DType::kI64, {2, 2}},  {"scalar", DType::kF32, {}},
      {"empty.u8", DType::kU8, {0, 4}},  {"mask.u8", DType::kU8, {5}},
      {"ids.i32", DType::kI32, {3}},     {"ids.u32", DType::kU32, {1, 1}},
  };
  std::vector<std::vector<std::byte>> payloads;
  SafetensorsWriter writer;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    writer.add(specs[i].name, specs[i].dtype, specs[i].shape);
    payloads.push_back(random_bytes(numel(specs[i].shape) * dtype_size(specs[i].dtype), 100 + i));
  }
  writer.set_metadata({{"format", "pt"}, {"note", "round trip"}});
  std::size_t calls = 0;
  const std::string path = dir.file("model.safetensors");
  ASSERT_TRUE(writer
                  .write(path,
                         [&](const SafetensorsEntry& e, void* dst) {
                           EXPECT_EQ(e.name, specs[calls].name);  // declaration order
                           if (!payloads[calls].empty())
                             std::memcpy(dst, payloads[calls].data(), payloads[calls].size());
                           ++calls;
                           return Status::ok();
                         })
                  .is_ok());
  EXPECT_EQ(calls, specs.size());
  auto raw = read_file(path);
  ASSERT_TRUE(raw.is_ok());
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, raw->data(), 8);
  EXPECT_EQ(header_bytes % 8, 0u);  // the data section starts 8-byte aligned
  EXPECT_EQ(raw->back(), static_cast<char>(payloads.back().back()));

  auto reader = SafetensorsReader::open(path);
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  EXPECT_EQ(reader->metadata().at("format"), "pt");
  EXPECT_EQ(reader->metadata().at("note"), "round trip");
  ASSERT_EQ(reader->entries().size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    // Entries come back in file order, which is declaration order.
    EXPECT_EQ(reader->entries()[i].name, specs[i].name);
    const SafetensorsEntry* e = reader->find(specs[i].name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, specs[i].dtype);
    EXPECT_EQ(e->shape, specs[i].shape);
    std::vector<std::byte> back(payloads[i].size() + 1);
    ASSERT_TRUE(reader->read(specs[i].name, specs[i].shape, back.data(), specs[i].dtype).is_ok());
    back.pop_back();
    EXPECT_EQ(back, payloads[i]) << specs[i].name;
  }
  EXPECT_EQ(reader->find("nope"), nullptr);
}

TEST(Safetensors, ConvertsBetweenFloatTypesInChunks) {
  TempDir dir;
  // More than one 4 MiB conversion chunk, and not a multiple of it.
  const std::size_t n = (3u << 20) / 2 + 17;
  const std::vector<float> values = random_floats(n, 7);
  std::vector<bf16> as_bf16(n);
  std::vector<f16> as_f16(n);
  for (std::size_t i = 0; i < n; ++i) {
    as_bf16[i] = f32_to_bf16(values[i]);
    as_f16[i] = f32_to_f16(values[i]);
  }
  SafetensorsWriter writer;
  writer.add("f32", DType::kF32, {static_cast<std::int64_t>(n)});
  writer.add("bf16", DType::kBF16, {static_cast<std::int64_t>(n)});
  writer.add("f16", DType::kF16, {static_cast<std::int64_t>(n)});
  const std::string path = dir.file("conv.safetensors");
  ASSERT_TRUE(writer
                  .write(path,
                         [&](const SafetensorsEntry& e, void* dst) {
                           const void* src = e.name == "f32" ? values.data()
                                             : e.name == "bf16"
                                                 ? static_cast<const void*>(as_bf16.data())
                                                 : as_f16.data();
                           std::memcpy(dst, src, e.end - e.begin);
                           return Status::ok();
                         })
                  .is_ok());
  auto reader = SafetensorsReader::open(path);
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(n)};

  std::vector<bf16> got_bf16(n);
  ASSERT_TRUE(reader->read("f32", shape, got_bf16.data(), DType::kBF16).is_ok());
  std::vector<float> got_f32(n);
  ASSERT_TRUE(reader->read("bf16", shape, got_f32.data(), DType::kF32).is_ok());
  std::vector<float> got_from_f16(n);
  ASSERT_TRUE(reader->read("f16", shape, got_from_f16.data(), DType::kF32).is_ok());
  std::vector<f16> got_f16(n);
  ASSERT_TRUE(reader->read("f32", shape, got_f16.data(), DType::kF16).is_ok());
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got_bf16[i].bits, as_bf16[i].bits) << i;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got_f32[i]),
              std::bit_cast<std::uint32_t>(bf16_to_f32(as_bf16[i])))
        << i;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got_from_f16[i]),
              std::bit_cast<std::uint32_t>(f16_to_f32(as_f16[i])))
        << i;
    ASSERT_EQ(got_f16[i].bits, as_f16[i].bits) << i;
  }
}

// The bytes Python's safetensors.torch.save_file writes for
//   {"a": torch.tensor([[1., 2.], [3., 4.]]), "b": torch.tensor([1., -2., .5],
//   dtype=torch.bfloat16)}
// with metadata={"format": "pt"}: compact JSON with __metadata__ first, tensors sorted by dtype
// alignment then name (F32 before BF16), fields dtype/shape/data_offsets, header padded with spaces
// to a multiple of 8.
std::string reference_file_bytes() {
  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const unsigned char data[] = {
      0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40,  // 1.0f, 2.0f
      0x00, 0x00, 0x40, 0x40, 0x00, 0x00, 0x80, 0x40,  // 3.0f, 4.0f
      0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f,              // bf16 1.0, -2.0, 0.5
  };
  return le64(header.size()) + header +
         std::string(reinterpret_cast<const char*>(data), sizeof(data));
}

TEST(Safetensors, ReadsReferenceBytes) {
  TempDir dir;
  const std::string path = dir.file("ref.safetensors");
  write_bytes(path, reference_file_bytes());
  auto reader = SafetensorsReader::open(path);
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
  EXPECT_EQ(reader->metadata().at("format"), "pt");
  ASSERT_EQ(reader->entries().size(), 2u);
  float a[4];
  ASSERT_TRUE(reader->read("a", {2, 2}, a, DType::kF32).is_ok());
  EXPECT_EQ(a[0], 1.0f);
  EXPECT_EQ(a[1], 2.0f);
  EXPECT_EQ(a[2], 3.0f);
  EXPECT_EQ(a[3], 4.0f);
  float b[3];
  ASSERT_TRUE(reader->read("b", {3}, b, DType::kF32).is_ok());
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -2.0f);
  EXPECT_EQ(b[2], 0.5f);
}

TEST(Safetensors, WriterProducesReferenceBytes) {
  TempDir dir;
  SafetensorsWriter writer;
  writer.add("a", DType::kF32, {2, 2});
  writer.add("b", DType::kBF16, {3});
  writer.set_metadata({{"format", "pt"}});
  const std::string path = dir.file("mine.safetensors");
  ASSERT_TRUE(writer
                  .write(path,
                         [](const SafetensorsEntry& e, void* dst) {
                           if (e.name == "a") {
                             const float a[] = {1, 2, 3, 4};
                             std::memcpy(dst, a, sizeof(a));
                           } else {
                             const bf16 b[] = {f32_to_bf16(1), f32_to_bf16(-2), f32_to_bf16(0.5)};
                             std::memcpy(dst, b, sizeof(b));
                           }
                           return Status::ok();
                         })
                  .is_ok());
  auto bytes = read_file(path);
  ASSERT_TRUE(bytes.is_ok());
  EXPECT_EQ(*bytes, reference_file_bytes());
}

TEST(Safetensors, ReadChecksShapeAndDtype) {
  TempDir dir;
  const std::string path = dir.file("ref.safetensors");
  write_bytes(path, reference_file_bytes());
  auto reader = SafetensorsReader::open(path);
  ASSERT_TRUE(reader.is_ok());
  float buf[8];
  Status s = reader->read("a", {4}, buf, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'a'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("shape [2, 2], expected [4]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();

  s = reader->read("missing", {1}, buf, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("'missing'"), std::string::npos) << s.message();

  s = reader->read("a", {2, 2}, buf, DType::kU32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cannot be read as u32"), std::string::npos) << s.message();
}

TEST(Safetensors, OpenMissingFileIsNotFound) {
  TempDir dir;
  auto r = SafetensorsReader::open(dir.file("absent.safetensors"));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("absent.safetensors"), std::string::npos);
}

TEST(Safetensors, RejectsTruncatedAndAbsurdLengths) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  write_bytes(p, std::string("\x05\x00\x00", 3));
  expect_data_loss(p, "file is 3 bytes; a safetensors file starts with an 8-byte header length");
  write_bytes(p, le64(1000) + "{}");
  expect_data_loss(p, "header length 1000 is larger than the 2 bytes after the length field");
  write_bytes(p, le64(std::uint64_t{1} << 40) + "{}");
  expect_data_loss(p, "exceeds the 100 MB limit");
}

TEST(Safetensors, RejectsNonJsonAndNonObjectHeaders) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  write_raw(p, "{\"a\": ", 0);
  expect_data_loss(p, "header is not valid JSON");
  write_raw(p, "{\"\xff\":1}", 0);  // not UTF-8
  expect_data_loss(p, "header is not valid JSON");
  write_raw(p, "[1, 2]  ", 0);
  expect_data_loss(p, "header must be a JSON object");
  write_raw(p, R"({"__metadata__":{"format":3}})", 0);
  expect_data_loss(p, "__metadata__ key 'format' must be a string, found 3");
  write_raw(p,
            R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            8);
  expect_data_loss(p, "key 't' appears more than once");
}

TEST(Safetensors, RejectsBadTensorEntries) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return R"({"w":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets +
           "}}";
  };
  write_raw(p, entry(R"("Q4")", "[2]", "[0,8]"), 8);
  expect_data_loss(p, "tensor 'w': unknown dtype \"Q4\"; expected one of F32");
  write_raw(p, entry(R"("f32")", "[2]", "[0,8]"), 8);  // Strata's spelling is not safetensors'
  expect_data_loss(p, "tensor 'w': unknown dtype \"f32\"");
  write_raw(p, entry(R"("F32")", R"("2")", "[0,8]"), 8);
  expect_data_loss(p, "tensor 'w': shape must be a list of non-negative integers, found \"2\"");
  write_raw(p, entry(R"("F32")", "[-2]", "[0,8]"), 8);
  expect_data_loss(p, "tensor 'w': shape must be a list of non-negative integers, found [-2]");
  write_raw(p, entry(R"("F32")", "[2.5]", "[0,8]"), 8);
  expect_data_loss(p, "shape must be a list of non-negative integers, found [2.5]");
  write_raw(p, entry(R"("F32")", "[2]", "[8]"), 8);
  expect_data_loss(
      p, "tensor 'w': data_offsets must be two non-negative integers [begin, end], found [8]");
  write_raw(p, entry(R"("F32")", "[2]", "[0,\"8\"]"), 8);
  expect_data_loss(p, "data_offsets must be two non-negative integers");
  write_raw(p, entry(R"("F32")", "[0]", "[8,4]"), 8);
  expect_data_loss(p, "tensor 'w': data_offsets [8,4] has begin > end");
  write_raw(p, entry(R"("F32")", "[2]", "[0,8]"), 4);
  expect_data_loss(p, "tensor 'w': data_offsets [0,8] ends beyond the data section of 4 bytes");
  write_raw(p, entry(R"("F32")", "[3]", "[0,8]"), 8);
  expect_data_loss(p, "tensor 'w': data_offsets [0,8] span 8 bytes, expected 12 for F32 [3]");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
  expect_data_loss(p, "tensor 'w': missing key 'data_offsets'");
  write_raw(p, R"({"w":[1,2]})", 8);
  expect_data_loss(p, "tensor 'w': expected an object");
  write_raw(p, entry(R"("F32")", "[4294967296,4294967296]", "[0,8]"), 8);
  expect_data_loss(p, "too large");
}

TEST(Safetensors, RejectsOverlappingTensors) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  write_raw(p,
            R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
            R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
            12);
  expect_data_loss(p, "tensor 'y' bytes [4, 12) overlap tensor 'x' bytes [0, 8)");
  // An empty tensor inside another's bytes occupies nothing and is fine.
  write_raw(p,
            R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
            8);
  EXPECT_TRUE(SafetensorsReader::open(p).is_ok());
}

TEST(Safetensors, ReadOfFileTruncatedAfterOpenIsDataLoss) {
  TempDir dir;
  const std::string path = dir.file("ref.safetensors");
  const std::string bytes = reference_file_bytes();
  write_bytes(path, bytes);
  auto reader = SafetensorsReader::open(path);
  ASSERT_TRUE(reader.is_ok());
  fs::resize_file(path, bytes.size() - 4);
  float b[3];
  const Status s = reader->read("b", {3}, b, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("unexpected end of file"), std::string::npos) << s.message();
}

TEST(Safetensors, FailedFillLeavesExistingFileUntouched) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  write_bytes(path, reference_file_bytes());

  SafetensorsWriter writer;
  writer.add("first", DType::kF32, {1024});
  writer.add("second", DType::kF32, {1024});
  writer.add("third", DType::kF32, {1024});
  int calls = 0;
  const Status s = writer.write(path, [&](const SafetensorsEntry& e, void* dst) {
    ++calls;
    if (e.name == "second") return io_error("source disk went away");
    std::memset(dst, 0x7f, e.end - e.begin);
    return Status::ok();
  });
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("source disk went away"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'second'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_EQ(calls, 2);  // aborted at the failure

  auto bytes = read_file(path);
  ASSERT_TRUE(bytes.is_ok());
  EXPECT_EQ(*bytes, reference_file_bytes());
  // No temporary file is left behind.
  std::vector<std::string> names;
  for (const auto& f : fs::directory_iterator(dir.path())) names.push_back(f.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
}

TEST(Safetensors, WriterRejectsDuplicateAndReservedNames) {
  TempDir dir;
  auto ok_fill = [](const SafetensorsEntry&, void*) { return Status::ok(); };
  SafetensorsWriter dup;
  dup.add("w", DType::kF32, {1});
  dup.add("w", DType::kF32, {1});
  Status s = dup.write(dir.file("dup.safetensors"), ok_fill);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.message();
  SafetensorsWriter reserved;
  reserved.add("__metadata__", DType::kF32, {1});
  EXPECT_EQ(reserved.write(dir.file("r.safetensors"), ok_fill).code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir.file("dup.safetensors")));
}

TEST(Safetensors, WriteIntoMissingDirectoryFails) {
  TempDir dir;
  SafetensorsWriter writer;
  writer.add("w", DType::kF32, {1});
  const Status s = writer.write(dir.file("no/such/dir/x.safetensors"),
                                [](const SafetensorsEntry&, void*) { return Status::ok(); });
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("no/such/dir/x.safetensors"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace strata::model
