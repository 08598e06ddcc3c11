// Online estimate of an engine step's wall time from the tokens it computes: time = fixed + per_token x tokens,
// fitted by least squares to the engine's recent measured steps. The scheduler uses it to keep prefill chunks from
// slowing running streams down by more than a configured factor (EngineConfig::max_step_slowdown).
//
// Steps come in two kinds: decode-only ones (one token per scheduled request) pin down the fixed cost at the usual
// batch size, and steps with prefill chunks (or drafts) give the per-token slope. Each kind keeps its own ring of
// recent observations, so a long stretch of decoding does not push the slope out of the fit.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace ringserve {

class StepCostModel {
 public:
  static constexpr size_t kWindow = 32;  // observations kept per kind

  // A finished step: `tokens` computed in `rows` scheduled requests, in `ns` from plan to result.
  void observe(int32_t tokens, int32_t rows, int64_t ns);

  // The most tokens a step may carry so that its estimated time stays within `slowdown` x the estimate for a step
  // of `base_tokens` tokens; -1 while there is no estimate (too few observations, or no spread in their sizes).
  int32_t token_limit(int32_t base_tokens, double slowdown) const;

  bool fitted() const { return fitted_; }
  double fixed_ns() const { return fixed_ns_; }
  double per_token_ns() const { return per_token_ns_; }

 private:
  struct Observation {
    double tokens = 0;
    double ns = 0;
  };
  struct Ring {
    std::array<Observation, kWindow> items{};
    size_t size = 0;
    size_t next = 0;
    void push(Observation o);
  };
  void refit();

  Ring decode_;
  Ring mixed_;
  bool fitted_ = false;
  double fixed_ns_ = 0;
  double per_token_ns_ = 0;
};

}  // namespace ringserve
