// Checkpoints of whole training runs: a resume continues to the bit, older formats resume only
// where their layout stands, and bad or incomplete checkpoints, pruning and asynchronous saves
// never lose a checkpoint that was already safe.

#include "tests/integration/train_runs.h"
#include "tests/testing/small_disk.h"

namespace strata::train {
namespace {

TEST(TrainTest, ResumeIsBitIdenticalToUninterrupted) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 6;
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "nvme";
  const std::vector<double> full = run(j);
  ASSERT_EQ(full.size(), 6u);

  // The first run stops after step 3 (as Ctrl-C would) with the same schedule, then resumes.
  Json first = j;
  first["save_dir"] = dir.file("resume");
  {
    auto t = make_trainer(first);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    ASSERT_TRUE((*t)->run_steps(3).is_ok());
    ASSERT_TRUE((*t)->save().is_ok());
  }
  ASSERT_TRUE(fs::exists(dir.file("resume/latest")));
  // A run that went on past its checkpoint before it stopped: its metrics file holds step 4 and
  // a line the stop cut short.
  {
    std::ofstream m(dir.file("metrics.jsonl"));
    for (int s = 1; s <= 4; ++s)
      m << R"({"step": )" << s << R"(, "loss": 1.0})"
        << "\n";
    m << R"({"step": 5, "lo)";
  }

  Json second = j;
  second["save_dir"] = dir.file("resume");
  second["metrics_file"] = dir.file("metrics.jsonl");
  auto t = make_trainer(second, dir.file("resume"));
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ((*t)->step(), 3);
  ASSERT_TRUE((*t)->run().is_ok());
  const std::vector<double> tail = losses_of(**t);
  ASSERT_EQ(tail.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(tail[static_cast<std::size_t>(i)], full[static_cast<std::size_t>(3 + i)]) << i;
  t->reset();
  // The metrics file holds each step once: the resume dropped the first step 4 and the cut line.
  std::vector<std::int64_t> steps;
  std::ifstream in(dir.file("metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    steps.push_back(Json::parse(line)["step"].get<std::int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6}));
}

// A checkpoint of format_version 1 (a group's tensors on 64-element boundaries in the saved
// moments) resumes where every group's tensors still lie where they lay then, to the bits of the
// same checkpoint marked version 2, and is refused, naming the file, the version and the group,
// where they moved (hidden 32: a norm of 32 elements moved the projections after it); no moment
// is read from the wrong place.
TEST(TrainTest, AVersionOneCheckpointResumesOnlyWhereItsLayoutStands) {
  for (const bool moved : {true, false}) {
    SCOPED_TRACE(moved ? "tensors moved" : "tensors in place");
    TempDir dir;
    Json j = tiny_config(dir);
    if (!moved) {  // every tensor a multiple of 256 elements: the same offsets either way
      j["model"]["hidden_size"] = 256;
      j["model"]["intermediate_size"] = 256;
      j["model"]["num_key_value_heads"] = 4;
    }
    const std::string name = save_after_two_steps(dir, j);
    ASSERT_FALSE(name.empty());
    const auto mark = [&](int version) { mark_format_version(dir, name, version); };
    Json resumed = j;
    resumed["save_dir"] = "";  // the checkpoint stays the latest
    const auto resumed_losses = [&]() -> Result<std::vector<double>> {
      STRATA_ASSIGN_OR_RETURN(auto t, make_trainer(resumed, dir.file("ckpt")));
      STRATA_RETURN_IF_ERROR(t->run());
      return losses_of(*t);
    };
    mark(1);
    auto old = resumed_losses();
    if (moved) {
      ASSERT_FALSE(old.is_ok());
      EXPECT_NE(old.status().message().find(dir.file("ckpt/" + name)), std::string::npos)
          << old.status().message();
      EXPECT_NE(old.status().message().find("format_version 1"), std::string::npos);
      EXPECT_NE(old.status().message().find("group layers.0's tensors on 64-element"),
                std::string::npos)
          << old.status().message();
      continue;
    }
    ASSERT_TRUE(old.is_ok()) << old.status().message();
    mark(2);
    auto now = resumed_losses();
    ASSERT_TRUE(now.is_ok()) << now.status().message();
    EXPECT_EQ(*old, *now);
    EXPECT_EQ(old->size(), 2u);
  }
}

TEST(TrainTest, CorruptCheckpointIsRejectedAndEarlierOneSurvives) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 2;
  j["save_every"] = 1;
  run(j);
  const std::string good = dir.file("ckpt/step-00000001/model/model.safetensors");
  const std::string bad = dir.file("ckpt/step-00000002/model/model.safetensors");
  auto before = read_file(good);
  ASSERT_TRUE(before.is_ok());
  {  // the header claims far more bytes than the file holds
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    const std::uint64_t huge = 1ull << 40;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  auto t = make_trainer(j, dir.file("ckpt"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find(bad), std::string::npos) << t.status().message();
  // The earlier checkpoint is untouched and still resumable.
  EXPECT_EQ(*read_file(good), *before);
  auto t2 = make_trainer(j, dir.file("ckpt/step-00000001"));
  ASSERT_TRUE(t2.is_ok()) << t2.status().message();
  EXPECT_EQ((*t2)->step(), 1);
}

// keep_last N (Hugging Face's save_total_limit): after each save the newest N checkpoints stay;
// a directory that only looks like one (no trainer_state.json), another name, and the one
// `latest` names are never touched; a crash between hiding a pruned checkpoint and removing it
// (a real one: the child process exits there) leaves `latest` resumable, and the next prune
// clears the hidden leftover. keep_last without save_dir, or negative, is refused by name.
TEST(TrainTest, KeepLastPrunesOldCheckpointsAndSurvivesACrashWhilePruning) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 5;
  j["save_every"] = 1;
  j["keep_last"] = 2;
  fs::create_directories(dir.file("ckpt/step-00000000"));  // no trainer_state.json: not ours
  fs::create_directories(dir.file("ckpt/notes"));
  dir.write("ckpt/notes/keep.txt", "mine");
  const std::vector<double> losses = run(j);
  ASSERT_EQ(losses.size(), 5u);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.file("ckpt"))) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "notes", "step-00000000", "step-00000004",
                                            "step-00000005"}));
  EXPECT_EQ(*read_file(dir.file("ckpt/notes/keep.txt")), "mine");
  auto resumed = make_trainer(j, dir.file("ckpt"));
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().message();
  EXPECT_EQ((*resumed)->step(), 5);

  // `latest` is never pruned, even when it is not among the newest by step.
  dir.write("ckpt/latest", "step-00000004\n");
  auto kept = prune_checkpoints(dir.file("ckpt"), 1);
  ASSERT_TRUE(kept.is_ok()) << kept.status().message();
  EXPECT_TRUE(kept->empty());
  EXPECT_TRUE(fs::exists(dir.file("ckpt/step-00000004")));
  dir.write("ckpt/latest", "step-00000005\n");

  // A crash after step-00000004 is hidden and before it is removed.
  EXPECT_EXIT(
      {
        auto p = prune_checkpoints(dir.file("ckpt"), 1, [](const std::string&) { std::_Exit(3); });
        (void)p;
      },
      ::testing::ExitedWithCode(3), "");
  EXPECT_FALSE(fs::exists(dir.file("ckpt/step-00000004")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt/.step-00000004.pruned")));
  auto after_crash = make_trainer(j, dir.file("ckpt"));
  ASSERT_TRUE(after_crash.is_ok()) << after_crash.status().message();
  EXPECT_EQ((*after_crash)->step(), 5);
  auto again = prune_checkpoints(dir.file("ckpt"), 1);
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_FALSE(fs::exists(dir.file("ckpt/.step-00000004.pruned")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt/step-00000005")));

  for (const auto& [value, why] :
       {std::pair{Json(-1), "keep_last"}, std::pair{Json(2), "save_dir"}}) {
    Json bad = tiny_config(dir);
    bad["keep_last"] = value;
    if (value == 2) bad["save_dir"] = "";
    auto refused = parse_train_config(bad, "test config");
    ASSERT_FALSE(refused.is_ok());
    EXPECT_NE(refused.status().message().find(why), std::string::npos)
        << refused.status().message();
  }
}

// save_async: each checkpoint holds the bytes a synchronous save of the same step writes, and
// training the same bits, with the optimizer on the host and on NVMe, under each schedule. Step
// 2's save is slowed down (async_save_started sleeps 300 ms): steps 3 and 4 run beside it,
// writing every copy of the state but the one it holds, and its checkpoint still holds step 2's
// state; step 4's save waits for it (at most one in flight: save_stall_ms).
TEST(TrainTest, AsynchronousSavesWriteTheSynchronousBytes) {
  for (const char* offload : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "forward", "backward"}) {
      SCOPED_TRACE(std::string(offload) + " " + overlap);
      testing::TempDir dir;
      Json j = tiny_config(dir);
      j["offload_optimizer"] = offload;
      j["optimizer_overlap"] = overlap;
      j["max_steps"] = 6;
      j["save_every"] = 2;
      j["save_dir"] = dir.file("sync");
      auto sync = make_trainer(j);
      ASSERT_TRUE(sync.is_ok()) << sync.status().message();
      ASSERT_TRUE((*sync)->run().is_ok());
      const std::vector<double> sync_losses = losses_of(**sync);
      sync->reset();  // its swap directory is the next run's
      j["save_async"] = true;
      j["save_dir"] = dir.file("async");
      auto c = parse_train_config(j, "test config");
      ASSERT_TRUE(c.is_ok()) << c.status().message();
      TrainOptions o;
      o.async_save_started = [](std::int64_t step) {
        if (step == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      };
      auto async = Trainer::create(*c, o);
      ASSERT_TRUE(async.is_ok()) << async.status().message();
      ASSERT_TRUE((*async)->run().is_ok());
      EXPECT_EQ(losses_of(**async), sync_losses);
      for (int step = 2; step <= 6; step += 2) {
        const std::string name = step_name(step);
        EXPECT_GT(
            testing::expect_same_checkpoint(dir.file("async/" + name), dir.file("sync/" + name),
                                            {"save_async", "save_dir"}),
            3);
      }
      EXPECT_EQ(read_file(dir.file("async/latest")).value(), "step-00000006\n");
      double stalled = 0;
      for (const auto& m : (*async)->history()) stalled += m.save_stall_ms;
      EXPECT_GT(stalled, 100.0);
      EXPECT_EQ((*async)->last_checkpoint(), dir.file("async/step-00000006"));
    }
  }
}

TEST(TrainTest, AsynchronousSavesNeedTheOptimizerOffTheDeviceAndACheckpointDirectory) {
  testing::TempDir dir;
  Json j = tiny_config(dir);
  j["save_async"] = true;
  j["offload_optimizer"] = "none";
  auto c = parse_train_config(j, "test config");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'save_async'"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("offload_optimizer"), std::string::npos);
  j["offload_optimizer"] = "cpu";
  j["save_dir"] = "";
  auto d = parse_train_config(j, "test config");
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("save_dir is \"\""), std::string::npos)
      << d.status().message();
  // A host budget without room for the held copy: refused, naming the bytes and the way out.
  j["save_dir"] = dir.file("ckpt");
  j["host_memory_limit"] = "600KiB";
  j["offload_param"] = "cpu";
  auto t = make_trainer(j);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("too small for save_async"), std::string::npos)
      << t.status().message();
}

// The pages the files under `dir` take on a file system of `page` bytes a page.
std::uint64_t pages_under(const std::string& dir, std::uint64_t page) {
  std::uint64_t pages = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) pages += (e.file_size() + page - 1) / page;
  }
  return pages;
}

// Every file under `dir`, by its path below it, with its bytes.
std::map<std::string, std::string> files_under(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) {
      files[fs::relative(e.path(), dir).string()] = read_file(e.path().string()).value();
    }
  }
  return files;
}

// A save onto a disk that fills partway (the full model's files, its optimizer shard, the
// trainer state, `latest`; synchronous and asynchronous; the same step saved again over itself; a
// LoRA run's adapters) is an error that
// names the disk's complaint, and never a crash: the earlier checkpoint and `latest` are left
// as they were, no half-written directory stays, and the run resumes from the earlier one. With
// room enough, the same save succeeds (so the disk was full where it failed, not broken).
TEST(TrainTest, ASaveOntoAFullDiskIsAnErrorAndTheEarlierCheckpointSurvives) {
  TempDir dir;
  testing::SmallDisk disk(dir.file("disk"), 16u << 20);
  if (!disk.why_not().empty()) GTEST_SKIP() << disk.why_not();
  const std::string ckpt = dir.file("disk/ckpt");

  Json full = tiny_config(dir);
  full["model"]["intermediate_size"] = 400;
  full["offload_param"] = "cpu";
  full["offload_optimizer"] = "cpu";
  full["save_every"] = 1;
  full["max_steps"] = 1;
  // The LoRA run's frozen base: the full run's first checkpoint, saved elsewhere.
  Json base = full;
  base["save_dir"] = dir.file("base");
  ASSERT_EQ(run(base).size(), 1u);
  Json lora = full;
  lora["model"] = dir.file("base/step-00000001/model");
  lora["finetune"] = {{"method", "lora"},
                      {"r", 4},
                      {"alpha", 8},
                      {"target_modules", {"q_proj", "v_proj", "down_proj"}}};

  for (const auto& [name, first] :
       {std::pair{"full", full}, std::pair{"full, saved asynchronously", full},
        std::pair{"full, the same step saved again", full}, std::pair{"lora", lora}}) {
    SCOPED_TRACE(name);
    Json j = first;
    j["save_dir"] = ckpt;
    j["save_async"] = std::string(name).find("async") != std::string::npos;
    // The same step saved again (resumed and saved at once): the checkpoint it replaces is moved
    // aside, and comes back if the new one cannot be named.
    const bool same_step = std::string(name).find("same step") != std::string::npos;
    const std::string saved = same_step ? "step-00000001\n" : "step-00000002\n";
    fs::remove_all(ckpt);
    ASSERT_EQ(run(j).size(), 1u);
    const std::map<std::string, std::string> before = files_under(ckpt);
    // The checkpoint's pages, and `latest`'s unless it names the step already.
    const std::uint64_t need =
        pages_under(ckpt + "/step-00000001", disk.page_bytes()) + (same_step ? 0 : 1);
    j["max_steps"] = 2;
    // Free pages from none to one short of a whole checkpoint and `latest` (tmpfs gives each
    // file whole pages and directories none), each file's turn to fail among them; then room.
    std::vector<std::uint64_t> free_pages;
    for (std::uint64_t p = 0; p < need; p += std::max<std::uint64_t>(1, need / 8)) {
      free_pages.push_back(p);
    }
    for (std::uint64_t p = need > 3 ? need - 3 : 0; p < need; ++p) free_pages.push_back(p);
    free_pages.push_back(need + 16);
    for (const std::uint64_t pages : free_pages) {
      SCOPED_TRACE(std::to_string(pages) + " of " + std::to_string(need) + " pages free");
      disk.leave_free(pages);
      auto t = make_trainer(j, ckpt);
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      const Status s = same_step ? (*t)->save().status() : (*t)->run();
      t->reset();
      disk.unfill();
      const std::string latest = read_file(ckpt + "/latest").value();
      if (pages >= need) {
        ASSERT_TRUE(s.is_ok()) << s.message();
        EXPECT_EQ(latest, saved);
      } else {
        ASSERT_FALSE(s.is_ok());
        EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.message();
        EXPECT_NE(s.message().find(ckpt), std::string::npos) << s.message();
        EXPECT_EQ(latest, "step-00000001\n");
        const std::map<std::string, std::string> after = files_under(ckpt);
        for (const auto& [path, bytes] : after) {
          EXPECT_TRUE(before.contains(path) && before.at(path) == bytes)
              << path << " is new or changed";
        }
        for (const auto& [path, bytes] : before)
          EXPECT_TRUE(after.contains(path)) << path << " is gone";
      }
      auto resumed = make_trainer(j, ckpt);
      ASSERT_TRUE(resumed.is_ok()) << resumed.status().message();
      EXPECT_EQ((*resumed)->step(), s.is_ok() && !same_step ? 2 : 1);
      resumed->reset();
      fs::remove_all(ckpt + "/step-00000002");
      write_file_atomic(ckpt + "/latest", "step-00000001\n").ignore();
    }
  }
}

// Found by the trainer_state fuzzer: a `latest` naming a file too long for the file system made
// the checks throw; every malformed `latest` is an error naming it.
TEST(TrainTest, AMalformedLatestIsAnErrorNamingIt) {
  testing::TempDir dir;
  for (const std::string& name :
       {std::string(5000, 'x'), std::string(".."), std::string("a/b"), std::string("\n")}) {
    dir.write("ckpt/latest", name);
    auto r = resolve_checkpoint(dir.file("ckpt"));
    ASSERT_FALSE(r.is_ok()) << name;
    EXPECT_NE(r.status().message().find(dir.file("ckpt")), std::string::npos)
        << r.status().message();
  }
}

TEST(TrainTest, IncompleteCheckpointIsRejected) {
  TempDir dir;
  Json j = tiny_config(dir);
  fs::create_directories(dir.file("empty/step-00000001"));
  dir.write("empty/latest", "step-00000001\n");
  auto t = make_trainer(j, dir.file("empty"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("incomplete"), std::string::npos) << t.status().message();
}

}  // namespace
}  // namespace strata::train
