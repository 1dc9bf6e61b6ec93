// `strata io-bench`: sweeps swap read/write bandwidth over block sizes, queue depths, rings and
// drives, verifying the data first, and writes the best settings as a config's swap section.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "strata/io/swap.h"
#include "strata/sys/host_mapping.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

// Set by SIGINT/SIGTERM: requests in flight finish, none start, and the swap space's destructor
// deletes the files. A signal handler can reach nothing but a global.
std::atomic<bool> g_io_bench_stop{false};

extern "C" void on_io_bench_signal(int sig) {
  if (g_io_bench_stop.exchange(true)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  static const char msg[] =
      "\nstrata io-bench: stopping and removing the benchmark files (press Ctrl-C again to abort "
      "now)\n";
  [[maybe_unused]] auto n = ::write(2, msg, sizeof(msg) - 1);
}

constexpr std::size_t kPage = io::kIoAlignBytes;
// Random bytes are generated once for up to this much of the file; beyond, they repeat shifted.
constexpr std::uint64_t kSourceMaxBytes = std::uint64_t{1} << 30;
// Bytes of each block that timed reads compare: enough to tell any two blocks apart.
constexpr std::size_t kHeadCheckBytes = 256;

struct BenchArgs {
  std::vector<std::string> paths;
  std::string size = "1GiB";
  std::vector<std::string> block_sizes{"1MiB"};
  std::vector<std::string> queue_depths{"32"};
  std::vector<std::string> threads{"1"};
  std::vector<std::string> num_paths;  // default: all paths
  std::string op = "both";
  std::string engine = "auto";
  int repeat = 1;
  bool json = false;
  bool verify_swap = false;
  bool caller_driven = false;
  bool sqpoll = false;
  bool no_register = false;
  bool no_huge_pages = false;
  std::string write_config;
};

// The parsed sweep.
struct Plan {
  std::uint64_t size_bytes = 0;
  std::vector<std::uint64_t> block_sizes;
  std::vector<int> queue_depths, threads, num_paths;
  std::vector<io::IoOp> ops;
  // Also a pass of reads and writes at once (every other block written, the rest read), as the
  // NVMe-streamed optimizer moves its state.
  bool mixed = false;
};

struct Measurement {
  Measurement(io::IoOp o, std::uint64_t block, int qd, int t, int np)
      : op(o), block_size(block), queue_depth(qd), threads(t), paths(np) {}
  io::IoOp op;
  bool mixed = false;  // reads and writes at once; mbps is each direction's
  std::uint64_t block_size = 0;
  int queue_depth = 0, threads = 0, paths = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  double mbps = 0;
  double latency_ms = 0;  // mean per request
  // CPU time (user + system, every thread of the process) per 10^9 bytes moved, as fio's usr_cpu
  // + sys_cpu: where a faster drive would make the engine saturate a core.
  double cpu_s_per_gb = 0;
  std::vector<double> runs_mbps;
};

// User + system CPU seconds this process has used, all threads.
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

const char* op_name(io::IoOp op) { return op == io::IoOp::kRead ? "read" : "write"; }
const char* op_name(const Measurement& m) { return m.mixed ? "mixed" : op_name(m.op); }

// Parses "a,b,c" lists (CLI11 already split on commas) into positive integers or byte sizes.
template <typename T, typename Parse>
void parse_list(const std::vector<std::string>& items, const char* flag, Parse parse,
                std::vector<T>& out, std::vector<std::string>& problems) {
  for (const std::string& item : items) {
    auto v = parse(item);
    if (!v.has_value()) {
      problems.push_back(std::string(flag) + " '" + item + "' " + v.error);
    } else {
      out.push_back(*v.value);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}

template <typename T>
struct Parsed {
  std::optional<T> value;
  std::string error;
  bool has_value() const { return value.has_value(); }
};

Parsed<std::uint64_t> parse_block(const std::string& text) {
  auto r = parse_bytes(text);
  if (!r.is_ok()) return {std::nullopt, "is not a byte size (e.g. 1MiB)"};
  if (*r == 0 || *r % kPage != 0 || *r > (std::uint64_t{1} << 30)) {
    return {std::nullopt, "must be a positive multiple of 4096 no larger than 1GiB"};
  }
  return {*r, ""};
}

Parsed<int> parse_count(const std::string& text, int max) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 1 || v > max) {
    return {std::nullopt, "must be an integer in [1, " + std::to_string(max) + "]"};
  }
  return {static_cast<int>(v), ""};
}

Result<Plan> make_plan(const BenchArgs& a) {
  std::vector<std::string> problems;
  Plan p;
  if (a.paths.empty()) problems.push_back("--path is required: a directory on the drive to test");
  // Checked before the table's header is printed, in the flag's own words (the swap space would
  // name the config key swap_paths).
  for (const std::string& dir : a.paths) {
    std::error_code ec;
    const auto status = std::filesystem::status(dir, ec);
    if (status.type() == std::filesystem::file_type::not_found) {
      problems.push_back("--path '" + dir + "' does not exist; create it (mkdir -p " + dir +
                         ") or pass a directory on the drive to test");
    } else if (ec) {
      problems.push_back("--path '" + dir + "' cannot be inspected: " + ec.message());
    } else if (status.type() != std::filesystem::file_type::directory) {
      problems.push_back("--path '" + dir +
                         "' is not a directory; pass a directory on the drive to test");
    } else if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      problems.push_back("--path '" + dir + "' is not writable: " + std::strerror(errno));
    }
  }
  auto size = parse_bytes(a.size);
  if (!size.is_ok() || *size < kPage) {
    problems.push_back("--size '" + a.size + "' must be a byte size of at least 4096 (e.g. 1GiB)");
  } else {
    p.size_bytes = align_up(*size, kPage);
  }
  parse_list(a.block_sizes, "--block-size", parse_block, p.block_sizes, problems);
  parse_list(
      a.queue_depths, "--queue-depth", [](const std::string& s) { return parse_count(s, 4096); },
      p.queue_depths, problems);
  parse_list(
      a.threads, "--threads", [](const std::string& s) { return parse_count(s, 64); }, p.threads,
      problems);
  const int max_paths = std::max<int>(1, static_cast<int>(a.paths.size()));
  std::vector<std::string> num_paths = a.num_paths;
  if (num_paths.empty()) num_paths.push_back(std::to_string(max_paths));
  parse_list(
      num_paths, "--num-paths",
      [max_paths](const std::string& s) { return parse_count(s, max_paths); }, p.num_paths,
      problems);
  if (a.op == "read") {
    p.ops = {io::IoOp::kRead};
  } else if (a.op == "write") {
    p.ops = {io::IoOp::kWrite};
  } else if (a.op == "both") {
    p.ops = {io::IoOp::kWrite, io::IoOp::kRead};
  } else if (a.op == "mixed") {
    p.mixed = true;
  } else if (a.op == "all") {
    p.ops = {io::IoOp::kWrite, io::IoOp::kRead};
    p.mixed = true;
  } else {
    problems.push_back("--op '" + a.op + "' must be read, write, both, mixed or all");
  }
  if (a.repeat < 1) problems.push_back("--repeat must be at least 1");
  if (problems.empty()) return p;
  std::string msg;
  for (const std::string& s : problems) msg += (msg.empty() ? "" : "\n  ") + s;
  return invalid_argument(msg);
}

// What io-bench writes: random bytes that differ from block to block, as real tensors and fio's
// refill_buffers do. A buffer written over and over would be cheaper to store for deduplicating
// or compressing storage (the development machine's virtual disk reads such data at a different
// speed), so it would measure something training never sees. Generated once (lap_max bytes, at
// most kSourceMaxBytes); on larger files each lap repeats it shifted by a page per lap, so every
// block of the file still starts with different bytes.
class Source {
 public:
  Source(std::uint64_t size_bytes, std::uint64_t max_block, bool huge_pages)
      : lap_max_(std::min<std::uint64_t>(align_up(size_bytes, kPage), kSourceMaxBytes)),
        bytes_(
            align_up(std::max(lap_max_, max_block) + max_block, sys::HostMapping::kHugePageBytes),
            huge_pages) {
    Rng rng(20261129);
    for (std::size_t i = 0; i + 8 <= bytes_.size(); i += 8) {
      const std::uint64_t v = rng.next_u64();
      std::memcpy(bytes_.data() + i, &v, 8);
    }
  }
  // The bytes of the block at `file_offset` (a multiple of `block`).
  const std::byte* at(std::uint64_t file_offset, std::uint64_t block) const {
    const std::uint64_t lap_bytes = std::max<std::uint64_t>(1, lap_max_ / block) * block;
    const std::uint64_t lap = file_offset / lap_bytes;
    return bytes_.data() + file_offset % lap_bytes + (lap * kPage) % block;
  }
  std::span<std::byte> span() { return bytes_.bytes(); }
  std::size_t huge_page_bytes() const { return bytes_.huge_page_bytes(); }

 private:
  const std::uint64_t lap_max_;
  sys::HostMapping bytes_;
};

// One sequential pass over the extent: block_size requests, `window` of them in flight, each
// completion resubmitting the next block from its callback (on the engine's thread, like fio's
// job loop: no hand-off through this thread per request).
class Pass {
 public:
  enum class Check { kNone, kHead, kFull };

  Pass(io::SwapSpace& swap, const io::Extent& extent, std::uint64_t size_bytes,
       std::uint64_t block_bytes, std::byte* pool, int window, const Source& source,
       bool caller_driven)
      : swap_(swap),
        extent_(extent),
        size_(size_bytes),
        block_(block_bytes),
        pool_(pool),
        window_(window),
        source_(source),
        caller_driven_(caller_driven),
        slot_offset_(window),
        slot_op_(window),
        handles_(window) {}

  // Returns the seconds from the first submission to the last completion. `mixed`: every other
  // block is written, the rest read, all in one stream of requests (`op` is ignored).
  Result<double> run(io::IoOp op, Check check, bool mixed = false) {
    op_ = op;
    mixed_ = mixed;
    check_ = check;
    next_.store(0);
    latency_sum_s_ = 0;
    requests_ = 0;
    error_ = Status::ok();
    const std::uint64_t blocks = (size_ + block_ - 1) / block_;
    const int first = static_cast<int>(std::min<std::uint64_t>(window_, blocks));
    active_ = first;
    std::vector<io::IoRequest> batch;
    batch.reserve(first);
    for (io::IoHandle& h : handles_) h = io::IoHandle();
    Stopwatch clock;
    const double cpu0 = process_cpu_seconds();
    for (int s = 0; s < first; ++s) batch.push_back(request(s, next_.fetch_add(1)));
    std::vector<io::IoHandle> handles = swap_.submit_batch(batch);
    if (caller_driven_) {
      // Nothing moves unless this thread drives the rings: wait on any unfinished request.
      {
        std::lock_guard lock(mu_);
        for (int s = 0; s < first; ++s) {
          if (!handles_[s].valid()) handles_[s] = handles[s];  // unless already resubmitted
        }
      }
      for (;;) {
        io::IoHandle h;
        {
          std::lock_guard lock(mu_);
          if (active_ == 0) break;
          for (const io::IoHandle& x : handles_) {
            if (x.valid() && !x.done()) {
              h = x;
              break;
            }
          }
        }
        h.wait().ignore();  // its status reaches error_ through the callback
      }
    } else {
      // Every completion calls back on an engine thread; wait for the last.
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return active_ == 0; });
    }
    const double seconds = clock.elapsed_s();
    cpu_s_ = process_cpu_seconds() - cpu0;
    if (!error_.is_ok()) return error_;
    if (g_io_bench_stop.load()) return cancelled("interrupted");
    return seconds;
  }

  double mean_latency_ms() const { return requests_ > 0 ? latency_sum_s_ / requests_ * 1e3 : 0; }
  double cpu_seconds() const { return cpu_s_; }  // of the last run

 private:
  std::byte* slot(int s) const { return pool_ + static_cast<std::size_t>(s) * block_; }
  std::uint64_t bytes_at(std::uint64_t offset) const { return std::min(block_, size_ - offset); }

  // Writes go straight from the source (no copy); reads land in the slot's staging buffer.
  io::IoRequest request(int s, std::uint64_t block) {
    const std::uint64_t offset = block * block_;
    const io::IoOp op = mixed_ ? (block % 2 == 0 ? io::IoOp::kWrite : io::IoOp::kRead) : op_;
    slot_offset_[s] = offset;
    slot_op_[s] = op;
    const std::uint64_t n = bytes_at(offset);
    void* buf = op == io::IoOp::kWrite ? const_cast<std::byte*>(source_.at(offset, block_))
                                       : static_cast<void*>(slot(s));
    return {op, extent_, offset, buf, n, [this, s](const io::IoCompletion& c) { done(s, c); }};
  }

  Status verify(const std::byte* p, std::uint64_t offset, std::uint64_t n) const {
    const std::byte* want = source_.at(offset, block_);
    const std::size_t len = check_ == Check::kFull ? n : std::min<std::size_t>(n, kHeadCheckBytes);
    if (std::memcmp(p, want, len) == 0) return Status::ok();
    std::size_t i = 0;
    while (p[i] == want[i]) ++i;
    return data_loss("byte " + std::to_string(offset + i) +
                     " of the benchmark file read back different from what was written there");
  }

  void done(int s, const io::IoCompletion& c) {
    Status status = c.status;
    if (status.is_ok() && slot_op_[s] == io::IoOp::kRead && check_ != Check::kNone) {
      status = verify(slot(s), slot_offset_[s], c.bytes);
    }
    bool more = false;
    {
      std::lock_guard lock(mu_);
      latency_sum_s_ += c.elapsed_s;
      ++requests_;
      if (!status.is_ok() && error_.is_ok()) error_ = status;
      more = error_.is_ok() && !g_io_bench_stop.load();
    }
    const std::uint64_t blocks = (size_ + block_ - 1) / block_;
    const std::uint64_t next = more ? next_.fetch_add(1) : blocks;
    if (next < blocks) {
      io::IoHandle h = swap_.submit(request(s, next));
      std::lock_guard lock(mu_);
      handles_[s] = std::move(h);
      return;
    }
    std::lock_guard lock(mu_);
    if (--active_ == 0) cv_.notify_all();
  }

  io::SwapSpace& swap_;
  const io::Extent extent_;
  const std::uint64_t size_, block_;
  std::byte* const pool_;
  const int window_;
  const Source& source_;
  const bool caller_driven_;
  std::vector<std::uint64_t> slot_offset_;  // written before submission, read in its callback
  std::vector<io::IoOp> slot_op_;           // likewise
  std::vector<io::IoHandle> handles_;       // each slot's latest request (caller-driven waits)
  io::IoOp op_ = io::IoOp::kRead;
  bool mixed_ = false;
  Check check_ = Check::kNone;
  std::atomic<std::uint64_t> next_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int active_ = 0;
  Status error_;
  double latency_sum_s_ = 0;
  std::uint64_t requests_ = 0;
  double cpu_s_ = 0;
};

struct Sweep {
  Sweep(const BenchArgs& a, const Plan& p) : args(a), plan(p) {}
  const BenchArgs& args;
  const Plan& plan;
  sys::HostMapping pool;  // staging buffers reads land in, one block per request in flight
  std::unique_ptr<Source> source;
  std::set<std::string> warned;
  std::string engine_used;
  bool registered = false;
  std::vector<Measurement> results;
};

// Measures every op for one (paths, threads, block size, queue depth) point.
Status measure_point(Sweep& sw, int num_paths, int threads, std::uint64_t block, int qd) {
  const BenchArgs& a = sw.args;
  io::SwapOptions o;
  o.paths.assign(a.paths.begin(), a.paths.begin() + num_paths);
  o.engine = *io::parse_swap_engine(a.engine);  // --engine is checked by CLI11
  o.block_size_bytes = block;
  o.queue_depth = qd;
  o.thread_count = threads;
  o.posix_threads = std::min(256, threads * qd);  // posix reaches the same depth with a worker each
  o.caller_driven = a.caller_driven;
  o.sqpoll = a.sqpoll;
  o.verify_swap = a.verify_swap;
  o.initial_capacity_bytes = sw.plan.size_bytes;
  o.log_warnings = false;
  STRATA_ASSIGN_OR_RETURN(auto swap, io::SwapSpace::create(o));
  for (const std::string& w : swap->warnings()) {
    if (sw.warned.insert(w).second)
      std::fprintf(stderr, "strata io-bench: warning: %s\n", w.c_str());
  }
  sw.engine_used = swap->engine_name();
  STRATA_ASSIGN_OR_RETURN(io::Extent extent, swap->allocate(sw.plan.size_bytes, "io-bench"));

  const int window = qd * threads;
  const std::size_t pool_bytes = static_cast<std::size_t>(window) * block;
  std::byte* pool = sw.pool.data();
  sw.registered = false;
  io::BufferRegistration registration;  // destroyed before the swap space
  if (!a.no_register) {
    const std::span<std::byte> buffers[] = {{pool, pool_bytes}, sw.source->span()};
    auto reg = swap->register_buffers(buffers);
    sw.registered = reg.is_ok();
    if (reg.is_ok()) {
      registration = std::move(*reg);
    } else if (sw.warned.insert(reg.status().message()).second) {
      std::fprintf(stderr, "strata io-bench: note: %s\n", reg.status().message().c_str());
    }
  }

  Pass pass(*swap, extent, sw.plan.size_bytes, block, pool, window, *sw.source, a.caller_driven);
  // Verify before timing: write the pattern everywhere, read it all back and compare every byte.
  // Reads are timed on a file written twice, as a swap file in training is written over and
  // over: this disk read a file written once about 4% slower (bench/RESULTS.md). With a timed
  // write first (--op both), that write is the second.
  STRATA_RETURN_IF_ERROR(pass.run(io::IoOp::kWrite, Pass::Check::kNone).status());
  const bool timed_write_first = !sw.plan.ops.empty() && sw.plan.ops.front() == io::IoOp::kWrite;
  if (!timed_write_first) {
    STRATA_RETURN_IF_ERROR(pass.run(io::IoOp::kWrite, Pass::Check::kNone).status());
  }
  Status verified = pass.run(io::IoOp::kRead, Pass::Check::kFull).status();
  if (!verified.is_ok()) return verified.with_context("verifying before timing");

  std::vector<std::pair<io::IoOp, bool>> passes;  // (op, mixed)
  for (io::IoOp op : sw.plan.ops) passes.emplace_back(op, false);
  if (sw.plan.mixed) passes.emplace_back(io::IoOp::kRead, true);
  for (const auto& [op, mixed] : passes) {
    Measurement m(op, block, qd, threads, num_paths);
    m.mixed = mixed;
    m.bytes = sw.plan.size_bytes;
    struct Run {
      double mbps, latency_ms, cpu_s_per_gb;
      bool operator<(const Run& o) const { return mbps < o.mbps; }
    };
    std::vector<Run> runs;
    for (int r = 0; r < a.repeat; ++r) {
      // Timed reads compare the head of each block: cheap, and a wrong block cannot hide.
      STRATA_ASSIGN_OR_RETURN(
          double s,
          pass.run(op, op == io::IoOp::kRead ? Pass::Check::kHead : Pass::Check::kNone, mixed));
      // A mixed pass moves half its bytes each way: each direction's rate.
      const double moved = static_cast<double>(m.bytes) / (mixed ? 2.0 : 1.0);
      runs.push_back(Run{moved / s / 1e6, pass.mean_latency_ms(),
                         pass.cpu_seconds() / (static_cast<double>(m.bytes) / 1e9)});
      m.runs_mbps.push_back(runs.back().mbps);
    }
    std::vector<Run> sorted = runs;
    std::sort(sorted.begin(), sorted.end());
    const Run& median = sorted[sorted.size() / 2];
    m.mbps = median.mbps;
    m.seconds = static_cast<double>(m.bytes) / (mixed ? 2.0 : 1.0) / (m.mbps * 1e6);
    m.latency_ms = median.latency_ms;
    m.cpu_s_per_gb = median.cpu_s_per_gb;
    sw.results.push_back(m);
    if (a.json) {
      Json j = {{"op", op_name(m)},
                {"block_size", block},
                {"queue_depth", qd},
                {"threads", threads},
                {"paths", num_paths},
                {"bytes", m.bytes},
                {"seconds", m.seconds},
                {"MBps", m.mbps},
                {"engine", sw.engine_used},
                {"repeat", a.repeat},
                {"runs_MBps", m.runs_mbps},
                {"latency_ms", m.latency_ms},
                {"cpu_s_per_GB", m.cpu_s_per_gb},
                {"verify_swap", a.verify_swap}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%-6s %10s %5d %8d %6d %10.1f %9.3f %11.2f %9.3f\n", op_name(m),
                  format_bytes(block).c_str(), qd, threads, num_paths, m.mbps, m.seconds,
                  m.latency_ms, m.cpu_s_per_gb);
    }
    std::fflush(stdout);
  }
  return Status::ok();
}

// The best point: the highest MB/s for one op; for both, the highest harmonic mean of read and
// write (the time to move equal bytes each way, which is what an optimizer step does).
const Measurement* best(const std::vector<Measurement>& results, io::IoOp op) {
  const Measurement* b = nullptr;
  for (const Measurement& m : results) {
    if (m.op == op && !m.mixed && (b == nullptr || m.mbps > b->mbps)) b = &m;
  }
  return b;
}

std::vector<Measurement> best_both(const std::vector<Measurement>& results) {
  std::map<std::tuple<std::uint64_t, int, int, int>, std::pair<double, double>> by_point;
  for (const Measurement& m : results) {
    if (m.mixed) continue;
    auto& rw = by_point[{m.block_size, m.queue_depth, m.threads, m.paths}];
    (m.op == io::IoOp::kRead ? rw.first : rw.second) = m.mbps;
  }
  std::vector<Measurement> out;
  double best_score = -1;
  for (const auto& [key, rw] : by_point) {
    if (rw.first <= 0 || rw.second <= 0) continue;
    const double score = 2.0 / (1.0 / rw.first + 1.0 / rw.second);
    if (score > best_score) {
      best_score = score;
      Measurement m(io::IoOp::kRead, std::get<0>(key), std::get<1>(key), std::get<2>(key),
                    std::get<3>(key));
      m.mbps = score;
      out = {m};
    }
  }
  return out;
}

void describe_best(const char* label, const Measurement& m) {
  std::printf("best %s: block %s, queue depth %d, threads %d, paths %d: %.1f MB/s\n", label,
              format_bytes(m.block_size).c_str(), m.queue_depth, m.threads, m.paths, m.mbps);
}

// The chosen settings, and the bandwidth each direction measured at them (strata estimate's
// figures for the swap paths).
Status write_config(const BenchArgs& a, const Measurement& m, const std::vector<Measurement>& all,
                    const std::string& file) {
  Json j = {{"swap_paths", std::vector<std::string>(a.paths.begin(), a.paths.begin() + m.paths)},
            {"swap_engine", a.engine},
            {"swap_block_size", m.block_size},
            {"swap_queue_depth", m.queue_depth},
            {"swap_threads", m.threads}};
  for (const Measurement& r : all) {
    if (r.block_size != m.block_size || r.queue_depth != m.queue_depth || r.threads != m.threads ||
        r.paths != m.paths) {
      continue;
    }
    j[r.mixed                   ? "swap_mixed_bytes_per_s"
      : r.op == io::IoOp::kRead ? "swap_read_bytes_per_s"
                                : "swap_write_bytes_per_s"] = r.mbps * 1e6;
  }
  return write_json_file(file, j);
}

int run_io_bench(const BenchArgs& a) {
  auto plan = make_plan(a);
  if (!plan.is_ok()) {
    std::fprintf(stderr, "strata io-bench: %s\n", plan.status().message().c_str());
    return kExitUsage;
  }
  Sweep sw(a, *plan);
  const std::uint64_t max_block = plan->block_sizes.back();
  const int max_window = plan->queue_depths.back() * plan->threads.back();
  // Whole huge pages: a HostMapping's tail short of 2 MiB stays in 4 KiB pages, and a pool of
  // 8 x 128 KiB would be nothing but tail (reads into it ran at a fifth of the speed).
  const std::size_t pool_bytes = static_cast<std::size_t>(max_window) * max_block;
  sw.pool = sys::HostMapping(
      a.no_huge_pages ? pool_bytes : align_up(pool_bytes, sys::HostMapping::kHugePageBytes),
      !a.no_huge_pages);
  sw.source = std::make_unique<Source>(plan->size_bytes, max_block, !a.no_huge_pages);

  g_io_bench_stop.store(false);
  std::signal(SIGINT, on_io_bench_signal);
  std::signal(SIGTERM, on_io_bench_signal);
  if (!a.json) {
    std::printf(
        "strata io-bench: %s per run (sequential, O_DIRECT), %d run(s) per point, median "
        "shown\n",
        format_bytes(plan->size_bytes).c_str(), a.repeat);
    std::printf("%-6s %10s %5s %8s %6s %10s %9s %11s %9s\n", "op", "block", "qd", "threads",
                "paths", "MB/s", "seconds", "latency ms", "CPU s/GB");
  }
  for (int np : plan->num_paths) {
    for (int t : plan->threads) {
      for (std::uint64_t bs : plan->block_sizes) {
        for (int qd : plan->queue_depths) {
          const Status s = measure_point(sw, np, t, bs, qd);
          if (s.code() == StatusCode::kCancelled || g_io_bench_stop.load()) {
            std::fprintf(stderr, "strata io-bench: interrupted; benchmark files removed\n");
            return kExitInterrupted;
          }
          if (!s.is_ok()) {
            std::fprintf(stderr, "strata io-bench: %s\n", s.message().c_str());
            return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
          }
        }
      }
    }
  }

  const Measurement* best_read = best(sw.results, io::IoOp::kRead);
  const Measurement* best_write = best(sw.results, io::IoOp::kWrite);
  const std::vector<Measurement> both = best_both(sw.results);
  const Measurement* best_mixed = nullptr;
  for (const Measurement& m : sw.results) {
    if (m.mixed && (best_mixed == nullptr || m.mbps > best_mixed->mbps)) best_mixed = &m;
  }
  const Measurement* chosen = !both.empty() ? &both.front()
                              : best_read   ? best_read
                              : best_write  ? best_write
                                            : best_mixed;
  if (!a.json) {
    std::printf("engine: %s; buffers: %s, %s of %s in huge pages\n", sw.engine_used.c_str(),
                sw.registered ? "registered" : "not registered",
                format_bytes(sw.pool.huge_page_bytes() + sw.source->huge_page_bytes()).c_str(),
                format_bytes(sw.pool.size() + sw.source->span().size()).c_str());
    if (best_read) describe_best("read", *best_read);
    if (best_write) describe_best("write", *best_write);
    if (!both.empty()) describe_best("read+write (harmonic mean)", both.front());
    if (best_mixed) describe_best("mixed (each way)", *best_mixed);
  }
  if (!a.write_config.empty() && chosen != nullptr) {
    const Status s = write_config(a, *chosen, sw.results, a.write_config);
    if (!s.is_ok()) {
      std::fprintf(stderr, "strata io-bench: %s\n", s.message().c_str());
      return kExitError;
    }
    if (!a.json) std::printf("wrote the swap settings to %s\n", a.write_config.c_str());
  }
  return kExitOk;
}

}  // namespace

Runner add_io_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand(
      "io-bench", "Measure swap read/write bandwidth on your drives and find the best settings");
  cmd->add_option("--path", a->paths, "Swap directory to test, one per drive (repeatable)")
      ->required();
  cmd->add_option("--size", a->size, "Bytes per run, striped over the paths (default 1GiB)");
  cmd->add_option("--block-size", a->block_sizes, "Request sizes to sweep, e.g. 1MiB,8MiB")
      ->delimiter(',');
  cmd->add_option("--queue-depth", a->queue_depths, "Requests in flight per ring, e.g. 8,32")
      ->delimiter(',');
  cmd->add_option("--threads", a->threads, "io_uring rings (each with a thread), e.g. 1,2")
      ->delimiter(',');
  cmd->add_option("--num-paths", a->num_paths,
                  "How many of the --path directories to stripe over, e.g. 1,2 (default all)")
      ->delimiter(',');
  cmd->add_option("--op", a->op,
                  "read, write, both, mixed (reads and writes at once) or all (default both)");
  cmd->add_option("--engine", a->engine, "auto, uring or posix (default auto)")
      ->check(CLI::IsMember({"auto", "uring", "posix"}));
  cmd->add_option("--repeat", a->repeat, "Runs per point; the median is reported (default 1)");
  cmd->add_flag("--json", a->json, "One JSON object per measured point per line");
  cmd->add_flag("--verify-swap", a->verify_swap, "Measure with verify_swap checksums on");
  cmd->add_flag("--caller-driven", a->caller_driven, "Drive the rings from the callers' threads");
  cmd->add_flag("--sqpoll", a->sqpoll, "Use SQPOLL kernel threads for submission");
  cmd->add_flag("--no-register-buffers", a->no_register, "Do not register the staging buffers");
  cmd->add_flag("--no-huge-pages", a->no_huge_pages,
                "Keep the staging buffers in 4 KiB pages (as tools without huge pages do)");
  cmd->add_option("--write-config", a->write_config,
                  "Write the best settings as a config's swap section (JSON) to this file");
  return [a] { return run_io_bench(*a); };
}

}  // namespace strata::cli
