"""The native bf16 linear kernel and the fused q/k/v and gate/up projections give what plain PyTorch gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM, cpu_ops
from ringserve.workers.model.fast_paths import NativeRMSNorm, _project, apply_fast_paths
from ringserve.workers.model.llama import RMSNorm, RotaryEmbedding, rotate
from ringserve.workers.model_runner import ModelRunner
from workers_testkit import NewRequest, ids, plan

native = pytest.mark.skipif(not cpu_ops.native_linear_available(),
                            reason="the native kernel needs the built extension and an AVX-512 CPU")  # fmt: skip


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of the same bf16 values in float64, rounded once to bf16."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(torch.bfloat16)


@native
@pytest.mark.parametrize(("shape", "n", "with_bias"), [
    ((1, 576), 960, False), ((2, 100), 37, True), ((1, 1, 33), 5, True), ((2, 1536), 576, False),
    ((7, 576), 960, True), ((4, 16, 1536), 576, False),  # batches: the packed-panel kernel
])  # fmt: skip
def test_native_linear_matches_a_float64_reference(shape: tuple[int, ...], n: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    weight = torch.randn(n, shape[-1], generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    with torch.inference_mode():
        got = cpu_ops.linear(x, weight, bias)
    want = reference(x, weight, bias)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # Within one bf16 rounding of the exact product (float32 accumulation adds far less).
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@native
def test_bf16_products_on_contiguous_weights_take_the_native_kernel_unless_k_is_odd_past_two_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int, int]] = []
    real = cpu_ops._KERNELS

    class Recording:
        def linear_bf16(self, x: int, w: int, b: int, y: int, m: int, n: int, k: int, threads: int,
                        residual: int) -> None:  # fmt: skip
            assert threads == torch.get_num_threads()  # torch's intra-op thread count is the kernel's too
            calls.append((m, n, k))
            real.linear_bf16(x, w, b, y, m, n, k, threads=threads, residual=residual)

    monkeypatch.setattr(cpu_ops, "_KERNELS", Recording())
    weight = torch.randn(8, 64).to(torch.bfloat16)
    with torch.inference_mode():
        cpu_ops.linear(torch.randn(1, 64).to(torch.bfloat16), weight)
        cpu_ops.linear(torch.randn(64, 64).to(torch.bfloat16), weight)  # a batch: the packed-panel kernel
        odd = torch.randn(8, 33).to(torch.bfloat16)
        cpu_ops.linear(torch.randn(2, 33).to(torch.bfloat16), odd)  # odd K, two rows: the dot-product tiles
        cpu_ops.linear(torch.randn(3, 33).to(torch.bfloat16), odd)  # odd K, three rows: PyTorch
        cpu_ops.linear(torch.randn(1, 64), weight.float())  # float32: PyTorch
        cpu_ops.linear(torch.randn(1, 64).to(torch.bfloat16), torch.randn(64, 8).to(torch.bfloat16).T)  # strided
    assert calls == [(1, 8, 64), (64, 8, 64), (2, 8, 33)]


@pytest.mark.skipif(not cpu_ops.native_linear_available(), reason="needs AVX-512 and the built kernels")
def test_a_product_split_over_two_threads_equals_the_single_threaded_one() -> None:
    kernels = cpu_ops._KERNELS
    torch.manual_seed(0)
    x = torch.randn(2, 576).to(torch.bfloat16)
    weight = torch.randn(1538, 576).to(torch.bfloat16)  # large enough to split; the halves meet mid-tile
    outs = []
    for threads in (1, 2):
        y = torch.full((2, 1538), float("nan"), dtype=torch.bfloat16)
        kernels.linear_bf16(x.data_ptr(), weight.data_ptr(), 0, y.data_ptr(), 2, 1538, 576, threads=threads)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])  # each row is summed in the same order whichever thread does it
    torch.testing.assert_close(outs[1].float(), x.float() @ weight.float().T, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(cpu_ops._MODULE is None or not cpu_ops._MODULE.has_avx512f_linear(),
                    reason="needs AVX-512F/BW and the built kernels")  # fmt: skip
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 1538, 576), (3, 100, 33), (8, 576, 1536), (64, 192, 576),
                                              (27, 130, 577), (200, 960, 576)])  # fmt: skip
def test_the_path_for_cpus_without_bf16_dot_products_matches_the_portable_one(rows: int, n: int, k: int) -> None:
    # Forced, so AVX512-BF16 machines check it too: up to 9 rows each bf16 pair widened in registers (two FMAs per
    # pair), from 10 rows float32 weight panels (any K).
    kernels = cpu_ops._MODULE
    torch.manual_seed(rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    weight = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    outs = {}
    for name, flags in {"portable": {"force_portable": True}, "fma": {"avx512f_only": True},
                        "fma_two_threads": {"avx512f_only": True, "threads": 2}}.items():  # fmt: skip
        y = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        kernels.linear_bf16(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n, k, **flags)
        outs[name] = y
    assert torch.equal(outs["fma"], outs["fma_two_threads"])
    # Float32 sums in another order than the portable loop's: at most one bf16 rounding step apart.
    torch.testing.assert_close(outs["fma"].float(), outs["portable"].float(), rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(outs["fma"].float(), x.float() @ weight.float().T + bias.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(cpu_ops._MODULE is None or not cpu_ops._MODULE.has_avx512f_linear(),
                    reason="needs AVX-512F/BW and the built kernels")  # fmt: skip
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 50, 7), (4, 960, 576), (11, 130, 577), (63, 576, 1536),
                                              (200, 97, 64)])  # fmt: skip
def test_float32_panels_match_pytorch_and_the_portable_loops(rows: int, n: int, k: int) -> None:
    kernels = cpu_ops._MODULE
    torch.manual_seed(rows)
    x = torch.randn(rows, k)
    weight = torch.randn(n, k)
    bias = torch.randn(n)
    residual = torch.randn(rows, n)
    want = residual + F.linear(x.double(), weight.double(), bias.double()).float()
    outs = {}
    paths = {"panels": {}, "panels_two_threads": {"threads": 2}, "portable": {"force_portable": True}}
    for name, flags in paths.items():
        y = torch.full((rows, n), float("nan"))
        kernels.linear_f32(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n, k,
                           residual=residual.data_ptr(), **flags)  # fmt: skip
        outs[name] = y
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4 * k**0.5)
    assert torch.equal(outs["panels"], outs["panels_two_threads"])  # each value summed in the same order


@pytest.mark.skipif(not cpu_ops.native_linear_available() or not cpu_ops._MODULE.has_avx512f_linear(),
                    reason="needs AVX-512F/BW and the built kernels")  # fmt: skip
def test_float32_linear_goes_native_only_for_its_row_range(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = cpu_ops._KERNELS.linear_f32

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(cpu_ops._MODULE, name)

        def linear_f32(self, *args: object, **kwargs: object) -> None:
            calls.append(args[4])
            real(*args, **kwargs)

    monkeypatch.setattr(cpu_ops, "_KERNELS", Spy())
    weight = torch.randn(33, 20)
    for rows in (1, 3, 4, 63, 64, 100):
        x = torch.randn(rows, 20)
        torch.testing.assert_close(cpu_ops.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == [4, 63]


def test_shape_errors_are_pytorchs() -> None:
    with pytest.raises(RuntimeError):
        cpu_ops.linear(torch.randn(1, 3).to(torch.bfloat16), torch.randn(4, 5).to(torch.bfloat16))


def tiny_model(dtype: torch.dtype, bias: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, attention_bias=bias, max_position=256)  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def greedy_logits(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Logits of a prefill then `steps` decode steps, through the runner (which fuses the projections)."""
    runner = ModelRunner(model, block_size=16, num_kv_blocks=8)
    captured: list[torch.Tensor] = []
    forward = model.forward

    def capture(*args: object, **kwargs: object) -> torch.Tensor:
        logits = forward(*args, **kwargs)
        captured.append(logits.float())
        return logits

    model.forward = capture  # type: ignore[method-assign]
    request = NewRequest(0, ids(*prompt), ids(0, 1), temperature=0.0)
    runner.execute(plan(0, [(0, 0, len(prompt), True)], new_requests=[request]))
    for k in range(steps):
        runner.execute(plan(k + 1, [(0, len(prompt) + k, 1, True)]))
    return captured


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_the_unfused_models_logits_in_float32(bias: bool) -> None:
    unfused = tiny_model(torch.float32, bias)
    fused = tiny_model(torch.float32, bias)
    apply_fast_paths(fused)
    assert fused.model.layers[0].self_attn.qkv_weight is not None
    # The original parameters are views of the fused matrix: loading into them updates what the forward uses.
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    tokens = torch.tensor([3, 14, 15, 92, 65])
    outs = []
    for model in (unfused, fused):
        model.bind_kv_cache(KVCache.allocate(model.config, 2, 16, torch.float32, "cpu"), TorchSdpaBackend())
        md = AttentionMetadata.build([5], [5], [[0]], 16, None)
        with torch.inference_mode(), attention_metadata_scope(md):
            outs.append(model(tokens, torch.arange(5)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_bf16_decode_with_the_native_kernel_tracks_pytorchs_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kernel = greedy_logits(tiny_model(torch.bfloat16, True), [5, 6, 7, 8, 9], 4)
    monkeypatch.setattr(cpu_ops, "_KERNELS", None)
    without = greedy_logits(tiny_model(torch.bfloat16, True), [5, 6, 7, 8, 9], 4)
    for a, b in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_equals_the_plain_models(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    fast = NativeRMSNorm(576, 1e-5).to(dtype)
    fast.load_state_dict(norm.state_dict())
    x = (torch.randn(2, 576, 7) * 3).to(dtype).transpose(1, 2)  # [2, 7, 576], not contiguous
    with torch.inference_mode():
        native = fast(x)
        reference = norm(x)
    assert native.shape == reference.shape and native.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(native, reference)  # the same two roundings
    else:
        torch.testing.assert_close(native, reference, atol=2e-6, rtol=1e-6)


@pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the AVX-512 path for bf16 (16 pairs at a time)
def test_native_rope_in_place_equals_the_plain_rotation(dtype: torch.dtype, head_dim: int) -> None:
    config = LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=96, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=head_dim, max_position=300, rope_theta=10000.0)  # fmt: skip
    rotary = RotaryEmbedding(config)
    torch.manual_seed(1)
    qkv = (torch.randn(5, 8, head_dim) * 2).to(dtype)  # [tokens, q + k + v heads, head_dim]
    positions = torch.tensor([0, 1, 17, 250, 299])
    with torch.inference_mode():
        reference = rotate(qkv[:, :6], rotary(positions, dtype))
        in_place = qkv.clone()
        # A strided view inside the fused output.
        assert cpu_ops.rope_(in_place[:, :6], positions, rotary.cos_sin(in_place.device))
    assert torch.equal(in_place[:, :6], reference)  # the same roundings, bit for bit
    assert torch.equal(in_place[:, 6:], qkv[:, 6:])  # the value heads are not touched


@pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")
def test_native_rope_refuses_a_position_outside_the_table_and_changes_nothing() -> None:
    table = torch.randn(2, 8, 4)
    x = torch.randn(2, 3, 4)
    before = x.clone()
    with pytest.raises(ValueError, match="position 8 outside"):
        cpu_ops.rope_(x, torch.tensor([1, 8]), table)
    assert torch.equal(x, before)
    assert not cpu_ops.rope_(x, torch.tensor([1, 2]), table.double())  # a table it does not take: PyTorch's path


@pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_silu_mul_equals_the_pytorch_formulation(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(3, 40, 2 * 240) * 4).to(dtype)  # 120 rows of 240: enough to split over two threads
    with torch.inference_mode():
        assert cpu_ops.silu_mul(torch.zeros(4, 7, dtype=dtype)) is None  # an odd last dim: PyTorch's
        native = cpu_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        reference = torch.nn.functional.silu(gate) * up
    assert native is not None and native.shape == reference.shape and native.dtype == dtype
    if dtype == torch.bfloat16:
        # exp differs from PyTorch's vectorised one in the last float bit at most: after bf16 rounding that shows
        # (as one bf16 step) in a handful of values at most.
        differ = native != reference
        assert differ.float().mean() < 0.02
        torch.testing.assert_close(native, reference, rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(native, reference, rtol=2e-6, atol=1e-6)


def test_the_native_decoder_ops_give_pytorchs_greedy_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    native = greedy_logits(tiny_model(torch.float32, True), [5, 6, 7, 8, 9], 4)
    monkeypatch.setattr(cpu_ops, "_ATTENTION", None)
    reference = greedy_logits(tiny_model(torch.float32, True), [5, 6, 7, 8, 9], 4)
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_write_equals_index_copy_and_refuses_bad_slots(dtype: torch.dtype) -> None:
    from ringserve.workers.attention.backend import write_kv

    torch.manual_seed(3)
    blocks, block_size, kv_heads, head_dim, heads = 5, 4, 3, 16, 9
    qkv = torch.randn(6, heads + 2 * kv_heads, head_dim).to(dtype)  # k and v as strided views, as in the model
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.tensor([19, 0, 7, 8, 3, 12])
    caches = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    assert cpu_ops.write_kv_(caches[0], caches[1], k, v, slots)
    caches[2].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    caches[3].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    fresh_k, fresh_v = torch.zeros_like(caches[0]), torch.zeros_like(caches[1])
    with pytest.raises(ValueError, match="slot 20 outside"):
        write_kv(fresh_k, fresh_v, k, v, torch.tensor([1, 2, 3, 4, 5, 20]))
    assert not fresh_k.any() and not fresh_v.any()  # checked before anything was written
    # Tensors it does not take are left to index_copy_: int32 slots, a cache dtype unlike the keys'.
    assert not cpu_ops.write_kv_(fresh_k, fresh_v, k, v, slots.int())
    assert not cpu_ops.write_kv_(fresh_k.double(), fresh_v.double(), k, v, slots)


@native
@pytest.mark.parametrize("rows", [1, 7])  # the dot-product tiles and the packed panels
def test_a_residual_is_added_before_the_one_rounding(rows: int) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    residual = (torch.randn(rows, 40, generator=gen) * 4).to(torch.bfloat16)
    with torch.inference_mode():
        got = cpu_ops.linear(x, weight, None, residual)
        plain = cpu_ops._plain_linear(x, weight, None, residual)  # PyTorch: the product rounded, then the sum
    want = (x.double() @ weight.double().T + residual.double()).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert torch.equal(plain, residual + torch.nn.functional.linear(x, weight))


def test_tensor_parallel_hooks_see_the_projection_without_the_residual() -> None:
    proj = cpu_ops.Linear(8, 4, bias=False).to(torch.bfloat16)
    seen: list[torch.Tensor] = []
    proj.register_forward_hook(lambda _m, _i, out: seen.append(out.clone()))
    x = torch.randn(3, 8).to(torch.bfloat16)
    residual = torch.randn(3, 4).to(torch.bfloat16)
    with torch.inference_mode():
        out = _project(proj, x, residual)
        alone = proj(x)
    assert torch.equal(seen[0], alone)  # the hook got the projection alone (as an all-reduce needs)
    assert torch.equal(out, residual + alone)
