"""RingServe workers: model shards, paged KV tensors, the persistent batch and the sampler."""
