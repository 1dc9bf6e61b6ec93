// Which GPU a rank takes, from the launcher's node-local rank (sys::read_launch).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "strata/device/device.h"

namespace strata::device {
namespace {

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
