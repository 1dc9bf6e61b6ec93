// Which GPU a rank takes: the launcher's node-local rank variables and the choice from them.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "strata/device/device.h"

namespace strata::device {
namespace {

// A fake environment for local_rank_from_environment (a plain function pointer, so a global).
std::map<std::string, std::string>& fake_env() {
  static std::map<std::string, std::string> env;
  return env;
}
const char* fake_getenv(const char* name) {
  const auto it = fake_env().find(name);
  return it == fake_env().end() ? nullptr : it->second.c_str();
}
Result<LocalRank> local_rank(std::map<std::string, std::string> env) {
  fake_env() = std::move(env);
  return local_rank_from_environment(&fake_getenv);
}

TEST(DeviceSelectTest, LocalRankComesFromTheLauncher) {
  auto none = local_rank({});
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->rank, 0);
  EXPECT_EQ(none->size, 1);
  EXPECT_TRUE(none->source.empty());

  auto ompi = local_rank({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                          {"LOCAL_RANK", "1"}});  // Open MPI's own variables win
  ASSERT_TRUE(ompi.is_ok());
  EXPECT_EQ(ompi->rank, 3);
  EXPECT_EQ(ompi->size, 4);
  EXPECT_EQ(ompi->source, "OMPI_COMM_WORLD_LOCAL_RANK");

  auto mpich = local_rank({{"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  ASSERT_TRUE(mpich.is_ok());
  EXPECT_EQ(mpich->rank, 1);
  EXPECT_EQ(mpich->size, 2);

  auto torchrun = local_rank({{"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "8"}});
  ASSERT_TRUE(torchrun.is_ok());
  EXPECT_EQ(torchrun->rank, 5);

  auto slurm = local_rank({{"SLURM_LOCALID", "2"}});
  ASSERT_TRUE(slurm.is_ok());
  EXPECT_EQ(slurm->rank, 2);
  EXPECT_EQ(slurm->size, 0);  // unknown

  // Each bad value is an error naming the variable at fault.
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> bad = {
      {{{"LOCAL_RANK", "x"}}, "LOCAL_RANK=\"x\""},
      {{{"LOCAL_RANK", "-1"}}, "LOCAL_RANK=\"-1\""},
      {{{"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}, "LOCAL_RANK=2 is not below"},
      {{{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "0"}},
       "OMPI_COMM_WORLD_LOCAL_SIZE=\"0\""}};
  for (const auto& [env, names] : bad) {
    auto r = local_rank(env);
    ASSERT_FALSE(r.is_ok()) << names;
    EXPECT_NE(r.status().message().find(names), std::string::npos) << r.status().message();
  }
  fake_env().clear();
}

TEST(DeviceSelectTest, AutoGivesEachLocalRankItsOwnGpu) {
  const LocalRank single;
  EXPECT_EQ(*choose_device_index(kAutoDeviceIndex, single, 8), 0);
  for (int r = 0; r < 4; ++r) {
    const LocalRank lr{r, 4, "OMPI_COMM_WORLD_LOCAL_RANK"};
    auto i = choose_device_index(kAutoDeviceIndex, lr, 4);
    ASSERT_TRUE(i.is_ok());
    EXPECT_EQ(*i, r);
    // A launcher that gives each rank one GPU through CUDA_VISIBLE_DEVICES: it is GPU 0.
    EXPECT_EQ(*choose_device_index(kAutoDeviceIndex, lr, 1), 0);
  }
  // More local ranks than GPUs: an error naming the counts, not two ranks on one GPU.
  auto over = choose_device_index(kAutoDeviceIndex, LocalRank{5, 8, "LOCAL_RANK"}, 4);
  ASSERT_FALSE(over.is_ok());
  EXPECT_NE(over.status().message().find("8 ranks on this node but 4 visible GPUs"),
            std::string::npos)
      << over.status().message();
  EXPECT_FALSE(choose_device_index(kAutoDeviceIndex, single, 0).is_ok());
}

TEST(DeviceSelectTest, AnExplicitIndexIsCheckedAndServesOneLocalRank) {
  EXPECT_EQ(*choose_device_index(2, LocalRank{}, 4), 2);
  auto missing = choose_device_index(4, LocalRank{}, 4);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("device_index 4 is not one of the 4 visible GPUs"),
            std::string::npos)
      << missing.status().message();
  auto shared = choose_device_index(1, LocalRank{0, 2, "LOCAL_RANK"}, 4);
  ASSERT_FALSE(shared.is_ok());
  EXPECT_NE(shared.status().message().find("leave device_index at -1"), std::string::npos)
      << shared.status().message();
}

}  // namespace
}  // namespace strata::device
