// ringserve._core engine: its configuration, the engine loop, and the scheduler and block pool on their own.
#include <atomic>
#include <optional>

#include "bindings/common.h"
#include "ringserve/block_pool.h"
#include "ringserve/engine.h"

namespace ringserve::bindings {
namespace {

// While Engine.run() holds no GIL, Python signal handlers only run when someone calls PyErr_CheckSignals.
class InterruptCheckScope {
 public:
  explicit InterruptCheckScope(Engine& engine) : engine_(engine) {
    engine_.set_interrupt_check([this] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) {  // a handler raised (e.g. KeyboardInterrupt): the error stays pending
        interrupted_ = true;
        return true;
      }
      return false;
    });
  }
  ~InterruptCheckScope() { engine_.set_interrupt_check({}); }
  bool interrupted() const { return interrupted_; }

 private:
  Engine& engine_;
  std::atomic<bool> interrupted_{false};
};

// Scheduler::schedule and Scheduler::schedule_ahead for Python: the plan, or None when there is nothing to run.
template <bool (Scheduler::*kPlan)(StepPlan&, int64_t)>
py::object plan_or_none(Scheduler& s, int64_t now_ns) {
  StepPlan plan;
  return (s.*kPlan)(plan, now_ns) ? step_plan_to_python(std::move(plan)) : py::none();
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("block_size", &EngineConfig::block_size)
      .def_readwrite("num_blocks", &EngineConfig::num_blocks)
      .def_readwrite("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &EngineConfig::max_model_len)
      .def_readwrite("eos_token_ids", &EngineConfig::eos_token_ids)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("long_prefill_token_threshold", &EngineConfig::long_prefill_token_threshold)
      .def_readwrite("stats_interval_ms", &EngineConfig::stats_interval_ms)
      .def_readwrite("priority_aging_ms", &EngineConfig::priority_aging_ms)
      .def_readwrite("num_speculative_tokens", &EngineConfig::num_speculative_tokens)
      .def_readwrite("spec_max_batch", &EngineConfig::spec_max_batch)
      .def_readwrite("spec_min_acceptance", &EngineConfig::spec_min_acceptance)
      .def_readwrite("spec_backoff_steps", &EngineConfig::spec_backoff_steps)
      .def_readwrite("max_step_slowdown", &EngineConfig::max_step_slowdown)
      .def_readwrite("async_scheduling", &EngineConfig::async_scheduling)
      .def_readwrite("step_timeout_s", &EngineConfig::step_timeout_s);

  // The scheduler on its own, for property tests with a fake worker in Python (not part of the serving path).
  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<EngineConfig>(), py::arg("config"))
      .def(
          "add_request",
          [](Scheduler& s, const AddRequest& r, int64_t now_ns, const std::optional<KvRequestOptions>& kv) -> py::object {
            auto rejected = s.add_request(r, now_ns, kv ? &*kv : nullptr);
            return rejected ? py::cast(*rejected) : py::none();
          },
          py::arg("request"), py::arg("now_ns") = 0, py::arg("kv") = py::none())
      .def("release_pinned", &Scheduler::release_pinned, py::arg("request_id"))
      .def("expire_pinned", &Scheduler::expire_pinned, py::arg("now_ns"))
      .def_property_readonly("num_pinned_requests", &Scheduler::num_pinned_requests)
      .def("take_kv_pulls",
           [](Scheduler& s) { return std::vector<KvPull>(s.kv_pulls().begin(), s.kv_pulls().end()); })
      .def("take_kv_pins",
           [](Scheduler& s) {
             std::vector<KvPinned> pins(s.kv_pins().begin(), s.kv_pins().end());
             s.clear_kv_pins();
             return pins;
           })
      .def("abort_request", &Scheduler::abort_request, py::arg("request_id"))
      .def("schedule", &plan_or_none<&Scheduler::schedule>, py::arg("now_ns") = 0)
      .def("schedule_ahead", &plan_or_none<&Scheduler::schedule_ahead>, py::arg("now_ns") = 0)
      .def_property_readonly("num_steps_in_flight", &Scheduler::num_steps_in_flight)
      .def("update", &Scheduler::update, py::arg("result"), py::arg("now_ns") = 0)
      .def("take_outputs",
           [](Scheduler& s) {
             std::vector<RequestOutput> out;
             s.take_outputs(out);
             return out;
           })
      .def("stats", &Scheduler::stats, py::arg("query_id") = 0)
      .def("observe_step_time", &Scheduler::observe_step_time, py::arg("ns"))
      .def_property_readonly("prefill_time_budget", &Scheduler::prefill_time_budget)
      .def_property_readonly("step_cost",
                             [](const Scheduler& s) -> py::object {
                               const StepCostModel& m = s.step_cost();
                               if (!m.fitted()) return py::none();
                               return py::make_tuple(m.base_ns(), m.per_token_ns(), m.per_pair_ns(),
                                                     m.per_context_ns(), m.per_decode_ns(), m.base_decode_rows());
                             })
      .def("check_invariants", &Scheduler::check_invariants)
      .def("block_ref_count", [](const Scheduler& s, int32_t id) { return s.block_pool().ref_count(id); },
           py::arg("block_id"))
      .def("block_is_cached", [](const Scheduler& s, int32_t id) { return s.block_pool().is_cached(id); },
           py::arg("block_id"))
      .def_property_readonly("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.block_pool().num_free(); })
      .def_property_readonly("num_cached_blocks", [](const Scheduler& s) { return s.block_pool().num_cached(); })
      .def_property_readonly("num_total_blocks", [](const Scheduler& s) { return s.block_pool().num_blocks(); })
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions);

  py::class_<Engine>(m, "Engine")
      .def(py::init<EngineConfig, const std::string&, const std::string&, const std::string&, const std::string&,
                    std::vector<pid_t>>(),
           py::arg("config"), py::arg("request_ring"), py::arg("event_ring"), py::arg("step_ring"),
           py::arg("result_ring"), py::arg("worker_pids"))
      .def("run",
           [](Engine& e) {
             bool interrupted;
             {
               InterruptCheckScope interrupt_check(e);
               {
                 py::gil_scoped_release release;
                 e.run();
               }
               interrupted = interrupt_check.interrupted();
             }
             if (interrupted && PyErr_Occurred()) throw py::error_already_set();
           })
      .def("stop", &Engine::stop);

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def(
          "allocate",
          [](BlockPool& p, int32_t n) {
            std::vector<int32_t> ids;
            p.allocate(n, ids);  // all or nothing: [] when fewer than n are free
            return ids;
          },
          py::arg("n"))
      .def("free", [](BlockPool& p, const std::vector<int32_t>& ids) { p.free(ids); }, py::arg("block_ids"))
      .def("lookup", &BlockPool::lookup, py::arg("hash"))
      .def("cache", &BlockPool::cache, py::arg("block_id"), py::arg("hash"))
      .def("acquire_cached", &BlockPool::acquire_cached, py::arg("block_id"))
      .def("is_cached", &BlockPool::is_cached, py::arg("block_id"))
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def("add_ref", &BlockPool::add_ref, py::arg("block_id"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("check_invariants", &BlockPool::check_invariants)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks);
}

}  // namespace ringserve::bindings
