"""Model code for the llama family (llama, Qwen2-style QKV bias), written once in plain PyTorch."""

from ringserve.workers.model.llama import KVCache, LlamaConfig, LlamaForCausalLM

__all__ = ["KVCache", "LlamaConfig", "LlamaForCausalLM"]
