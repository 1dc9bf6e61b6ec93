// A cluster of network-namespace nodes (tools/cluster.sh) for the tests of what crosses a
// network: brought up with a name and subnet of the tests' own, taken down when the test ends,
// whatever happened; skipped with the harness's reason where this machine cannot make one.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"

namespace strata::testing {

inline const std::string kClusterName = "stratat";
inline const std::string kClusterSubnet = "10.214.0";

// `cmd`'s standard output and error together, and its exit code.
struct Output {
  int rc = -1;
  std::string text;
};
inline Output capture(const std::string& cmd) {
  Output o;
  FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return o;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) o.text += buf;
  const int status = ::pclose(pipe);
  o.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return o;
}

class Cluster {
 public:
  explicit Cluster(const TempDir& dir) : dir_(dir.file("cluster")) {}
  ~Cluster() { down(); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // tools/cluster.sh with this cluster's name, subnet and folder.
  std::string tool(const std::string& args) const {
    return "STRATA_CLUSTER_NAME=" + kClusterName + " STRATA_CLUSTER_SUBNET=" + kClusterSubnet +
           " STRATA_CLUSTER_DIR=" + dir_ + " " + STRATA_SOURCE_DIR + "/tools/cluster.sh " + args;
  }
  // Why this machine cannot make a cluster, or "".
  std::string why_not() const {
    const Output o = capture(tool("check"));
    return o.rc == 0 ? "" : o.text;
  }
  Output up(const std::string& args) const { return capture(tool("up " + args)); }
  void down() const { capture(tool("down")); }
  Output bytes() const { return capture(tool("bytes")); }
  // What each node has sent on its link so far.
  std::map<int, double> sent() const {
    std::map<int, double> out;
    std::istringstream in(bytes().text);
    std::string line;
    static const std::regex re(R"(node (\d+) \S+ sent (\d+) received (\d+))");
    while (std::getline(in, line)) {
      std::smatch m;
      if (std::regex_search(line, m, re)) out[std::stoi(m[1])] = std::stod(m[2]);
    }
    return out;
  }
  const std::string& dir() const { return dir_; }
  std::string hostfile() const { return dir_ + "/hostfile"; }
  std::string drive() const { return dir_ + "/drive"; }
  std::string node_drive(int node) const {
    return dir_ + "/node" + std::to_string(node) + "/drive";
  }
  // mpirun over the cluster's nodes, ranks filling each node's slots in turn (or `map`).
  std::string mpirun(const TempDir& session, int np, const std::string& map = "slot") const {
    return "OMPI_MCA_orte_tmpdir_base=" + session.path() + " " + tool("run") +
           " mpirun --hostfile " + hostfile() + " --map-by " + map + " --bind-to none -np " +
           std::to_string(np) + " ";
  }

 private:
  std::string dir_;
};

// Skips the test where the cluster cannot be made (not root, no namespaces), with the reason.
#define STRATA_SKIP_WITHOUT_CLUSTER(cluster)                                            \
  do {                                                                                  \
    if (const std::string why = (cluster).why_not(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

}  // namespace strata::testing
