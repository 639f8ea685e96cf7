"""tpkit.observe.flops: model FLOPs per token against torch's FlopCounterMode on the real
models (forward + backward), the device peaks and the MFU arithmetic.

What FlopCounterMode counts: every matmul (mm, addmm, bmm, the experts' per-expert mm)
at 2 FLOPs per multiply-add, forward and backward; fused attention kernels (flash,
efficient, cuDNN) at the full S x S square whatever ``is_causal`` says, with 5 matmuls in
their backward (the recomputed scores included), and the CPU flash kernel not at all. So
the check runs attention on SDPA's math backend, whose matmuls it counts as the peers'
convention does (2 forward, 4 backward, full S x S): the count is then exactly the
convention's, and any difference is the formula's."""

import pytest

from dist import run



def _gpt():
    """The reference GPT."""
    from tpkit.models.gpt import GPT, GPTConfig
    return GPT, GPTConfig


def _models():
    from tpkit.models import Llama, LlamaConfig
    GPT, GPTConfig = _gpt()
    return [
        ("gpt small", GPT, GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                     num_gqa_groups=2, ffn_hidden_size=64), 16),
        ("gpt larger", GPT, GPTConfig(vocab_size=96, hidden_size=64, num_layers=3, num_heads=8,
                                      num_gqa_groups=None, ffn_hidden_size=160), 32),
        ("llama small", Llama, LlamaConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=48,
                                           num_layers=2, num_heads=4, num_gqa_groups=2), 16),
        ("llama larger, tied", Llama,
         LlamaConfig(vocab_size=128, hidden_size=64, ffn_hidden_size=96, num_layers=3,
                     num_heads=4, num_gqa_groups=1, tie_word_embeddings=True), 32),
        ("moe top-2 of 4", GPT, GPTConfig(vocab_size=64, hidden_size=32, num_layers=2,
                                          num_heads=4, num_gqa_groups=2, ffn_hidden_size=48,
                                          moe_experts=4, moe_topk=2), 16),
        ("moe top-1 of 8, every 2nd", GPT,
         GPTConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4, num_gqa_groups=4,
                   ffn_hidden_size=96, moe_experts=8, moe_topk=1, moe_every=2), 32),
    ]


def _rank_counts():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    import tpkit
    from tpkit.observe import model_flops_per_token
    tpkit.init_parallel(seed=3)
    out = []
    batch = 2
    for name, cls, cfg, seq in _models():
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():   # Llama's default init is normal; GPT's too: fine for counting
            for p in model.parameters():
                p.normal_(0, 0.05)
        x = torch.randint(0, cfg.vocab_size, (batch, seq))
        counter = FlopCounterMode(display=False)
        with sdpa_kernel(SDPBackend.MATH), counter:
            model(x, torch.roll(x, -1, 1)).backward()
        out.append((name, counter.get_total_flops() / (batch * seq),
                    model_flops_per_token(model, seq), model_flops_per_token(cfg, seq)))
    return out


def test_flops_per_token_match_flop_counter():
    for name, counted, mine, from_cfg in run(_rank_counts, 1)[0]:
        assert mine == from_cfg, name
        assert abs(mine - counted) <= 0.02 * counted, \
            f"{name}: model_flops_per_token {mine:.0f} vs FlopCounterMode {counted:.0f}"


def test_flops_formula_by_hand():
    """One size worked by hand (the docstring's terms), independent of the code's sums."""
    from tpkit.models import LlamaConfig
    from tpkit.observe import model_flops_per_token
    cfg = LlamaConfig(vocab_size=100, hidden_size=8, ffn_hidden_size=12, num_layers=1,
                      num_heads=2, num_gqa_groups=1)
    # q 8x8, k 8x4, v 8x4, o 8x8 = 192; gate+up 8x24, down 12x8 = 288; head 8x100 = 800
    attn_core = 12 * 1 * 2 * 4 * 10
    assert model_flops_per_token(cfg, 10) == 6 * (192 + 288 + 800) + attn_core
    GPT, GPTConfig = _gpt()
    moe = GPTConfig(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_gqa_groups=2,
                    ffn_hidden_size=12, moe_experts=4, moe_topk=2, moe_every=2)
    dense_mlp, expert = 8 * 12 + 12 * 8, 8 * 12 + 12 * 8
    matmul = 2 * (8 * 8 * 4) + dense_mlp + (2 * expert + 8 * 4) + 800
    assert model_flops_per_token(moe, 10) == 6 * matmul + 12 * 2 * 2 * 4 * 10


def test_peaks_and_mfu_arithmetic():
    from tpkit.observe import mfu, peak_tflops, tflops_per_device
    h100 = "NVIDIA H100 80GB HBM3"       # torch.cuda.get_device_name on an H100 SXM
    assert peak_tflops(h100, "bf16") == pytest.approx(989.4)      # Lightning's table
    assert peak_tflops(h100, "bf16-mixed") == pytest.approx(989.4)
    assert peak_tflops(h100, "fp8") == pytest.approx(1978.9)
    assert peak_tflops("NVIDIA H200", "bf16") == pytest.approx(989.4)   # dense, not 1979
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312.0)
    assert peak_tflops("cpu", "bf16") is None
    # 87,235 tokens/s x 5.04 GFLOP/token on 1 device = 439.7 TFLOP/s; / 989.4 = 0.444
    t = tflops_per_device(87_235, 5.04e9, 1)
    assert t == pytest.approx(439.66, abs=0.01)
    assert mfu(t, peak_tflops(h100, "bf16")) == pytest.approx(0.4444, abs=1e-4)
    assert tflops_per_device(8 * 1000, 1e12, 8) == pytest.approx(1000.0)   # per device
    assert mfu(12.0, None) is None


@pytest.mark.parametrize("call, words", [
    (lambda f: f.peak_tflops("NVIDIA H100 80GB HBM3", "int4"), ["int4", "bf16"]),
    (lambda f: f.model_flops_per_token(object(), 8), ["object", "transformer_flops_per_token"]),
    (lambda f: f.transformer_flops_per_token(hidden_size=0, num_layers=1, num_heads=1,
                                             seq_len=1, vocab_size=1, ffn_hidden_size=1),
     ["hidden_size=0"]),
    (lambda f: f.tflops_per_device(1.0, 1.0, 0), ["devices=0"]),
])
def test_bad_input(call, words):
    from tpkit.observe import flops
    with pytest.raises(ValueError) as e:
        call(flops)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bench_gpu_figures_reproduce_benchmarks_md():
    """bench/gpu.py (GPU only) prints the logged figures; its arithmetic on the recorded
    run A TE bf16 / fp8 rates of the reference GPT (BENCHMARKS.md, "GPU runs"), and the
    Llama-3-8B shape's count, against counts by hand."""
    import bench.gpu as g
    h, f, L, kv, S, V = 2048, 8192, 16, 512, 4096, 256
    by_hand = 6 * (L * (h * (h + 2 * kv) + h * h + 2 * h * f) + h * V) + 12 * L * h * S
    gpt = dict(hidden=h, ffn=f, heads=16, kv_heads=4, vocab=V, seq=S, layers=L, gated=False)
    assert g.flops_per_token(gpt) == by_hand == 5_841_616_896
    r = g.figures(87_235, gpt, "NVIDIA H100 80GB HBM3", fp8=False, matmul_tflops=780)
    assert r["tflops"] == pytest.approx(87_235 * by_hand / 1e12)
    assert (round(r["tflops"], 1), round(r["mfu"], 3), round(r["of_matmul"], 3)) \
        == (509.6, 0.515, 0.653) and "mfu_fp8" not in r
    r = g.figures(110_085, gpt, "NVIDIA H100 80GB HBM3", fp8=True, matmul_tflops=780)
    assert (round(r["mfu"], 3), round(r["mfu_fp8"], 3)) == (0.650, 0.325)
    # Llama-3-8B's blocks: q 4096, k/v 1024 each, o, SwiGLU (gate, up, down), untied head
    h, f, kv, S, V, L = 4096, 14336, 1024, 8192, 128256, 7
    llama = dict(g.LLAMA3_8B, layers=L)
    by_hand = 6 * (L * (h * (h + 2 * kv) + h * h + 3 * h * f) + h * V) + 12 * L * h * S
    assert g.flops_per_token(llama) == by_hand
