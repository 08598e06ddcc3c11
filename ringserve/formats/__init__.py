"""What several RingServe processes read and write the same way: the engine configuration, GGUF files, KV peer
infos, the speculative tree shape and shared-memory segment names. Every process folder may import it; it imports
none of them."""
