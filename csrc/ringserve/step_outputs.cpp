#include "ringserve/step_outputs.h"

namespace ringserve {

static_assert(sizeof(PackedOutput) == 64, "a packed output is one cache line");

void StepOutputs::take(std::vector<RequestOutput>& out) {
  out.clear();
  size_t top = 0;
  for (const PackedOutput& o : outputs()) {
    out.push_back(unpack_output(o, std::span(top_token_ids_).subspan(top, o.num_top),
                                std::span(top_logprobs_).subspan(top, o.num_top)));
    top += o.num_top;
  }
  clear();
}

}  // namespace ringserve
