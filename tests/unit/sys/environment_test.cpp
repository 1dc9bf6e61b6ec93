// The environment Strata reads: the knobs by name, and the launcher's world and node-local
// ranks, with an error naming any variable that is not an integer in range.
#include "strata/sys/environment.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace strata::sys {
namespace {

// A fake environment (Getenv is a plain function pointer, so a global).
std::map<std::string, std::string>& fake_env() {
  static std::map<std::string, std::string> env;
  return env;
}
const char* fake_getenv(const char* name) {
  const auto it = fake_env().find(name);
  return it == fake_env().end() ? nullptr : it->second.c_str();
}
Result<Launch> launch(std::map<std::string, std::string> env) {
  fake_env() = std::move(env);
  return read_launch(&fake_getenv);
}

TEST(EnvironmentTest, KnobsAreReadByTheirNames) {
  std::set<std::string> names;
  for (const KnobInfo& k : knobs()) {
    EXPECT_EQ(std::string(knob_name(k.knob)), k.name);
    EXPECT_TRUE(names.insert(k.name).second) << k.name;
    EXPECT_EQ(std::string(k.name).rfind("STRATA_", 0), 0u) << k.name;
  }
  fake_env() = {{"STRATA_SIMD", "avx2"}, {"STRATA_CUDA_SYNC", "1"}, {"STRATA_OP_PROFILE", "yes"}};
  EXPECT_EQ(knob(Knob::kSimd, &fake_getenv), "avx2");
  EXPECT_EQ(knob(Knob::kCpuGemm, &fake_getenv), "");
  EXPECT_TRUE(knob_on(Knob::kCudaSync, &fake_getenv));
  EXPECT_FALSE(knob_on(Knob::kOpProfile, &fake_getenv));  // only "1" turns a switch on
  fake_env().clear();
}

TEST(EnvironmentTest, ReadmeListsEveryKnob) {
  std::ifstream in(std::string(STRATA_TEST_DATA_DIR) + "/../../README.md");
  ASSERT_TRUE(in);
  std::stringstream text;
  text << in.rdbuf();
  for (const KnobInfo& k : knobs()) {
    EXPECT_NE(text.str().find("| `" + std::string(k.name) + "` |"), std::string::npos)
        << k.name << " is not in README's table of environment variables";
  }
}

TEST(EnvironmentTest, WorldRankComesFromTheLauncher) {
  auto none = launch({});
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->world_size, 1);
  EXPECT_EQ(none->rank, 0);
  EXPECT_FALSE(none->multiple_ranks());

  auto ompi = launch({{"OMPI_COMM_WORLD_RANK", "2"},
                      {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "1"}});  // Open MPI's win
  ASSERT_TRUE(ompi.is_ok());
  EXPECT_EQ(ompi->rank, 2);
  EXPECT_EQ(ompi->world_size, 4);
  EXPECT_TRUE(ompi->multiple_ranks());

  auto slurm = launch({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
  ASSERT_TRUE(slurm.is_ok());
  EXPECT_EQ(slurm->rank, 1);
  EXPECT_TRUE(slurm->multiple_ranks());

  auto bad = launch({{"PMI_RANK", "3"}, {"PMI_SIZE", "2"}});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("PMI_RANK=3 is not below PMI_SIZE=2"), std::string::npos)
      << bad.status().message();
  fake_env().clear();
}

TEST(EnvironmentTest, LocalRankComesFromTheLauncher) {
  auto none = launch({});
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->local_rank, 0);
  EXPECT_EQ(none->local_size, 1);
  EXPECT_TRUE(none->source.empty());

  auto ompi = launch({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                      {"LOCAL_RANK", "1"}});  // Open MPI's own variables win
  ASSERT_TRUE(ompi.is_ok());
  EXPECT_EQ(ompi->local_rank, 3);
  EXPECT_EQ(ompi->local_size, 4);
  EXPECT_EQ(ompi->source, "OMPI_COMM_WORLD_LOCAL_RANK");

  auto mpich = launch({{"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  ASSERT_TRUE(mpich.is_ok());
  EXPECT_EQ(mpich->local_rank, 1);
  EXPECT_EQ(mpich->local_size, 2);

  auto torchrun = launch({{"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "8"}});
  ASSERT_TRUE(torchrun.is_ok());
  EXPECT_EQ(torchrun->local_rank, 5);

  auto slurm = launch({{"SLURM_LOCALID", "2"}});
  ASSERT_TRUE(slurm.is_ok());
  EXPECT_EQ(slurm->local_rank, 2);
  EXPECT_EQ(slurm->local_size, 0);  // unknown

  // Each bad value is an error naming the variable at fault.
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> bad = {
      {{{"LOCAL_RANK", "x"}}, "LOCAL_RANK=\"x\""},
      {{{"LOCAL_RANK", "-1"}}, "LOCAL_RANK=\"-1\""},
      {{{"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}, "LOCAL_RANK=2 is not below"},
      {{{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "0"}},
       "OMPI_COMM_WORLD_LOCAL_SIZE=\"0\""},
      {{{"OMPI_COMM_WORLD_RANK", "one"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK=\"one\""}};
  for (const auto& [env, names] : bad) {
    auto r = launch(env);
    ASSERT_FALSE(r.is_ok()) << names;
    EXPECT_NE(r.status().message().find(names), std::string::npos) << r.status().message();
  }
  fake_env().clear();
}

}  // namespace
}  // namespace strata::sys
