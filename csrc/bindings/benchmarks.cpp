// ringserve._core benchmark entry points: the native halves of benchmarks/ring.py, scheduler_step.py and
// engine_loop.py (GIL released: they spin and sleep on the rings or loop in C++).
#include "bindings/common.h"
#include "ringserve/core_bench.h"
#include "ringserve/ring_bench.h"

namespace ringserve::bindings {

void bind_benchmarks(py::module_& m) {
  m.def(
      "bench_ring_ping",
      [](const std::shared_ptr<ShmRing>& out, const std::shared_ptr<ShmRing>& in, size_t record_size, uint64_t count,
         double timeout_s) {
        std::vector<int64_t> rtt;
        {
          py::gil_scoped_release release;
          rtt = bench_ring_ping(out, in, record_size, count, to_timeout(timeout_s));
        }
        return to_array(rtt);
      },
      py::arg("out_ring"), py::arg("in_ring"), py::arg("record_size"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "round trips (ns, np.int64) of `count` records sent on out_ring and echoed back on in_ring");
  m.def(
      "bench_ring_echo",
      [](const std::shared_ptr<ShmRing>& in, const std::shared_ptr<ShmRing>& out, uint64_t count, double timeout_s) {
        py::gil_scoped_release release;
        return bench_ring_echo(in, out, count, to_timeout(timeout_s));
      },
      py::arg("in_ring"), py::arg("out_ring"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "echoes `count` records from in_ring back on out_ring");
  m.def(
      "bench_ring_produce",
      [](const std::shared_ptr<ShmRing>& ring, size_t record_size, uint64_t count, double timeout_s) {
        py::gil_scoped_release release;
        return bench_ring_produce(ring, record_size, count, to_timeout(timeout_s));
      },
      py::arg("ring"), py::arg("record_size"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "writes `count` sequence-numbered records; returns the elapsed ns");
  m.def(
      "bench_ring_consume",
      [](const std::shared_ptr<ShmRing>& ring, uint64_t count, double timeout_s) {
        RingThroughput t;
        {
          py::gil_scoped_release release;
          t = bench_ring_consume(ring, count, to_timeout(timeout_s));
        }
        py::dict d;
        d["records"] = t.records;
        d["bytes"] = t.bytes;
        d["elapsed_ns"] = t.elapsed_ns;
        return d;
      },
      py::arg("ring"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "reads and sequence-checks `count` records; elapsed_ns runs from the first record to the last");
  m.def(
      "bench_scheduler_steps",
      [](int32_t num_running, int32_t prompt_len, int32_t block_size, int32_t num_steps, bool prefix_caching) {
        py::gil_scoped_release release;
        return bench_scheduler_steps(num_running, prompt_len, block_size, num_steps, prefix_caching);
      },
      py::arg("num_running"), py::arg("prompt_len") = 128, py::arg("block_size") = 16, py::arg("num_steps") = 1000,
      py::arg("enable_prefix_caching") = true,
      "ns per steady-state decode step (schedule + update with a fake result) at num_running running requests");
  m.def(
      "bench_engine_loop",
      [](int32_t num_running, int32_t prompt_len, int32_t num_steps) {
        EngineLoopTiming t;
        {
          py::gil_scoped_release release;
          t = bench_engine_loop(num_running, prompt_len, num_steps);
        }
        py::dict d;
        d["us_per_step"] = t.us_per_step;
        d["steps"] = t.steps;
        return d;
      },
      py::arg("num_running"), py::arg("prompt_len") = 128, py::arg("num_steps") = 1000,
      "us per step of the whole engine loop (rings, C++ null worker, event drain) at num_running requests");
}

}  // namespace ringserve::bindings
