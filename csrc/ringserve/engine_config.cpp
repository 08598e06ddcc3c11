#include "ringserve/engine_config.h"

#include <stdexcept>
#include <string>

#include "ringserve/records.h"

namespace ringserve {

void check_scheduler_config(EngineConfig& config) {
  if (config.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
  if (config.max_num_seqs <= 0) throw std::invalid_argument("max_num_seqs must be > 0");
  if (config.max_num_batched_tokens <= 0) throw std::invalid_argument("max_num_batched_tokens must be > 0");
  if (config.num_blocks <= 0) throw std::invalid_argument("num_blocks must be > 0");
  if (config.long_prefill_token_threshold < 0) throw std::invalid_argument("long_prefill_token_threshold must be >= 0");
  if (config.priority_aging_ms < 0) throw std::invalid_argument("priority_aging_ms must be >= 0");
  if (config.num_speculative_tokens < 0 || config.num_speculative_tokens > kMaxLookaheadSlots) {
    throw std::invalid_argument("num_speculative_tokens must be in [0, " + std::to_string(kMaxLookaheadSlots) + "]");
  }
  if (config.spec_max_batch < 0) throw std::invalid_argument("spec_max_batch must be >= 0");
  if (config.spec_backoff_steps < 0) throw std::invalid_argument("spec_backoff_steps must be >= 0");
  if (!(config.max_step_slowdown == 0.0f || config.max_step_slowdown >= 1.0f)) {
    throw std::invalid_argument("max_step_slowdown must be 0 (off) or >= 1");
  }
  if (config.max_model_len <= 0) config.max_model_len = config.num_blocks * config.block_size;
}

}  // namespace ringserve
