// The log: level and subsystem parsing, file-name expansion, the line prefix (with the rank of
// the calling thread), the filters, and whole lines in the file.
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/log.hh"
#include "support/env_scope.hh"
#include "support/temp_dir.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace {

using core::Level;
using core::Subsys;

std::string host() {
  char buffer[256] = {};
  EXPECT_EQ(gethostname(buffer, sizeof(buffer) - 1), 0);
  return buffer;
}

unsigned bits(std::initializer_list<Subsys> list) {
  unsigned m = 0;
  for (Subsys s : list) m |= static_cast<unsigned>(s);
  return m;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A fresh directory under the system's temporary one, removed at the end of the test.
using testing::TempDir;

TEST(LogLevel, NamesAliasesAndCase) {
  EXPECT_EQ(core::parse_level(""), Level::kOff);
  EXPECT_EQ(core::parse_level("0"), Level::kOff);
  EXPECT_EQ(core::parse_level("1"), Level::kInfo);
  EXPECT_EQ(core::parse_level("VERSION"), Level::kVersion);
  EXPECT_EQ(core::parse_level("version"), Level::kVersion);
  EXPECT_EQ(core::parse_level("Warn"), Level::kWarn);
  EXPECT_EQ(core::parse_level("info"), Level::kInfo);
  EXPECT_EQ(core::parse_level("INFO"), Level::kInfo);
  EXPECT_EQ(core::parse_level("tRaCe"), Level::kTrace);
}

TEST(LogLevel, BadValuesNameTheValueAndTheAcceptedOnes) {
  for (const char* bad : {"maybe", "2", "debug", " info", "yes"}) {
    try {
      core::parse_level(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("MOE_EP_DEBUG"), std::string::npos) << m;
      EXPECT_NE(m.find(fmt::format("\"{}\"", bad)), std::string::npos) << m;
      EXPECT_NE(m.find("accepted values are"), std::string::npos) << m;
      for (const char* name : {"version", "warn", "info", "trace"}) EXPECT_NE(m.find(name), std::string::npos) << m;
    }
  }
  // The registry refuses the same values, and accepts the levels in any case.
  EXPECT_THROW(env::ScopedOverride("MOE_EP_DEBUG", "maybe"), InvalidArgument);
  env::ScopedOverride trace("MOE_EP_DEBUG", "TRACE");
  EXPECT_EQ(env::get_string("MOE_EP_DEBUG"), "trace");
  env::ScopedOverride empty("MOE_EP_DEBUG", "");
  EXPECT_EQ(env::get_string("MOE_EP_DEBUG"), "");
}

TEST(LogSubsys, ListsExclusionAndAll) {
  const unsigned all = bits({Subsys::kInit, Subsys::kColl, Subsys::kP2P, Subsys::kNet, Subsys::kAlloc, Subsys::kEnv});
  EXPECT_EQ(core::kAllSubsys, all);
  EXPECT_EQ(core::parse_subsys(""), bits({Subsys::kInit, Subsys::kEnv}));  // the default
  EXPECT_EQ(core::parse_subsys("INIT"), bits({Subsys::kInit}));
  EXPECT_EQ(core::parse_subsys("coll,P2P"), bits({Subsys::kColl, Subsys::kP2P}));
  EXPECT_EQ(core::parse_subsys(" net , alloc "), bits({Subsys::kNet, Subsys::kAlloc}));
  EXPECT_EQ(core::parse_subsys("ALL"), all);
  EXPECT_EQ(core::parse_subsys("env,all"), all);
  EXPECT_EQ(core::parse_subsys("^INIT"), all & ~bits({Subsys::kInit}));
  EXPECT_EQ(core::parse_subsys("^INIT,env"), bits({Subsys::kColl, Subsys::kP2P, Subsys::kNet, Subsys::kAlloc}));
  EXPECT_EQ(core::parse_subsys("^ALL"), 0u);
  EXPECT_EQ(core::parse_subsys("^"), all);
  try {
    core::parse_subsys("INIT,FOO");
    ADD_FAILURE() << "FOO was accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("MOE_EP_DEBUG_SUBSYS=\"INIT,FOO\""), std::string::npos) << m;
    EXPECT_NE(m.find("\"FOO\" is not a subsystem"), std::string::npos) << m;
    EXPECT_NE(m.find("INIT, COLL, P2P, NET, ALLOC, ENV, ALL"), std::string::npos) << m;
  }
}

TEST(LogFile, HostAndPidAreExpanded) {
  const std::string h = host(), p = std::to_string(getpid());
  EXPECT_EQ(core::expand_file_name("/tmp/log.%h.%p"), "/tmp/log." + h + "." + p);
  EXPECT_EQ(core::expand_file_name("%p-%p"), p + "-" + p);
  EXPECT_EQ(core::expand_file_name("100%%h"), "100%h");
  EXPECT_EQ(core::expand_file_name("a%q%"), "a%q%");
  EXPECT_EQ(core::expand_file_name("plain"), "plain");
}

std::string expected_prefix(const std::string& rank) {
  return fmt::format("{}:{}:{} [{}] moe-ep", host(), getpid(), static_cast<long>(syscall(SYS_gettid)), rank);
}

TEST(LogPrefix, NamesHostPidThreadAndTheThreadsRank) {
  std::string with_rank, without_rank, expect_with, expect_without, after_scope;
  std::thread([&] {
    expect_without = expected_prefix("-");
    without_rank = core::line_prefix();
    {
      core::ScopedThreadRank rank(3);
      expect_with = expected_prefix("3");
      with_rank = core::line_prefix();
    }
    after_scope = core::line_prefix();
  }).join();
  EXPECT_EQ(without_rank, expect_without);
  EXPECT_EQ(with_rank, expect_with);
  EXPECT_EQ(after_scope, expect_without);
  // Ranks as threads of one process: each thread shows its own.
  std::vector<std::string> got(4), want(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([&, r] {
      core::ScopedThreadRank rank(r);
      want[static_cast<size_t>(r)] = expected_prefix(std::to_string(r));
      got[static_cast<size_t>(r)] = core::line_prefix();
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(got, want);
  // A process rank shows where the thread has none; a thread's rank wins.
  core::set_process_rank(5);
  std::thread([&] {
    EXPECT_EQ(core::line_prefix(), expected_prefix("5"));
    core::ScopedThreadRank rank(1);
    EXPECT_EQ(core::line_prefix(), expected_prefix("1"));
  }).join();
  core::set_process_rank(-1);
}

TEST(LogFilter, LevelsAndSubsystems) {
  {
    env::ScopedOverride off("MOE_EP_DEBUG", "0");
    EXPECT_FALSE(core::enabled(Level::kWarn, Subsys::kInit));
  }
  {
    env::ScopedOverride version("MOE_EP_DEBUG", "version");
    env::ScopedOverride file("MOE_EP_DEBUG_FILE", "/dev/null");
    EXPECT_FALSE(core::enabled(Level::kWarn, Subsys::kInit));
  }
  env::ScopedOverride file("MOE_EP_DEBUG_FILE", "/dev/null");
  {
    env::ScopedOverride warn("MOE_EP_DEBUG", "WARN");
    EXPECT_TRUE(core::enabled(Level::kWarn, Subsys::kColl));  // WARN lines are never filtered
    EXPECT_FALSE(core::enabled(Level::kInfo, Subsys::kInit));
  }
  {
    env::ScopedOverride info("MOE_EP_DEBUG", "1");
    EXPECT_TRUE(core::enabled(Level::kInfo, Subsys::kInit));  // the default INIT,ENV
    EXPECT_TRUE(core::enabled(Level::kInfo, Subsys::kEnv));
    EXPECT_FALSE(core::enabled(Level::kInfo, Subsys::kColl));
    EXPECT_FALSE(core::enabled(Level::kTrace, Subsys::kInit));
  }
  {
    env::ScopedOverride trace("MOE_EP_DEBUG", "trace");
    env::ScopedOverride subsys("MOE_EP_DEBUG_SUBSYS", "^INIT");
    EXPECT_FALSE(core::enabled(Level::kInfo, Subsys::kInit));
    EXPECT_TRUE(core::enabled(Level::kWarn, Subsys::kInit));
    EXPECT_TRUE(core::enabled(Level::kTrace, Subsys::kColl));
    EXPECT_TRUE(core::enabled(Level::kInfo, Subsys::kAlloc));
  }
}

TEST(LogOutput, WholeLinesAfterTheVersionLine) {
  TempDir dir("moe-ep-log");
  const std::string pattern = (dir.path() / "log.%h.%p").string();
  const std::string path = (dir.path() / fmt::format("log.{}.{}", host(), getpid())).string();
  {
    env::ScopedOverride level("MOE_EP_DEBUG", "INFO");
    env::ScopedOverride subsys("MOE_EP_DEBUG_SUBSYS", "INIT,COLL");
    env::ScopedOverride file("MOE_EP_DEBUG_FILE", pattern);
    core::info(Subsys::kInit, "first {}", 1);
    core::info(Subsys::kNet, "filtered out");
    core::trace(Subsys::kColl, "below the level");
    core::warn(Subsys::kNet, "a warning");
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r)
      threads.emplace_back([r] {
        core::ScopedThreadRank rank(r);
        for (int i = 0; i < 50; ++i) core::info(Subsys::kColl, "rank {} line {} {}", r, i, std::string(200, 'x'));
      });
    for (auto& t : threads) t.join();
  }
  const std::vector<std::string> lines = lines_of(path);
  ASSERT_EQ(lines.size(), 3u + 200u) << "version, two lines, 200 lines of the threads";
  const std::string who = fmt::format("{}:{}:[0-9]+ \\[-\\] moe-ep ", host(), getpid());
  EXPECT_TRUE(std::regex_match(lines[0], std::regex(who + "version " + MOE_EP_EXPECTED_VERSION))) << lines[0];
  EXPECT_TRUE(std::regex_match(lines[1], std::regex(who + "INFO INIT first 1"))) << lines[1];
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(who + "WARN NET a warning"))) << lines[2];
  std::set<std::string> seen;
  const std::regex rank_line(
      fmt::format("{}:{}:[0-9]+ \\[([0-3])\\] moe-ep INFO COLL rank ([0-3]) line ([0-9]+) x{{200}}", host(), getpid()));
  for (std::size_t i = 3; i < lines.size(); ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[i], m, rank_line)) << lines[i];
    EXPECT_EQ(m[1], m[2]) << "the prefix shows the writing thread's rank";
    seen.insert(m[2].str() + ":" + m[3].str());
  }
  EXPECT_EQ(seen.size(), 200u);
}

TEST(LogOutput, AFileThatCannotBeOpenedLeavesStderr) {
  TempDir dir("moe-ep-log");
  const std::string pattern = (dir.path() / "missing" / "log.%p").string();
  ::testing::internal::CaptureStderr();
  {
    env::ScopedOverride level("MOE_EP_DEBUG", "WARN");
    env::ScopedOverride file("MOE_EP_DEBUG_FILE", pattern);
    core::warn(Subsys::kAlloc, "still seen");
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("WARN ENV MOE_EP_DEBUG_FILE=\"" + pattern + "\": cannot open"), std::string::npos) << err;
  EXPECT_NE(err.find("logging to stderr"), std::string::npos) << err;
  EXPECT_NE(err.find("WARN ALLOC still seen"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "missing"));
}

TEST(LogOutput, BadSubsystemsWarnAndTheDefaultApplies) {
  ::testing::internal::CaptureStderr();
  {
    // From the environment (an override of a bad value is refused when made); the level's override
    // then makes the log read its settings again.
    testing::ScopedEnvironment subsys("MOE_EP_DEBUG_SUBSYS", "INIT,BOGUS");
    env::ScopedOverride level("MOE_EP_DEBUG", "INFO");
    EXPECT_TRUE(core::enabled(Level::kInfo, Subsys::kInit));
    EXPECT_TRUE(core::enabled(Level::kInfo, Subsys::kEnv));
    EXPECT_FALSE(core::enabled(Level::kInfo, Subsys::kColl));
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("MOE_EP_DEBUG_SUBSYS=\"INIT,BOGUS\" is invalid: \"BOGUS\" is not a subsystem"), std::string::npos)
      << err;
  EXPECT_NE(err.find("the default INIT,ENV applies"), std::string::npos) << err;
}

}  // namespace
}  // namespace moe_ep
