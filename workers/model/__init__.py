"""Model code: the config-driven decoder of the llama family (llama.py; the architectures it serves are listed in
registry.py), RoPE scaling (rope.py), and the fast paths applied to it from outside (fast_paths.py)."""

from ringserve.workers.model.llama import KVCache, LlamaConfig, LlamaForCausalLM

__all__ = ["KVCache", "LlamaConfig", "LlamaForCausalLM"]
