"""RingServe frontend, the gRPC process: api/ (servicers), text/ (tokenizer, detokenizer), observability/, routing/.

At the top: how the process starts (cli, launcher), what it serves (catalog, deployment, model_source) and its link
to the engine processes (engine_client).
"""
