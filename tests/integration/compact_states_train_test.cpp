// Compact optimizer states in whole training runs: bf16 and 8-bit moments, bf16 master weights
// (Kahan or stochastic rounding), their bytes in every tier and their bits across resume.

#include "tests/integration/train_runs.h"

namespace strata::train {
namespace {

// `bytes` as NVMe homes hold them: whole O_DIRECT blocks.
std::uint64_t blocks(std::uint64_t bytes) {
  return (bytes + io::kIoAlignBytes - 1) / io::kIoAlignBytes * io::kIoAlignBytes;
}

// `saving` (4 steps) saved at step 2 under `ckpt` and resumed from there: its steps 3 and 4 are
// `reference`'s, bit for bit.
void expect_resume_continues(Json saving, const std::string& ckpt,
                             const std::vector<double>& reference) {
  saving["save_dir"] = ckpt;
  saving["save_every"] = 2;
  ASSERT_EQ(run(saving), reference);
  auto t = make_trainer(saving, ckpt + "/step-00000002");
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  EXPECT_EQ(losses_of(**t), std::vector<double>(reference.begin() + 2, reference.end()));
}

// `j` with the optimizer on NVMe, serial: its last step read and wrote exactly the sum over the
// trainable groups of `bytes(n)` for a group of n elements. Returns the trainer's describe().
std::string expect_streamed_bytes(Json j,
                                  const std::function<std::uint64_t(std::uint64_t)>& bytes) {
  j["offload_optimizer"] = "nvme";
  j["optimizer_overlap"] = "none";
  auto t = make_trainer(j);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return "";
  EXPECT_TRUE((*t)->run().is_ok());
  auto config = parse_train_config(j, "test config");
  EXPECT_TRUE(config.is_ok());
  std::uint64_t want = 0;
  const model::ParamLayout layout = model::ParamLayout::build(config->model);
  for (const auto& g : layout.groups()) {
    want += bytes(static_cast<std::uint64_t>(g.num_elems));
  }
  EXPECT_EQ((*t)->history().back().nvme_read_bytes, want);
  EXPECT_EQ((*t)->history().back().nvme_write_bytes, want);
  return (*t)->describe();
}

// `j` is refused when read, its message holding each of `words`.
void expect_refused(const Json& j, std::initializer_list<const char*> words) {
  auto refused = parse_train_config(j, "test config");
  ASSERT_FALSE(refused.is_ok());
  for (const char* w : words) {
    EXPECT_NE(refused.status().message().find(w), std::string::npos) << refused.status().message();
  }
}

// optimizer.state_dtype "bf16": Adam's moments in bf16 in every tier (half the moment bytes in
// the plan, and across the drive), the same bits whether the optimizer lives on the device, the
// host or NVMe and under every schedule, a resume that continues the run to the bit (the
// checkpoint holds them widened to fp32, exactly), losses near fp32 moments', and a clear refusal
// of a dtype there is no path for.
TEST(CompactStates, Bf16MomentsKeepTheirBitsInEveryTierAndAcrossResume) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["optimizer"]["state_dtype"] = "bf16";
  base["save_dir"] = "";
  const std::vector<double> reference = run(base);
  ASSERT_EQ(reference.size(), 4u);
  for (const char* opt : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "forward", "backward"}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json j = base;
      j["offload_optimizer"] = opt;
      j["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(j), reference);
    }
  }
  Json fp32 = base;
  fp32["optimizer"]["state_dtype"] = "fp32";
  const std::vector<double> wide = run(fp32);
  ASSERT_EQ(wide.size(), reference.size());
  EXPECT_NE(wide, reference) << "bf16 moments changed nothing: are they bf16?";
  for (std::size_t i = 0; i < wide.size(); ++i) {
    EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
  }

  // The plan's moments: each group's two, n x 2 bytes (a whole number of 4 KiB blocks apart,
  // for their NVMe homes), in the optimizer's tier.
  const auto moments = [](const Json& j) {
    auto c = parse_train_config(j, "test config");
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    auto e = estimate(*c, 1);
    EXPECT_TRUE(e.is_ok()) << e.status().message();
    return e->plan.kind_bytes(Tier::kHost, zero::TensorKind::kMoments);
  };
  Json host = base, host32 = fp32;
  host["offload_optimizer"] = host32["offload_optimizer"] = "cpu";
  auto config = parse_train_config(host, "test config");
  ASSERT_TRUE(config.is_ok());
  std::uint64_t want_bf16 = 0, want_fp32 = 0;
  const model::ParamLayout layout = model::ParamLayout::build(config->model);
  for (const auto& g : layout.groups()) {
    const auto n = static_cast<std::uint64_t>(g.num_elems);
    // Two moments, each twice: the state and the shadow copy an overlapped step writes.
    want_bf16 += 4 * blocks(2 * n);
    want_fp32 += 4 * blocks(4 * n);
  }
  EXPECT_EQ(moments(host), want_bf16);
  EXPECT_EQ(moments(host32), want_fp32);

  // A step streams each trainable group's master weights and moments from NVMe and back once:
  // the metrics' NVMe bytes are exactly those (4 + 2 x 2 bytes a parameter, each array a whole
  // number of 4 KiB blocks), half the moments' share of fp32's (4 + 2 x 4).
  for (const auto& [state, moment_size] : {std::pair{"bf16", 2}, std::pair{"fp32", 4}}) {
    SCOPED_TRACE(std::string("state_dtype ") + state);
    Json j = base;
    j["optimizer"]["state_dtype"] = state;
    const std::uint64_t m = moment_size;
    expect_streamed_bytes(j, [m](std::uint64_t n) { return blocks(4 * n) + 2 * blocks(m * n); });
  }

  Json saving = base;
  saving["offload_optimizer"] = "nvme";
  expect_resume_continues(saving, dir.file("bf16-ckpt"), reference);

  Json bad = base;
  bad["optimizer"]["state_dtype"] = "int4";
  expect_refused(bad, {"'optimizer.state_dtype'", "fp32"});
}

// optimizer.master_dtype "bf16" (stochastic rounding) with bf16 moments: 6 bytes of optimizer
// state a parameter, the same bits in every tier and schedule and across a resume (the rounding's
// random bits come from the seed, the step, the group and each element's place in it), losses
// near fp32 state's; the settings that do not apply are refused naming the key.
TEST(CompactStates, Bf16MasterWeightsRoundAlikeEverywhereAndMoveSixBytes) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["optimizer"]["state_dtype"] = "bf16";
  base["optimizer"]["master_dtype"] = "bf16";
  base["save_dir"] = "";
  const std::vector<double> reference = run(base);
  ASSERT_EQ(reference.size(), 4u);
  for (const char* opt : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "backward"}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json j = base;
      j["offload_optimizer"] = opt;
      j["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(j), reference);
    }
  }
  Json fp32 = base;
  fp32["optimizer"]["state_dtype"] = "fp32";
  fp32["optimizer"]["master_dtype"] = "fp32";
  const std::vector<double> wide = run(fp32);
  ASSERT_EQ(wide.size(), reference.size());
  EXPECT_NE(wide, reference);
  for (std::size_t i = 0; i < wide.size(); ++i) {
    EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
  }

  // A step's NVMe traffic: master (2 bytes) and two moments (2 each) a parameter.
  expect_streamed_bytes(base, [](std::uint64_t n) { return 3 * blocks(2 * n); });

  Json saving = base;
  saving["offload_optimizer"] = "cpu";
  expect_resume_continues(saving, dir.file("master-ckpt"), reference);

  Json unknown = base;
  unknown["optimizer"]["master_rounding"] = "round";
  expect_refused(unknown, {"'optimizer.master_rounding'", "kahan"});
  Json stray = fp32;
  stray["optimizer"]["master_rounding"] = "stochastic";
  expect_refused(stray, {"applies to master_dtype \"bf16\" only"});
}

// optimizer.state_dtype "int8" (block-wise 8-bit moments) and master_rounding "kahan" (bf16
// master weights with a bf16 compensation): each alone and together, the same bits in every tier
// and schedule; together, a step moves each plane of each array once each way (2 + 2 bytes of
// master weights and 1 + 4/64 of each moment a parameter), the plan says 6.12 bytes a
// parameter, a resume continues to the bit (checkpoints hold fp32 values that split and quantize
// back to the same bytes), and losses stay near fp32 state's.
// A checkpoint keeps fp32 moments whatever the run kept; a resume that keeps them otherwise says
// how it converts them: another state_dtype, or 8-bit blocks of 256 (format_version 2 and before)
// quantized anew in blocks of 64.
TEST(CompactStates, AResumeSaysHowItConvertsTheMoments) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["optimizer"]["state_dtype"] = "int8";
  const std::string name = save_after_two_steps(dir, j);
  ASSERT_FALSE(name.empty());
  const auto resume_log = [&](const std::string& state_dtype) {
    Json resumed = j;
    resumed["save_dir"] = "";  // the checkpoint stays the latest
    resumed["optimizer"]["state_dtype"] = state_dtype;
    ::testing::internal::CaptureStderr();
    auto t = make_trainer(resumed, dir.file("ckpt"));
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    return log;
  };
  const std::string requantized =
      "the checkpoint's 8-bit Adam moments were kept in blocks of 256; they continue in blocks "
      "of " +
      std::to_string(device::kAdam8BlockElems);
  EXPECT_EQ(resume_log("int8").find(requantized), std::string::npos);
  mark_format_version(dir, name, 2);
  EXPECT_NE(resume_log("int8").find(requantized), std::string::npos);
  const std::string widened = resume_log("fp32");
  EXPECT_NE(widened.find("the checkpoint's Adam moments were kept in int8; they continue in fp32 "
                         "(widened exactly)"),
            std::string::npos)
      << widened;
  EXPECT_EQ(widened.find(requantized), std::string::npos);
}

TEST(CompactStates, Int8MomentsAndKahanMastersKeepTheirBitsEverywhere) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["save_dir"] = "";
  Json fp32 = base;
  const std::vector<double> wide = run(fp32);
  const std::pair<const char*, const char*> settings[] = {
      {"int8", "fp32"}, {"fp32", "kahan"}, {"int8", "kahan"}};
  std::vector<double> reference;
  for (const auto& [state, master] : settings) {
    SCOPED_TRACE(std::string("moments ") + state + ", master " + master);
    Json j = base;
    j["optimizer"]["state_dtype"] = state;
    if (std::string(master) == "kahan") {
      j["optimizer"]["master_dtype"] = "bf16";
      j["optimizer"]["master_rounding"] = "kahan";
    }
    reference = run(j);
    ASSERT_EQ(reference.size(), wide.size());
    EXPECT_NE(reference, wide) << "the compact state changed nothing";
    for (std::size_t i = 0; i < wide.size(); ++i) {
      EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
    }
    for (const auto& [opt, overlap] :
         {std::pair{"cpu", "backward"}, std::pair{"nvme", "none"}, std::pair{"nvme", "backward"}}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json o = j;
      o["offload_optimizer"] = opt;
      o["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(o), reference);
    }
    base = j;  // the last setting, int8 + kahan, for what follows
  }

  // Each plane of each array once each way: the master weights and their compensation (2 + 2
  // bytes), each moment's codes and its block scales (1 + 4/64).
  const std::string plan = expect_streamed_bytes(base, [](std::uint64_t n) {
    const auto block = static_cast<std::uint64_t>(device::kAdam8BlockElems);
    return 2 * blocks(2 * n) + 2 * (blocks(n) + blocks((n + block - 1) / block * 4));
  });
  EXPECT_NE(plan.find("optimizer state: 6.12 bytes a trained parameter: master weights bf16 + "
                      "Kahan compensation bf16 4 + moments int8 + block scales 2 x 1.06"),
            std::string::npos)
      << plan;

  Json saving = base;
  saving["offload_optimizer"] = "nvme";
  expect_resume_continues(saving, dir.file("int8-ckpt"), reference);

  Json bad = base;
  bad["optimizer"]["state_dtype"] = "int4";
  expect_refused(bad, {"int8"});
}

}  // namespace
}  // namespace strata::train
