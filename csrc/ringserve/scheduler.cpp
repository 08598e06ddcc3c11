#include "ringserve/scheduler.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace ringserve {
namespace {

// How many requests ahead the per-request loops prefetch a request's state.
constexpr size_t kPrefetchAhead = 8;

// Output tokens whose storage add_request() touches up front (32 KiB).
constexpr int64_t kPrefaultedOutputTokens = 8192;

// Fixed bytes of a StepPlan record and per entry, used to keep a plan under the ring's record size.
constexpr size_t kPlanFixedBytes = 64;
constexpr size_t kPlanBytesPerScheduled = 4 + 4 + 4 + 1 + 4;  // + sched_lookahead
constexpr size_t kPlanBytesPerTrim = 4 + 4;
constexpr size_t kPlanBytesPerAppend = 8;
constexpr size_t kPlanBytesPerNewRequest = 128;  // NewRequestData fixed fields and array counts, rounded up

bool contains(const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }


// splitmix64's finalizer: a bijective 64-bit mix.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The ids that end a request: the first two sit in its hot line, the rest (rare) in its details' suppress_token_ids
// (`details` is its entry there, addressed only then).
[[gnu::always_inline]] inline bool is_stop_token(const RequestState& r, const RequestDetails* details, int32_t token) {
  if (r.num_stop_ids == 0) return false;
  if (token == r.stop_ids[0] || (r.num_stop_ids > 1 && token == r.stop_ids[1])) return true;
  return r.num_stop_ids > 2 && contains(details->suppress_token_ids, token);
}

// Below min_tokens only the length limits apply (the sampler masks EOS and stop ids meanwhile).
// length_limit = min(prompt + max_tokens, max_model_len); stop_check_from = prompt + min_tokens.
[[gnu::always_inline]] inline FinishReason stop_reason(const RequestState& r, const RequestDetails* details,
                                                        int32_t token) {
  const int32_t n = r.num_tokens();
  if (n >= r.stop_check_from && is_stop_token(r, details, token)) return FinishReason::kStop;
  return n >= r.length_limit ? FinishReason::kLength : FinishReason::kNone;
}

// Every field written once (no value-initialization first): this runs for every scheduled request in every step.
[[gnu::always_inline]] inline PackedOutput make_output(const RequestState& r, FinishReason reason, int32_t num_scheduled,
                                                       bool has_token, int32_t token, float logprob) {
  return PackedOutput{
      .request_id = r.request_id,
      .arrival_time_ns = r.arrival_time_ns,
      .first_scheduled_time_ns = r.first_scheduled_time_ns,
      .first_token_time_ns = r.first_token_time_ns,
      .num_prompt_tokens = static_cast<uint32_t>(r.num_prompt_tokens),
      .num_cached_tokens = r.num_cached_tokens,
      // Prompt progress; a sampled token means the whole prompt is computed.
      .num_computed_tokens =
          static_cast<uint32_t>(has_token ? r.num_prompt_tokens : std::min(r.num_computed_tokens, r.num_prompt_tokens)),
      .num_scheduled_tokens = static_cast<uint32_t>(num_scheduled),
      .token_id = token,
      .logprob = logprob,
      .num_preemptions = r.num_preemptions,
      .num_spec_proposed_tokens = 0,
      .num_spec_accepted_tokens = 0,
      .finish_reason = reason,
      .has_token = has_token,
      .num_top = 0,
  };
}

// Takes an element with storage from `spare` (or a new one) onto the back of `v`.
template <class T>
T& reuse_back(std::vector<T>& v, std::vector<T>& spare) {
  if (spare.empty()) return v.emplace_back();
  v.push_back(std::move(spare.back()));
  spare.pop_back();
  return v.back();
}

template <class T>
void recycle(std::vector<T>& v, std::vector<T>& spare) {
  for (T& x : v) spare.push_back(std::move(x));
  v.clear();
}

}  // namespace

uint64_t block_hash(uint64_t parent, bool is_first, uint64_t cache_salt, std::span<const int32_t> tokens) {
  // The salt seeds the chain's root, so requests with different salts never share a block.
  const uint64_t chain = is_first ? mix64(cache_salt ^ 0x243f6a8885a308d3ull) : parent;
  // Two tokens at a time as one 64-bit word (their bits as stored: an injective packing), each word keyed by its
  // position and folded with one 64x64->128-bit multiply; the products are independent (they overlap in the
  // pipeline instead of forming a serial chain) and their sum joins the chain through a full mix. A decode step that
  // completes a block pays for this, so it is kept to a few instructions per token.
  uint64_t sum = tokens.size();
  uint64_t key = 0x9e3779b97f4a7c15ull;
  size_t i = 0;
#pragma GCC unroll 8
  for (; i + 1 < tokens.size(); i += 2, key += 0x9e3779b97f4a7c15ull) {
    uint64_t word;
    std::memcpy(&word, &tokens[i], sizeof(word));
    const unsigned __int128 product = static_cast<unsigned __int128>(word ^ key) * 0xd6e8feb86659fd93ull;
    sum += static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  if (i < tokens.size()) {
    const uint64_t word = uint64_t{static_cast<uint32_t>(tokens[i])} | (uint64_t{1} << 63);  // an odd last token
    const unsigned __int128 product = static_cast<unsigned __int128>(word ^ key) * 0xd6e8feb86659fd93ull;
    sum += static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  return mix64(chain ^ mix64(sum));
}

Scheduler::Scheduler(EngineConfig config, size_t max_plan_bytes)
    : config_(std::move(config)), max_plan_bytes_(max_plan_bytes), pool_(config_.num_blocks) {
  if (config_.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
  if (config_.max_num_seqs <= 0) throw std::invalid_argument("max_num_seqs must be > 0");
  if (config_.max_num_batched_tokens <= 0) throw std::invalid_argument("max_num_batched_tokens must be > 0");
  if (config_.num_blocks <= 0) throw std::invalid_argument("num_blocks must be > 0");
  if (config_.long_prefill_token_threshold < 0) throw std::invalid_argument("long_prefill_token_threshold must be >= 0");
  if (config_.priority_aging_ms < 0) throw std::invalid_argument("priority_aging_ms must be >= 0");
  if (config_.num_speculative_tokens < 0 || config_.num_speculative_tokens > kMaxLookaheadSlots) {
    throw std::invalid_argument("num_speculative_tokens must be in [0, " + std::to_string(kMaxLookaheadSlots) + "]");
  }
  if (config_.spec_max_batch < 0) throw std::invalid_argument("spec_max_batch must be >= 0");
  if (config_.spec_backoff_steps < 0) throw std::invalid_argument("spec_backoff_steps must be >= 0");
  if (!(config_.max_step_slowdown == 0.0f || config_.max_step_slowdown >= 1.0f)) {
    throw std::invalid_argument("max_step_slowdown must be 0 (off) or >= 1");
  }
  if (config_.max_model_len <= 0) config_.max_model_len = config_.num_blocks * config_.block_size;
  const auto seqs = static_cast<size_t>(config_.max_num_seqs);
  for (int32_t s = config_.max_num_seqs - 1; s >= 0; --s) free_slots_.push_back(s);  // hand out slot 0 first
  slot_owner_.assign(seqs, -1);
  sample_mark_.assign(seqs, SampleMark{});
  sampled_slots_.reserve(seqs);
  running_.reserve(seqs);
  for (auto* a : {&in_flight_.slot, &in_flight_.start, &in_flight_.len, &in_flight_.lookahead, &in_flight_.sample,
                  &in_flight_.result}) {
    a->assign(seqs, 0);
  }
  in_flight_.index.assign(seqs + 2 * kPrefetchAhead, 0);  // + the padding update()'s prefetches read
  released_slots_.reserve(seqs);
  outputs_.reserve(seqs);
  static_assert(sizeof(PackedOutput) == 64, "a packed output is one cache line");
  spare_appends_.reserve(seqs);
  hits_.reserve(static_cast<size_t>(config_.num_blocks));
  pending_cache_.reserve(static_cast<size_t>(config_.num_blocks));
  finished_.reserve(seqs);
  registering_.reserve(seqs);
  row_offsets_.reserve(seqs + 1);
  trimming_.reserve(seqs);
  pending_trim_slots_.reserve(seqs);
  pending_trim_blocks_.reserve(seqs);
}

RequestRejected Scheduler::reject(uint64_t id, uint32_t code, std::string message) const {
  return RequestRejected{id, code, std::move(message)};
}

bool Scheduler::runs_before(int32_t a, int32_t b) const {
  const RequestDetails& x = details_[static_cast<size_t>(a)];
  const RequestDetails& y = details_[static_cast<size_t>(b)];
  if (x.rank != y.rank) return x.rank < y.rank;
  return x.arrival_seq < y.arrival_seq;
}

int64_t Scheduler::rank_of(int32_t priority, int64_t now_ns) {
  if (config_.priority_aging_ms == 0) return priority;
  // Comparing priority - waited / A across requests at any instant equals comparing priority x A + arrival, a key
  // fixed at arrival: the sorted queues stay sorted as time passes. Saturating, for extreme priorities.
  arrival_clock_ = std::max(arrival_clock_, now_ns);
  const int64_t aging_ns = int64_t{config_.priority_aging_ms} * 1'000'000;
  int64_t rank;
  if (__builtin_mul_overflow(int64_t{priority}, aging_ns, &rank) ||
      __builtin_add_overflow(rank, arrival_clock_, &rank)) {
    rank = priority < 0 ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
  }
  return rank;
}

void Scheduler::insert_waiting(int32_t index) {
  // waiting_ is sorted last-to-run first, so the next to admit is waiting_.back().
  const auto at = std::partition_point(waiting_.begin(), waiting_.end(),
                                       [&](int32_t w) { return runs_before(index, w); });
  waiting_.insert(at, index);
}

void Scheduler::insert_running(int32_t index) {
  const auto at = std::partition_point(running_.begin(), running_.end(),
                                       [&](int32_t r) { return runs_before(r, index); });
  running_.insert(at, index);
}

std::optional<RequestRejected> Scheduler::check_kv_options(const AddRequest& req, const KvRequestOptions& kv) const {
  const uint64_t id = req.request_id;
  if (kv.mode == KvMode::kPrefillOnly && kv.pin_timeout_ms == 0) {
    return reject(id, kStatusInvalidArgument, "a prefill-only request needs pin_timeout_ms > 0");
  }
  if (kv.mode != KvMode::kPullRemote) return std::nullopt;
  const auto prompt_blocks = static_cast<size_t>(blocks_for(static_cast<int32_t>(req.prompt_token_ids.size())));
  if (kv.remote_block_ids.size() != prompt_blocks) {
    return reject(id, kStatusInvalidArgument,
                  "remote_block_ids has " + std::to_string(kv.remote_block_ids.size()) + " blocks, the prompt needs " +
                      std::to_string(prompt_blocks));
  }
  if (req.max_tokens < 2) {
    return reject(id, kStatusInvalidArgument, "a request continuing from remote KV needs max_tokens >= 2");
  }
  if (kv.first_token_id < 0) return reject(id, kStatusInvalidArgument, "first_token_id is negative");
  if (kv.peer.empty()) return reject(id, kStatusInvalidArgument, "a remote KV pull needs the source's peer info");
  for (const int32_t b : kv.remote_block_ids) {
    if (b < 0) return reject(id, kStatusInvalidArgument, "remote block id " + std::to_string(b) + " is negative");
  }
  if (kPlanFixedBytes + kv.peer.size() + 2 * prompt_blocks * sizeof(int32_t) > max_plan_bytes_) {
    return reject(id, kStatusResourceExhausted, "the KV pull of this request exceeds the step ring's record limit");
  }
  return std::nullopt;
}

std::optional<RequestRejected> Scheduler::add_request(const AddRequest& req, int64_t now_ns,
                                                      const KvRequestOptions* kv) {
  const uint64_t id = req.request_id;
  if (req.prompt_token_ids.empty()) return reject(id, kStatusInvalidArgument, "prompt is empty");
  if (req.max_tokens < 1) {
    return reject(id, kStatusInvalidArgument, "max_tokens must be >= 1, got " + std::to_string(req.max_tokens));
  }
  if (req.sampling.min_tokens < 0 || req.sampling.min_tokens > req.max_tokens) {
    return reject(id, kStatusInvalidArgument,
                  "min_tokens must be in [0, max_tokens], got " + std::to_string(req.sampling.min_tokens));
  }
  if (req.sampling.num_logprobs < 0) {
    return reject(id, kStatusInvalidArgument,
                  "num_logprobs must be >= 0, got " + std::to_string(req.sampling.num_logprobs));
  }
  for (const int32_t t : req.prompt_token_ids) {
    if (t < 0) return reject(id, kStatusInvalidArgument, "prompt token id " + std::to_string(t) + " is negative");
  }
  if (index_of_.contains(id)) {
    return reject(id, kStatusInvalidArgument, "request id " + std::to_string(id) + " is already active");
  }
  if (kv != nullptr) {
    if (auto rejected = check_kv_options(req, *kv)) return rejected;
  }
  const int64_t prompt = static_cast<int64_t>(req.prompt_token_ids.size());
  const int64_t total = prompt + req.max_tokens;
  const std::string need = "request needs " + std::to_string(total) + " tokens (prompt " + std::to_string(prompt) +
                           " + max_tokens " + std::to_string(req.max_tokens) + ")";
  if (total > config_.max_model_len) {
    return reject(id, kStatusResourceExhausted, need + " but max_model_len is " + std::to_string(config_.max_model_len));
  }
  const int64_t blocks = (total + config_.block_size - 1) / config_.block_size;
  if (blocks > config_.num_blocks) {
    return reject(id, kStatusResourceExhausted,
                  need + " but the KV cache holds only " +
                      std::to_string(int64_t{config_.num_blocks} * config_.block_size) + " tokens");
  }
  const size_t suppress = config_.eos_token_ids.size() + req.stop_token_ids.size();
  if (kPlanFixedBytes + kPlanBytesPerNewRequest + static_cast<size_t>(total + blocks) * sizeof(int32_t) +
          suppress * sizeof(int32_t) > max_plan_bytes_) {
    return reject(id, kStatusResourceExhausted, need + " but a step plan carrying it exceeds the step ring's " +
                                                    std::to_string(max_plan_bytes_) + "-byte record limit");
  }

  int32_t index;
  if (!free_entries_.empty()) {
    index = free_entries_.back();
    free_entries_.pop_back();
  } else {
    index = static_cast<int32_t>(table_.size());
    table_.emplace_back();
    details_.emplace_back();
  }
  RequestState& r = table_[static_cast<size_t>(index)];
  RequestDetails& d = details_[static_cast<size_t>(index)];
  r.request_id = id;
  r.status = RequestStatus::kWaiting;
  r.slot = -1;
  r.num_prompt_tokens = static_cast<int32_t>(prompt);
  r.num_computed_tokens = 0;
  r.num_cached_tokens = 0;
  r.admitted = false;
  set_registered_blocks(r, 0);
  r.num_preemptions = 0;
  r.length_limit = static_cast<int32_t>(std::min<int64_t>(total, config_.max_model_len));
  r.stop_check_from = static_cast<int32_t>(prompt) + req.sampling.min_tokens;
  d.rank = rank_of(req.priority, now_ns);
  d.arrival_seq = next_arrival_seq_++;
  r.token_ids.reserve(static_cast<size_t>(total));  // no reallocation while generating
  // Writing the capacity once faults its pages in now: a decode step appending into fresh memory would otherwise
  // stop on a page fault (clearing a page) whenever a request's tokens cross into a new page. Bounded, so a huge
  // max_tokens does not commit memory the request may never use (later pages fault once per 1,024 tokens).
  r.token_ids.resize(static_cast<size_t>(std::min<int64_t>(total, prompt + kPrefaultedOutputTokens)));
  r.token_ids.assign(req.prompt_token_ids.begin(), req.prompt_token_ids.end());
  r.block_ids.clear();
  r.block_ids.reserve(static_cast<size_t>(blocks));
  d.block_hashes.clear();
  d.block_hashes.reserve(static_cast<size_t>(blocks));
  d.max_tokens = req.max_tokens;
  d.sampling = req.sampling;
  d.ignore_eos = req.ignore_eos;
  d.priority = req.priority;
  d.cache_salt = req.cache_salt;
  d.stop_token_ids = req.stop_token_ids;
  d.spec_acceptance = 1.0f;
  d.spec_backoff = 0;
  d.spec_proposed_tokens = 0;
  d.spec_accepted_tokens = 0;
  d.suppress_token_ids.clear();
  if (!req.ignore_eos) d.suppress_token_ids = config_.eos_token_ids;
  d.suppress_token_ids.insert(d.suppress_token_ids.end(), req.stop_token_ids.begin(), req.stop_token_ids.end());
  // The ids that end the request are exactly the ones masked before min_tokens.
  r.num_stop_ids = static_cast<uint8_t>(std::min<size_t>(d.suppress_token_ids.size(), 255));
  for (size_t k = 0; k < 2; ++k) r.stop_ids[k] = k < d.suppress_token_ids.size() ? d.suppress_token_ids[k] : 0;
  r.arrival_time_ns = now_ns;
  r.first_scheduled_time_ns = 0;
  r.first_token_time_ns = 0;
  d.kv_mode = kv != nullptr ? kv->mode : KvMode::kNone;
  d.kv_pin_timeout_ms = kv != nullptr ? kv->pin_timeout_ms : 0;
  d.kv_pull_pending = d.kv_mode == KvMode::kPullRemote;
  d.kv_remote_block_ids.clear();
  d.kv_peer.clear();
  if (d.kv_mode == KvMode::kPrefillOnly) {
    r.length_limit = std::min(r.length_limit, r.num_prompt_tokens + 1);  // the first token only
  } else if (d.kv_pull_pending) {
    d.kv_remote_block_ids = kv->remote_block_ids;
    d.kv_peer = kv->peer;
    r.token_ids.push_back(kv->first_token_id);  // sampled by the prefill side: the first output
  }
  index_of_.emplace(id, index);
  insert_waiting(index);
  return std::nullopt;
}

bool Scheduler::abort_request(uint64_t request_id) {
  if (step_in_flight_) throw std::logic_error("abort_request while a step is in flight");
  const auto it = index_of_.find(request_id);
  if (it == index_of_.end()) return release_pinned(request_id);  // a finished prefill-only request's blocks
  const int32_t index = it->second;
  RequestState& r = table_[static_cast<size_t>(index)];
  if (r.status == RequestStatus::kWaiting) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), index));
  } else {
    running_.erase(std::find(running_.begin(), running_.end(), index));
  }
  new_output(r, FinishReason::kAbort, 0);
  release(index);
  return true;
}

void Scheduler::release(int32_t index) {
  RequestState& r = table_[static_cast<size_t>(index)];
  pool_.free(r.block_ids, /*tail_first=*/true);  // its full blocks stay cached; the tail is evicted first
  r.block_ids.clear();
  if (r.slot >= 0) {
    slot_owner_[static_cast<size_t>(r.slot)] = -1;
    free_slots_.push_back(r.slot);
    released_slots_.push_back(r.slot);
    r.slot = -1;
  }
  r.status = RequestStatus::kFree;
  index_of_.erase(r.request_id);
  free_entries_.push_back(index);
}

void Scheduler::preempt(int32_t index, StepPlan& plan) {
  RequestState& r = table_[static_cast<size_t>(index)];
  pool_.free(r.block_ids, /*tail_first=*/true);
  r.block_ids.clear();
  // Recompute later; the generated tokens stay in token_ids and are re-sent as part of the prompt (and its computed
  // full blocks stay cached, so the recompute is mostly prefix hits unless they get evicted meanwhile).
  r.num_computed_tokens = 0;
  set_registered_blocks(r, 0);
  slot_owner_[static_cast<size_t>(r.slot)] = -1;
  free_slots_.push_back(r.slot);
  plan.finished_slots.push_back(r.slot);  // the workers drop its state before this step
  r.slot = -1;
  r.status = RequestStatus::kWaiting;
  insert_waiting(index);
  if (r.num_preemptions < std::numeric_limits<uint16_t>::max()) ++r.num_preemptions;  // saturates, as outputs do
  ++num_preemptions_;
}

void Scheduler::extend_block_hashes(const RequestState& r, RequestDetails& d, int32_t num_blocks) {
  const auto bs = static_cast<size_t>(config_.block_size);
  for (auto k = d.block_hashes.size(); k < static_cast<size_t>(num_blocks); ++k) {
    const uint64_t parent = k == 0 ? 0 : d.block_hashes[k - 1];
    d.block_hashes.push_back(block_hash(parent, k == 0, d.cache_salt, std::span(r.token_ids).subspan(k * bs, bs)));
  }
}

void Scheduler::register_computed_blocks(int32_t index) {
  RequestState& r = table_[static_cast<size_t>(index)];
  RequestDetails& d = details_[static_cast<size_t>(index)];
  // Only full blocks whose KV is computed may be shared: their contents never change again.
  const int32_t full = std::min(r.num_computed_tokens / config_.block_size, static_cast<int32_t>(r.block_ids.size()));
  if (full <= r.num_registered_blocks) return;
  extend_block_hashes(r, d, full);
  for (int32_t j = r.num_registered_blocks; j < full; ++j) {
    const uint64_t hash = d.block_hashes[static_cast<size_t>(j)];
    pool_.prefetch(hash, r.block_ids[static_cast<size_t>(j)]);  // registered after the update loop: misses overlap
    pending_cache_.push_back({r.block_ids[static_cast<size_t>(j)], hash});
  }
  set_registered_blocks(r, full);
}

[[gnu::always_inline]] inline void Scheduler::schedule_chunk(int32_t index, int32_t slot, int32_t start,
                                                             int32_t num_tokens, int32_t total, int32_t lookahead) {
  const size_t e = in_flight_.size;
  if (e >= static_cast<size_t>(config_.max_num_seqs)) throw std::logic_error("a plan with more than max_num_seqs entries");
  in_flight_.index[e] = index;
  in_flight_.slot[e] = slot;
  in_flight_.start[e] = start;
  in_flight_.len[e] = num_tokens;
  in_flight_.lookahead[e] = lookahead;
  in_flight_.sample[e] = start + num_tokens == total ? 1 : 0;  // the chunk reaches the last known token: sample
  in_flight_.size = e + 1;
}

int32_t Scheduler::lookahead_for(int32_t index, int32_t budget_left) {
  const RequestState& r = table_[static_cast<size_t>(index)];
  RequestDetails& d = details_[static_cast<size_t>(index)];
  if (d.spec_backoff > 0) {  // acceptance was low: plain decoding for a while
    --d.spec_backoff;
    return 0;
  }
  // Never past the length limit: a step yields at most lookahead + 1 tokens, and positions stay < max_model_len.
  const int32_t k = std::min({config_.num_speculative_tokens, budget_left, r.length_limit - r.num_tokens() - 1});
  return std::max(k, 0);
}

void Scheduler::trim_lookahead_blocks(RequestState& r) {
  // Lookahead slots of rejected drafts are returned: keep only the blocks the request's known tokens need.
  const auto keep = static_cast<size_t>(blocks_for(r.num_tokens()));
  if (r.block_ids.size() <= keep) return;
  pool_.free(std::span(r.block_ids).subspan(keep), /*tail_first=*/true);
  r.block_ids.resize(keep);
  pending_trim_slots_.push_back(r.slot);
  pending_trim_blocks_.push_back(static_cast<int32_t>(keep));
}

bool Scheduler::try_admit(int32_t index, StepPlan& plan, int32_t& budget, size_t& plan_bytes, int64_t now_ns) {
  RequestState& r = table_[static_cast<size_t>(index)];
  RequestDetails& d = details_[static_cast<size_t>(index)];
  const int32_t bs = config_.block_size;
  hits_.clear();
  int32_t revived = 0;  // hits that sit on the free list now and stop counting as free once taken
  const bool pull = d.kv_pull_pending;  // the prompt's KV arrives from a remote engine before this step runs
  if (config_.enable_prefix_caching && !pull) {
    extend_block_hashes(r, d, r.num_tokens() / bs);
    // At least the last token is computed, so its logits exist to sample from.
    const int32_t max_hits = (r.num_tokens() - 1) / bs;
    for (int32_t j = 0; j < max_hits; ++j) {
      const int32_t id = pool_.lookup(d.block_hashes[static_cast<size_t>(j)]);
      if (id == BlockPool::kNone) break;
      hits_.push_back(id);
      revived += pool_.ref_count(id) == 0 ? 1 : 0;
    }
  }
  const auto cached_blocks = static_cast<int32_t>(hits_.size());
  const int32_t cached_tokens = pull ? r.num_prompt_tokens : cached_blocks * bs;
  // A pulled prompt computes nothing of itself here; others count against the decode-latency guard.
  int32_t n = std::min(r.num_tokens() - cached_tokens, chunk_cap(budget));
  if (!pull) n = guarded_chunk(cached_tokens, n);
  if (n <= 0) return false;
  const int32_t needed = blocks_for(cached_tokens + n) - cached_blocks;
  if (needed + revived > pool_.num_free()) return false;  // the head waits for blocks, nobody overtakes it
  const size_t bytes = kPlanBytesPerScheduled + kPlanBytesPerNewRequest +
                       (r.token_ids.size() + static_cast<size_t>(cached_blocks + needed) +
                        d.suppress_token_ids.size()) * sizeof(int32_t);
  if (plan_bytes + bytes > max_plan_bytes_) return false;  // next step; add_request made sure it fits an empty plan

  waiting_.pop_back();
  for (const int32_t id : hits_) {
    pool_.acquire_cached(id);  // before allocate(), which would otherwise evict a free hit
    r.block_ids.push_back(id);
  }
  pool_.allocate(needed, r.block_ids);
  r.num_computed_tokens = cached_tokens;
  set_registered_blocks(r, cached_blocks);
  if (!r.admitted) {  // first admission (a resumed request keeps its first figure)
    r.admitted = true;
    r.num_cached_tokens = pull ? 0 : static_cast<uint32_t>(cached_tokens);
    total_prompt_tokens_ += static_cast<uint64_t>(r.num_prompt_tokens);
  }
  if (config_.enable_prefix_caching && !pull) {
    prefix_cache_queries_ += static_cast<uint64_t>(r.num_tokens());
    prefix_cache_hits_ += static_cast<uint64_t>(cached_tokens);
  }
  r.slot = free_slots_.back();
  free_slots_.pop_back();
  slot_owner_[static_cast<size_t>(r.slot)] = index;
  r.status = RequestStatus::kRunning;
  insert_running(index);
  if (pull) {
    KvPull& p = kv_pulls_.emplace_back();
    p.slot = r.slot;
    p.remote_block_ids = d.kv_remote_block_ids;
    p.local_block_ids.assign(r.block_ids.begin(),
                             r.block_ids.begin() + static_cast<std::ptrdiff_t>(d.kv_remote_block_ids.size()));
    p.peer = d.kv_peer;
    d.kv_pull_pending = false;
  }

  NewRequestData& nr = reuse_back(plan.new_requests, spare_new_requests_);
  nr.slot = r.slot;
  nr.num_computed_tokens = r.num_computed_tokens;
  nr.num_prompt_tokens = r.num_prompt_tokens;
  nr.sampling = d.sampling;
  nr.token_ids.assign(r.token_ids.begin(), r.token_ids.end());
  nr.block_ids.assign(r.block_ids.begin(), r.block_ids.end());
  nr.suppress_token_ids.assign(d.suppress_token_ids.begin(), d.suppress_token_ids.end());
  if (r.first_scheduled_time_ns == 0) r.first_scheduled_time_ns = now_ns;
  schedule_chunk(index, r.slot, r.num_computed_tokens, n, r.num_tokens());
  plan_bytes += bytes;
  budget -= n;
  if (!pull) charge_prefill(cached_tokens, n);
  return true;
}

void Scheduler::recycle_plan(StepPlan& plan) {
  recycle(plan.new_requests, spare_new_requests_);
  recycle(plan.block_appends, spare_appends_);
  plan.step_id = 0;
  plan.finished_slots.clear();  // the sched_* arrays are rewritten whole by write_entries()
  plan.trim_slots.clear();
  plan.trim_num_blocks.clear();
}

bool Scheduler::schedule(StepPlan& plan, int64_t now_ns) {
  if (step_in_flight_) throw std::logic_error("schedule while a step is in flight");
  recycle_plan(plan);
  kv_pulls_.clear();
  in_flight_.size = 0;
  plan.finished_slots.swap(released_slots_);
  plan.trim_slots.swap(pending_trim_slots_);
  plan.trim_num_blocks.swap(pending_trim_blocks_);

  // Invariant: the tokens scheduled this step, lookahead slots included, never exceed max_num_batched_tokens.
  int32_t budget = config_.max_num_batched_tokens;
  size_t plan_bytes = kPlanFixedBytes + plan.finished_slots.size() * sizeof(int32_t) +
                      plan.trim_slots.size() * kPlanBytesPerTrim;
  bool preempted = false;
  // Speculation pays off while decoding is memory bound; past spec_max_batch running requests it would cost throughput.
  spec_step_ = config_.num_speculative_tokens > 0 &&
               (config_.spec_max_batch == 0 || static_cast<int32_t>(running_.size()) <= config_.spec_max_batch);

  prefill_ns_left_ = prefill_time_budget();
  guard_active_ = prefill_ns_left_ < std::numeric_limits<double>::infinity();
  prefilled_this_step_ = false;
  shape_ = StepShape{};
  int32_t decode_rows = 0;

  // 1. Running requests first, highest priority / earliest arrival first.
  const int32_t bs = config_.block_size;
  RequestState* const table = table_.data();  // add_request() alone grows the table
  size_t num_running = running_.size();        // re-read after a preemption shrinks running_
  for (size_t i = 0; i < num_running && budget > 0; ++i) {
    const int32_t* const run = running_.data();
    // The entries are cold after a whole step's traffic: fetch a few requests ahead so their misses overlap.
    if (i + kPrefetchAhead < num_running) __builtin_prefetch(&table[run[i + kPrefetchAhead]]);
    const int32_t index = run[i];
    RequestState& r = table[index];
    const int32_t computed = r.num_computed_tokens;
    const int32_t total = r.num_tokens();
    const int32_t left = total - computed;
    const int32_t n = left > 1 ? guarded_chunk(computed, std::min(left, chunk_cap(budget))) : left;  // chunk or token
    if (n <= 0) continue;
    // Lookahead only for a one-token decode that samples: its drafts are verified right after that token.
    int32_t k = spec_step_ && n == 1 && computed + 1 == total ? lookahead_for(index, budget - n) : 0;
    if (computed + n + k > static_cast<int32_t>(r.block_ids.size()) * bs) {
      // Needs blocks: a decode step does once every block_size tokens. Out of line, so the loop keeps its registers.
      const Growth grown = grow_blocks(index, n, k, plan, plan_bytes);
      if (grown != Growth::kGrown) {
        preempted = true;
        num_running = running_.size();
        if (grown == Growth::kPreemptedSelf) break;
      }
    }
    schedule_chunk(index, r.slot, computed, n, total, k);
    plan_bytes += kPlanBytesPerScheduled;
    budget -= n + k;
    if (left > 1) {
      charge_prefill(computed, n);
    } else {
      ++decode_rows;
    }
  }

  // 2. Admit waiting requests in priority order. Not in a step that had to preempt: blocks are short right now.
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    if (!try_admit(waiting_.back(), plan, budget, plan_bytes, now_ns)) break;
  }

  num_in_flight_samples_ = write_entries(plan);
  // update() prefetches up to 2 x kPrefetchAhead entries ahead: past the last one, they repeat it.
  if (in_flight_.size > 0) {
    std::fill_n(in_flight_.index.begin() + static_cast<std::ptrdiff_t>(in_flight_.size), 2 * kPrefetchAhead,
                in_flight_.index[in_flight_.size - 1]);
  }
  if (in_flight_.size == 0) {
    // Nothing runs: keep the released slots and trims for the next plan that is actually sent.
    released_slots_.swap(plan.finished_slots);
    plan.finished_slots.clear();
    pending_trim_slots_.swap(plan.trim_slots);
    pending_trim_blocks_.swap(plan.trim_num_blocks);
    plan.trim_slots.clear();
    plan.trim_num_blocks.clear();
    return false;
  }
  last_step_tokens_ = config_.max_num_batched_tokens - budget;
  shape_.decode_rows = decode_rows;
  last_shape_ = shape_;
  plan.step_id = next_step_id_++;
  in_flight_step_ = plan.step_id;
  step_in_flight_ = true;
  ++num_steps_;
  return true;
}

Scheduler::Growth Scheduler::grow_blocks(int32_t index, int32_t n, int32_t& k, StepPlan& plan, size_t& plan_bytes) {
  RequestState& r = table_[static_cast<size_t>(index)];
  const int32_t bs = config_.block_size;
  const int32_t computed = r.num_computed_tokens;
  const auto have = static_cast<int32_t>(r.block_ids.size());
  // Lookahead takes only free blocks: it shrinks rather than preempt anyone.
  const int32_t room = (have + pool_.num_free()) * bs - computed - n;
  k = std::clamp(room, 0, k);
  if (computed + n + k <= have * bs) return Growth::kGrown;  // the shrunk lookahead fits what it has
  const int32_t needed = blocks_for(computed + n + k) - have;
  Growth grown = Growth::kGrown;
  while (needed > pool_.num_free()) {
    // running_ is in priority order, so its back is the lowest-priority, latest-arrived request; it sits behind this
    // one in the running list (or is this request), so nothing of it is in the plan yet.
    const int32_t victim = running_.back();
    running_.pop_back();
    preempt(victim, plan);
    if (victim == index) return Growth::kPreemptedSelf;
    grown = Growth::kGrownAfterPreempting;
  }
  pool_.allocate(needed, r.block_ids);
  BlockAppend& append = reuse_back(plan.block_appends, spare_appends_);
  append.slot = r.slot;
  append.block_ids.clear();  // element by element: usually one block, and assign() would call memmove for it
  for (auto b = r.block_ids.begin() + have; b != r.block_ids.end(); ++b) append.block_ids.push_back(*b);
  plan_bytes += kPlanBytesPerAppend + static_cast<size_t>(needed) * sizeof(int32_t);
  return grown;
}

double Scheduler::prefill_time_budget() const {
  // The last step's decodes stand for this one's (the guard is decided before the running list is walked), unless
  // nothing runs any more.
  if (config_.max_step_slowdown <= 0.0f || last_shape_.decode_rows == 0 || running_.empty() || !step_cost_.fitted()) {
    return std::numeric_limits<double>::infinity();
  }
  return (config_.max_step_slowdown - 1.0) * step_cost_.base_ns(last_shape_.decode_rows);
}

size_t Scheduler::write_entries(StepPlan& plan) {
  // After scheduling, as copies: stores into the plan's uint8 sample array may alias anything, so writing it entry by
  // entry while scheduling would make the compiler reload every pointer after each one.
  const size_t n = in_flight_.size;
  const auto copy = [n](const std::vector<int32_t>& from, std::vector<int32_t>& to) {
    to.resize(n);
    std::copy_n(from.begin(), n, to.begin());
  };
  copy(in_flight_.slot, plan.sched_slots);
  copy(in_flight_.start, plan.sched_start);
  copy(in_flight_.len, plan.sched_len);
  // Without speculation the array stays empty (the workers read that as no lookahead anywhere).
  if (config_.num_speculative_tokens > 0) {
    copy(in_flight_.lookahead, plan.sched_lookahead);
  } else {
    plan.sched_lookahead.clear();
  }
  plan.sched_sample.resize(n);
  const int32_t* sample = in_flight_.sample.data();
  uint8_t* samples = plan.sched_sample.data();
  size_t sampled = 0;
  for (size_t k = 0; k < n; ++k) {
    samples[k] = static_cast<uint8_t>(sample[k]);
    sampled += static_cast<size_t>(sample[k]);
  }
  // The result's rows are matched against the sampled slots: the plan's own when every entry samples.
  sampled_slots_.clear();
  if (sampled < n) {
    for (size_t k = 0; k < n; ++k) {
      if (sample[k] != 0) sampled_slots_.push_back(in_flight_.slot[k]);
    }
  }
  return sampled;
}

bool Scheduler::match_result_rows(const StepResult& result, bool fill_rows) {
  // Workers normally answer in plan order: one comparison of the rows' slots with the sampled entries' (a memcmp)
  // confirms that. As many rows as sampled entries (checked by the caller), each matched to a different one, means
  // every sampled slot got exactly one token.
  const size_t n = in_flight_.size;
  const int32_t* slots = result.slots.data();
  int32_t* rows = in_flight_.result.data();
  const int32_t* sample = in_flight_.sample.data();
  const bool every_entry = result.slots.size() == n;  // the caller checked: as many rows as sampled entries
  const int32_t* expected = every_entry ? in_flight_.slot.data() : sampled_slots_.data();
  if (std::equal(slots, slots + result.slots.size(), expected)) {
    if (fill_rows) {
      int32_t row = 0;
      for (size_t k = 0; k < n; ++k) rows[k] = sample[k] != 0 ? row++ : -1;
    }
    return true;
  }
  // Any other order: match the rows through a slot -> entry map, stamped with this step so it needs no clearing.
  std::fill_n(rows, n, -1);
  for (size_t k = 0; k < n; ++k) {
    if (sample[k] != 0) {
      sample_mark_[static_cast<size_t>(in_flight_.slot[k])] = {in_flight_step_, static_cast<int32_t>(k)};
    }
  }
  for (size_t i = 0; i < result.slots.size(); ++i) {
    const int32_t slot = slots[i];
    int32_t entry = -1;
    if (slot >= 0 && slot < config_.max_num_seqs) {
      const SampleMark& mark = sample_mark_[static_cast<size_t>(slot)];
      if (mark.step == in_flight_step_) entry = mark.pos;
    }
    if (entry < 0 || rows[entry] != -1) {
      std::fill_n(rows, n, -1);
      throw std::runtime_error("StepResult has a slot that was not sampled or is repeated: " + std::to_string(slot));
    }
    rows[entry] = static_cast<int32_t>(i);
  }
  return false;
}

void Scheduler::check_result_counts(const StepResult& result) {
  const size_t rows = result.slots.size();
  const bool multi = !result.token_counts.empty();
  if ((multi && result.token_counts.size() != rows) ||
      (!result.num_proposed.empty() && result.num_proposed.size() != rows)) {
    throw std::runtime_error("StepResult token_counts / num_proposed are not one per sampled slot");
  }
  size_t tokens = rows;  // one per row, unless token_counts says otherwise
  if (multi) {
    row_offsets_.resize(rows + 1);
    row_offsets_[0] = 0;
    for (size_t i = 0; i < rows; ++i) {
      row_offsets_[i + 1] = row_offsets_[i] + static_cast<size_t>(std::max(result.token_counts[i], 0));
    }
    tokens = row_offsets_[rows];
  }
  if (result.token_ids.size() != tokens || result.logprobs.size() != tokens) {
    throw std::runtime_error("StepResult has " + std::to_string(result.token_ids.size()) + " tokens, its rows count " +
                             std::to_string(tokens));
  }
  if (result.top_token_ids.size() != size_t{result.num_top} * tokens ||
      result.top_logprobs.size() != result.top_token_ids.size()) {
    throw std::runtime_error("StepResult top arrays are not [tokens, num_top]");
  }
  if (!multi && result.num_proposed.empty()) return;
  for (size_t k = 0; k < in_flight_.size; ++k) {
    if (in_flight_.sample[k] == 0) continue;
    const auto row = static_cast<size_t>(in_flight_.result[k]);
    const int32_t n = multi ? result.token_counts[row] : 1;
    const int32_t proposed = result.num_proposed.empty() ? 0 : result.num_proposed[row];
    const int32_t lookahead = in_flight_.lookahead[k];
    // Each accepted token must be a verified draft token, and drafts only fill the slots the plan reserved.
    if (proposed < 0 || proposed > lookahead || n < 1 || n - 1 > proposed) {
      throw std::runtime_error("StepResult slot " + std::to_string(in_flight_.slot[k]) + ": " + std::to_string(n) +
                               " tokens from " + std::to_string(proposed) + " proposed, but its lookahead is " +
                               std::to_string(lookahead));
    }
  }
}

PackedOutput* Scheduler::output_space(size_t more) {
  if (outputs_.size() < num_outputs_ + more) outputs_.resize(num_outputs_ + more);  // only up to a high-water mark
  return outputs_.data() + num_outputs_;
}

void Scheduler::new_output(const RequestState& r, FinishReason reason, int32_t num_scheduled) {
  *output_space(1) = make_output(r, reason, num_scheduled, false, 0, 0.0f);
  ++num_outputs_;
}

// A row with drafts, several tokens or top logprobs: appends its tokens (stop rules apply token by token and drop the
// rest), one output each, and updates the request's acceptance rate. Out of line, so the plain loop keeps its registers.
FinishReason Scheduler::append_row(int32_t index, int32_t num_tokens, size_t row_index, const StepResult& result,
                                   int64_t now_ns, uint64_t& generated) {
  RequestState& r = table_[static_cast<size_t>(index)];
  RequestDetails& d = details_[static_cast<size_t>(index)];
  const bool multi = !result.token_counts.empty();
  const int32_t* tokens = result.token_ids.data();
  const float* logprobs = result.logprobs.data();
  FinishReason reason = FinishReason::kNone;
  const size_t first = multi ? row_offsets_[row_index] : row_index;
  const int32_t num_new = multi ? result.token_counts[row_index] : 1;
  const int32_t proposed = result.num_proposed.empty() ? 0 : result.num_proposed[row_index];
  // num_logprobs sits in the request's details: read it only when the worker sent top logprobs at all.
  const uint32_t top = result.num_top == 0 ? 0
                                           : std::min({result.num_top, static_cast<uint32_t>(d.sampling.num_logprobs),
                                                       uint32_t{std::numeric_limits<uint16_t>::max()}});
  if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
  r.num_computed_tokens += num_tokens;
  // Accepted draft tokens come first, then the target's own; stop rules apply token by token and drop the rest.
  int32_t appended = 0;
  while (appended < num_new && reason == FinishReason::kNone) {
    const size_t at = first + static_cast<size_t>(appended);
    const int32_t token = tokens[at];
    r.token_ids.push_back(token);  // within the capacity reserved at add_request (lookahead stops at the limit)
    reason = stop_reason(r, &d, token);
    const int32_t scheduled = appended == 0 ? num_tokens + proposed : 0;
    PackedOutput& o = *output_space(1);
    ++num_outputs_;
    o = make_output(r, reason, scheduled, true, token, logprobs[at]);
    if (appended == 0 && proposed > 0) {
      o.num_spec_proposed_tokens = static_cast<uint8_t>(proposed);
      o.num_spec_accepted_tokens = static_cast<uint8_t>(num_new - 1);
    }
    if (top > 0) {
      const auto row = static_cast<std::ptrdiff_t>(at * result.num_top);
      o.num_top = static_cast<uint16_t>(top);
      top_token_ids_.insert(top_token_ids_.end(), result.top_token_ids.begin() + row,
                            result.top_token_ids.begin() + row + top);
      top_logprobs_.insert(top_logprobs_.end(), result.top_logprobs.begin() + row,
                           result.top_logprobs.begin() + row + top);
    }
    ++appended;
  }
  generated += static_cast<uint64_t>(appended);
  // The KV of the accepted drafts was computed in this step; the last token's is computed next step.
  r.num_computed_tokens += appended - 1;
  if (proposed > 0) {
    const int32_t accepted = num_new - 1;
    d.spec_proposed_tokens += static_cast<uint64_t>(proposed);
    d.spec_accepted_tokens += static_cast<uint64_t>(accepted);
    spec_proposed_tokens_ += static_cast<uint64_t>(proposed);
    spec_accepted_tokens_ += static_cast<uint64_t>(accepted);
    ++spec_verify_rows_;
    const float weighted = 0.25f * static_cast<float>(accepted) / static_cast<float>(proposed);
    d.spec_acceptance = 0.75f * d.spec_acceptance + weighted;
    if (d.spec_acceptance < config_.spec_min_acceptance) {
      d.spec_backoff = config_.spec_backoff_steps;
      d.spec_acceptance = 1.0f;  // a fresh start after the pause
    }
  }
  return reason;
}

void Scheduler::update(const StepResult& result, int64_t now_ns) {
  if (!step_in_flight_) throw std::logic_error("update without a step in flight");
  if (result.step_id != in_flight_step_) {
    throw std::runtime_error("StepResult for step " + std::to_string(result.step_id) + " but step " +
                             std::to_string(in_flight_step_) + " is in flight");
  }
  const size_t expected = num_in_flight_samples_;
  if (result.slots.size() != expected) {
    throw std::runtime_error("StepResult has " + std::to_string(result.slots.size()) + " sampled slots, plan asked for " +
                             std::to_string(expected));
  }
  const bool multi = !result.token_counts.empty();
  const bool plain = !multi && result.num_proposed.empty() && result.num_top == 0;
  // The common step: every entry a plain decode (one token, no drafts, no lookahead, no top logprobs) whose row is
  // its own position. Throws, changing nothing, unless every sampled entry got exactly one row; unless the step
  // turns out to be the common one, each entry's row is then in its `result`.
  const bool every_entry_decodes =
      plain && result.slots.size() == in_flight_.size && config_.num_speculative_tokens == 0;
  const bool in_order = match_result_rows(result, /*fill_rows=*/!every_entry_decodes);
  check_result_counts(result);  // throws, changing nothing, unless every row's tokens fit its lookahead
  step_in_flight_ = false;

  pending_cache_.clear();
  finished_.clear();
  registering_.clear();
  const int32_t bs = config_.block_size;
  const size_t count = in_flight_.size;
  const int32_t* tokens = result.token_ids.data();
  const float* logprobs = result.logprobs.data();  // one per token (check_result_counts)
  trimming_.clear();
  // Without drafts every sampled row appends exactly one token.
  uint64_t generated = plain ? result.slots.size() : 0;
  RequestState* const table = table_.data();
  RequestDetails* const details = details_.data();
  const int32_t* const entry_index = in_flight_.index.data();
  const int32_t* const entry_len = in_flight_.len.data();
  const int32_t* const entry_sample = in_flight_.sample.data();
  const int32_t* const entry_lookahead = in_flight_.lookahead.data();
  const int32_t* const entry_result = in_flight_.result.data();
  // Each entry gives one output, or one per token it appends (at least one): room for them all, written in place.
  PackedOutput* out = output_space(count + result.token_ids.size());
  // One walk over the entries, compiled twice: for the common step (entry k is row k; nothing to test per entry but
  // the stop rules) and for any other.
  const auto walk = [&](auto common_step) {
    constexpr bool kFast = decltype(common_step)::value;
    for (size_t k = 0; k < count; ++k) {
      // Two stages ahead: the entry's hot lines, then (once that has arrived) the line its next token goes to. The
      // index array repeats its last entry past the end (schedule() pads it), so neither needs a bound check.
      const RequestState* ahead = &table[entry_index[k + 2 * kPrefetchAhead]];
      __builtin_prefetch(ahead);
      __builtin_prefetch(reinterpret_cast<const char*>(ahead) + 64);
      const RequestState& near = table[entry_index[k + kPrefetchAhead]];
      __builtin_prefetch(near.token_ids.data() + near.token_ids.size(), 1);
      const int32_t index = entry_index[k];
      const int32_t num_tokens = entry_len[k];
      RequestState& r = table[index];
      if (!kFast && entry_sample[k] == 0) {
        r.num_computed_tokens += num_tokens;
        if (r.num_computed_tokens >= r.register_from) registering_.push_back(index);
        *out++ = make_output(r, FinishReason::kNone, num_tokens, false, 0, 0.0f);  // a prefill chunk: progress only
        continue;
      }
      FinishReason reason = FinishReason::kNone;
      if (kFast || plain) {  // one token per row, no drafts, no top logprobs: kept short
        const size_t row = kFast ? k : static_cast<size_t>(entry_result[k]);
        const int32_t token = tokens[row];
        if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
        r.num_computed_tokens += num_tokens;
        r.token_ids.push_back(token);  // within the capacity reserved at add_request
        reason = stop_reason(r, details + index, token);
        *out++ = make_output(r, reason, num_tokens, true, token, logprobs[row]);
      } else {
        num_outputs_ = static_cast<size_t>(out - outputs_.data());  // append_row adds its own
        reason = append_row(index, num_tokens, static_cast<size_t>(entry_result[k]), result, now_ns, generated);
        out = outputs_.data() + num_outputs_;
      }
      // Most decode steps complete no block: skip the registration unless the next unregistered one is full.
      if (r.num_computed_tokens >= r.register_from) registering_.push_back(index);
      if (reason != FinishReason::kNone) {
        finished_.push_back(index);
      } else if (!kFast && entry_lookahead[k] > 0) {
        trimming_.push_back(index);  // the lookahead slots it did not fill go back
      }
    }
  };
  if (every_entry_decodes && in_order) {
    walk(std::true_type{});
  } else {
    walk(std::false_type{});  // entry_result holds every sampled entry's row (match_result_rows)
  }
  num_outputs_ = static_cast<size_t>(out - outputs_.data());
  total_generation_tokens_ += generated;
  // Registrations read three arrays of their own per request (hash chain, block table, the block's tokens), cold by
  // now: touch them all first so their misses overlap, then hash and register.
  for (const int32_t index : registering_) {
    const RequestState& r = table_[static_cast<size_t>(index)];
    const auto next = static_cast<size_t>(r.num_registered_blocks);
    if (next > 0) __builtin_prefetch(&details_[static_cast<size_t>(index)].block_hashes[next - 1]);
    __builtin_prefetch(&r.block_ids[next]);
    __builtin_prefetch(&r.token_ids[next * static_cast<size_t>(bs)]);
  }
  for (const int32_t index : registering_) register_computed_blocks(index);
  // Register before releasing: a block must still be referenced when it enters the cache.
  for (const PendingBlock& b : pending_cache_) pool_.cache(b.block, b.hash);
  for (const int32_t index : trimming_) trim_lookahead_blocks(table_[static_cast<size_t>(index)]);
  for (const int32_t index : finished_) {  // status becomes kFree; removed from running_ below
    if (details_[static_cast<size_t>(index)].kv_mode == KvMode::kPrefillOnly) pin_blocks(index, now_ns);
    release(index);
  }
  if (!finished_.empty()) {
    std::erase_if(running_, [this](int32_t i) { return table_[static_cast<size_t>(i)].status != RequestStatus::kRunning; });
  }
  in_flight_.size = 0;
}

void Scheduler::pin_blocks(int32_t index, int64_t now_ns) {
  RequestState& r = table_[static_cast<size_t>(index)];
  const int64_t expires = now_ns + int64_t{details_[static_cast<size_t>(index)].kv_pin_timeout_ms} * 1'000'000;
  KvPinned& event = kv_pins_.emplace_back();
  event.request_id = r.request_id;
  event.num_tokens = static_cast<uint32_t>(r.num_prompt_tokens);
  event.expires_at_ns = expires;
  event.block_ids.assign(r.block_ids.begin(), r.block_ids.begin() + blocks_for(r.num_prompt_tokens));
  // The references move from the request to the pin: release() then has nothing to free.
  pinned_.push_back({r.request_id, expires, std::move(r.block_ids)});
  r.block_ids = {};
}

bool Scheduler::release_pinned(uint64_t request_id) {
  const auto it = std::find_if(pinned_.begin(), pinned_.end(),
                               [&](const PinnedBlocks& p) { return p.request_id == request_id; });
  if (it == pinned_.end()) return false;
  pool_.free(it->block_ids, /*tail_first=*/true);  // full prompt blocks stay cached for later prefix hits
  pinned_.erase(it);
  return true;
}

int32_t Scheduler::expire_pinned(int64_t now_ns) {
  int32_t freed = 0;
  for (size_t k = 0; k < pinned_.size();) {
    if (pinned_[k].expires_at_ns <= now_ns) {
      pool_.free(pinned_[k].block_ids, /*tail_first=*/true);
      pinned_.erase(pinned_.begin() + static_cast<std::ptrdiff_t>(k));
      ++freed;
    } else {
      ++k;
    }
  }
  return freed;
}

void Scheduler::take_outputs(std::vector<RequestOutput>& out) {
  out.clear();
  size_t top = 0;
  for (const PackedOutput& o : outputs()) {
    out.push_back(unpack_output(o, std::span(top_token_ids_).subspan(top, o.num_top),
                                std::span(top_logprobs_).subspan(top, o.num_top)));
    top += o.num_top;
  }
  clear_outputs();
}

EngineStats Scheduler::stats(uint64_t query_id) const {
  EngineStats s;
  s.query_id = query_id;
  s.num_running = static_cast<uint32_t>(running_.size());
  s.num_waiting = static_cast<uint32_t>(waiting_.size());
  s.num_total_blocks = static_cast<uint32_t>(pool_.num_blocks());
  s.num_free_blocks = static_cast<uint32_t>(pool_.num_free());
  s.block_size = static_cast<uint32_t>(config_.block_size);
  s.num_steps = num_steps_;
  s.num_preemptions = num_preemptions_;
  s.num_scheduled_tokens = static_cast<uint32_t>(last_step_tokens_);
  s.prefix_cache_queries = prefix_cache_queries_;
  s.prefix_cache_hits = prefix_cache_hits_;
  s.kv_usage = 1.0f - static_cast<float>(pool_.num_free()) / static_cast<float>(pool_.num_blocks());
  s.total_prompt_tokens = total_prompt_tokens_;
  s.total_generation_tokens = total_generation_tokens_;
  s.spec_proposed_tokens = spec_proposed_tokens_;
  s.spec_accepted_tokens = spec_accepted_tokens_;
  s.spec_verify_rows = spec_verify_rows_;
  return s;
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("Scheduler invariant broken: " + what); };
  pool_.check_invariants();
  if (static_cast<int32_t>(running_.size()) > config_.max_num_seqs) fail("more running than max_num_seqs");
  std::vector<int32_t> holders(static_cast<size_t>(pool_.num_blocks()), 0);
  size_t live = 0;
  for (size_t i = 0; i < table_.size(); ++i) {
    const RequestState& r = table_[i];
    if (r.status == RequestStatus::kFree) continue;
    ++live;
    for (const int32_t b : r.block_ids) ++holders[static_cast<size_t>(b)];
    if (r.block_ids.size() < static_cast<size_t>(blocks_for(r.num_computed_tokens))) fail("too few blocks");
    const int64_t register_from = config_.enable_prefix_caching
                                      ? int64_t{r.num_registered_blocks + 1} * config_.block_size
                                      : std::numeric_limits<int32_t>::max();
    if (r.register_from != register_from) fail("register_from does not follow num_registered_blocks");
    if (r.num_computed_tokens >= r.num_tokens() && r.status == RequestStatus::kRunning) fail("nothing left to compute");
    // Between steps a request holds no lookahead blocks: rejected drafts' slots went back to the pool.
    if (!step_in_flight_ && r.block_ids.size() > static_cast<size_t>(blocks_for(r.num_tokens()))) {
      fail("blocks beyond the request's tokens");
    }
    if (r.status == RequestStatus::kRunning) {
      if (r.slot < 0 || slot_owner_[static_cast<size_t>(r.slot)] != static_cast<int32_t>(i)) fail("slot owner");
      if (std::count(running_.begin(), running_.end(), static_cast<int32_t>(i)) != 1) fail("running list");
    } else {
      if (r.slot != -1 || !r.block_ids.empty() || r.num_computed_tokens != 0) fail("waiting request holds state");
      if (std::count(waiting_.begin(), waiting_.end(), static_cast<int32_t>(i)) != 1) fail("waiting queue");
    }
  }
  if (live != running_.size() + waiting_.size() || live != index_of_.size()) fail("request counts");
  for (const PinnedBlocks& p : pinned_) {
    for (const int32_t b : p.block_ids) ++holders[static_cast<size_t>(b)];
  }
  // Sharing: a block's reference count is exactly the number of requests holding it.
  for (int32_t b = 0; b < pool_.num_blocks(); ++b) {
    if (pool_.ref_count(b) != holders[static_cast<size_t>(b)]) fail("ref_count of block " + std::to_string(b));
  }
  for (size_t k = 1; k < running_.size(); ++k) {
    if (!runs_before(running_[k - 1], running_[k])) fail("running list out of priority order");
  }
  for (size_t k = 1; k < waiting_.size(); ++k) {
    if (!runs_before(waiting_[k], waiting_[k - 1])) fail("waiting queue out of priority order");
  }
  if (free_slots_.size() + running_.size() != static_cast<size_t>(config_.max_num_seqs)) fail("slot count");
}

}  // namespace ringserve
