"""Model code for the llama family (llama, Qwen2-style QKV bias): the plain PyTorch model (llama.py) and the fast
paths applied to it from outside (fast_paths.py)."""

from ringserve.workers.model.llama import KVCache, LlamaConfig, LlamaForCausalLM

__all__ = ["KVCache", "LlamaConfig", "LlamaForCausalLM"]
