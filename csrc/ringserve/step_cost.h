// Online estimate of what prefill work adds to an engine step's wall time, for the decode-latency guard
// (EngineConfig::max_step_slowdown): while requests decode, the scheduler gives a step's prefill rows only as much
// estimated time as (max_step_slowdown - 1) x a decode-only step with as many decodes.
//
// - The base: the median wall time of the last 32 decode-only steps (a median, so one slow step on a shared machine
//   does not move it), taken at the median of their decode rows.
// - The rest is fitted, through the origin, to what each recent step took beyond the base: per_token x prefill tokens
//   + per_pair x prefill attention pairs + per_context x context tokens + per_decode x (its decode rows - the base's).
//   A row computing n tokens after `start` computed ones attends over n x (start + n) query-key pairs and reads the KV
//   of its start + n context tokens once per layer, so a chunk deep into a long prompt costs more than the first one,
//   and even a small one deep into it costs its context (with no context term, small deep chunks were
//   underestimated). The decode term matters under load: while requests keep arriving, nearly every step prefills,
//   decode-only steps become rare and the base stays where it was when few requests ran; without the term the time
//   that 48 decodes take beyond 1 was charged to the prefill tokens beside them, the guard let each step prefill only
//   its floor, and the queue of waiting prompts grew without end (benchmarks/serve.py, 48 streams: the first token
//   after 23 s).
//   The fit is a non-negative least squares: of the sets of terms with tokens that the data determine and that come
//   out non-negative, the one with the smallest residual. Decode rows that did not vary (a steady batch) determine no
//   decode term, and the model is then what it was without one.
// Each kind of step keeps its own ring of recent observations, so a long stretch of decoding does not push the prefill
// costs out of the fit, and the fit follows the machine when its speed changes.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

namespace ringserve {

// Query-key pairs of a row computing `n` tokens after `start` already computed ones.
inline double attention_pairs(int32_t start, int32_t n) {
  return static_cast<double>(n) * (static_cast<double>(start) + static_cast<double>(n));
}

// What one step computed, as the guard's cost model sees it.
struct StepShape {
  int32_t decode_rows = 0;     // one-token rows
  int32_t prefill_tokens = 0;  // tokens of the rows computing more than one prompt token (and of admissions)
  double prefill_pairs = 0;    // their attention pairs
  double prefill_context = 0;  // their context tokens (start + n per row)
};

class StepCostModel {
 public:
  static constexpr size_t kWindow = 32;  // observations kept per kind

  // A finished step and its wall time from plan to result.
  void observe(const StepShape& step, int64_t ns);

  bool fitted() const { return fitted_; }
  double base_ns() const { return base_ns_; }  // a decode-only step of base_decode_rows() decodes
  double base_decode_rows() const { return base_rows_; }
  double per_decode_ns() const { return per_decode_ns_; }
  // A decode-only step of `decode_rows` decodes (fitted() must hold); never below a tenth of the base.
  double base_ns(int32_t decode_rows) const {
    return std::max(0.1 * base_ns_, base_ns_ + per_decode_ns_ * (static_cast<double>(decode_rows) - base_rows_));
  }
  double per_token_ns() const { return per_token_ns_; }
  double per_pair_ns() const { return per_pair_ns_; }
  double per_context_ns() const { return per_context_ns_; }

  // What a prefill row of `n` tokens after `start` computed ones adds to a step (fitted() must hold).
  double row_ns(int32_t start, int32_t n) const {
    return per_token_ns_ * static_cast<double>(n) + per_pair_ns_ * attention_pairs(start, n) +
           per_context_ns_ * (static_cast<double>(start) + static_cast<double>(n));
  }
  // The most tokens a prefill row starting at `start` may compute within `ns` (0 when none fit or not fitted).
  int32_t max_tokens_within(int32_t start, double ns) const;

 private:
  struct Decode {
    double rows = 0;
    double ns = 0;
  };
  struct Prefill {
    double decode_rows = 0;
    double tokens = 0;
    double pairs = 0;
    double context = 0;
    double ns = 0;  // the whole step: its extra is taken against the base at fit time
  };
  template <class T>
  struct Ring {
    std::array<T, kWindow> items{};
    size_t size = 0;
    size_t next = 0;
    void push(T item) {
      items[next] = item;
      next = (next + 1) % kWindow;
      if (size < kWindow) ++size;
    }
  };
  void refit_base();
  void refit_prefill();

  Ring<Decode> decode_;
  Ring<Prefill> prefill_;
  bool has_base_ = false;
  bool fitted_ = false;
  double base_ns_ = 0;
  double base_rows_ = 0;
  double per_decode_ns_ = 0;
  double per_token_ns_ = 0;
  double per_pair_ns_ = 0;
  double per_context_ns_ = 0;
};

}  // namespace ringserve
