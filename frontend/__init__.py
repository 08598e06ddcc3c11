"""RingServe frontend: gRPC servicers, tokenizer, chat template, incremental detokenizer and the engine client."""
