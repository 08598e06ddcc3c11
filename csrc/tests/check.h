// A tiny test harness: CHECK(cond) records a failure and continues; TEST(name) registers a test; main() runs them.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace ringserve::testing {

struct TestCase {
  const char* name;
  std::function<void()> body;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline int& failures() {
  static int count = 0;
  return count;
}

struct Register {
  Register(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

inline int run_all() {
  for (const TestCase& t : registry()) {
    const int before = failures();
    try {
      t.body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "  %s: unexpected exception: %s\n", t.name, e.what());
      ++failures();
    }
    std::fprintf(stderr, "[%s] %s\n", failures() == before ? " OK " : "FAIL", t.name);
  }
  std::fprintf(stderr, "%d failure(s)\n", failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace ringserve::testing

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
      ++::ringserve::testing::failures();                                               \
    }                                                                                   \
  } while (0)

// The statement must throw an exception of type `type` (or a subclass).
#define CHECK_THROWS(type, ...)                                                                    \
  do {                                                                                             \
    bool thrown_ = false;                                                                          \
    try {                                                                                          \
      __VA_ARGS__;                                                                                 \
    } catch (const type&) {                                                                        \
      thrown_ = true;                                                                              \
    }                                                                                              \
    if (!thrown_) {                                                                                \
      std::fprintf(stderr, "  %s:%d: expected %s from: %s\n", __FILE__, __LINE__, #type, #__VA_ARGS__);  \
      ++::ringserve::testing::failures();                                                          \
    }                                                                                              \
  } while (0)

#define RS_CONCAT2(a, b) a##b
#define RS_CONCAT(a, b) RS_CONCAT2(a, b)
#define TEST(name)                                                                         \
  static void name();                                                                      \
  static ::ringserve::testing::Register RS_CONCAT(register_, name)(#name, name);           \
  static void name()

#define TEST_MAIN() \
  int main() { return ::ringserve::testing::run_all(); }
