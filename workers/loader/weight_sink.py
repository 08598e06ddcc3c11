"""Fills a model's parameters from named tensors, checking shapes and that nothing is left unset."""

from __future__ import annotations

import torch
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM
from ringserve.workers.parallel import TensorParallelShard, apply_tensor_parallel
from ringserve.workers.pipeline import PipelineStage, apply_pipeline_stage


def build_empty_model(
    config: LlamaConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: TensorParallelShard | None = None,
    model_class: type[LlamaForCausalLM] = LlamaForCausalLM,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """Allocates the model (this rank's shard of it, of its pipeline stage's layers) without random init, since every
    weight is loaded next."""
    local = shard.local_config() if shard else config
    if stage is not None:
        local = stage.local_config(local)
    with torch.device("meta"):
        model = model_class(local)
        if stage is not None:
            apply_pipeline_stage(model, stage)
    model = model.to(dtype).to_empty(device=device)
    if local.tie_word_embeddings:
        # to_empty replaces each module's parameter separately, which unties shared weights.
        model.lm_head.weight = model.model.embed_tokens.weight
    if shard is not None:
        apply_tensor_parallel(model, shard)
    return model.eval()


class WeightSink:
    """Receives (our name, tensor) pairs for one model; `finish` raises if any parameter never arrived."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        shard: TensorParallelShard | None = None,
        stage: PipelineStage | None = None,
        full: LlamaConfig | None = None,  # the whole model's config; needed with a stage
    ) -> None:
        self.params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
        self.loaded: set[str] = set()
        self.shard = shard
        self.stage, self.full = stage, full

    def local_name(self, name: str) -> str | None:
        """Our (full-model) parameter name as this pipeline stage names it; None when another stage holds it."""
        if self.stage is None or self.full is None:
            return name
        return self.stage.local_name(name, self.full)

    def elsewhere(self, name: str) -> bool:
        """Another pipeline stage holds `name`: the loader skips the tensor without reading it."""
        return self.local_name(name) is None

    def wants(self, name: str) -> bool:
        return self.local_name(name) in self.params

    @torch.no_grad()
    def assign(self, name: str, tensor: torch.Tensor, source_name: str, *, sliced: bool = False) -> None:
        """`tensor` is the full checkpoint tensor (sliced here to this rank's part) or, with sliced, that part."""
        local = self.local_name(name)
        if local is None:
            return  # another pipeline stage's
        name = local
        param = self.params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {source_name!r} maps to {name!r}, which this model does not have")
        if self.shard is not None and not sliced:
            tensor = self.shard.slice(name, tensor)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor {source_name!r} has shape {tuple(tensor.shape)}, "
                f"but {name!r} expects {tuple(param.shape)}"
            )
        param.copy_(tensor.to(param.dtype))
        self.loaded.add(name)

    def finish(self, source: str, source_names: dict[str, str]) -> None:
        """source_names: checkpoint name -> our name, used to name what is missing in the file's own terms."""
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            theirs = {ours: name for name, ours in source_names.items()}
            listed = ", ".join(f"{theirs.get(m, m)} (for {m})" for m in missing)
            raise ValueError(f"{source} is missing weights: {listed}")
