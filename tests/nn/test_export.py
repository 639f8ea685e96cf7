"""ONNX export (``tpkit.te_api.onnx_export``, TE's ``onnx_export``; tpkit.nn.export).

A GPT (its loss, with targets), a Llama (its logits, batch and sequence dynamic) and a
stack of tpkit.te_api classes (TE's API), built at tp=1, are exported with
``torch.onnx.export`` inside ``onnx_export(True)`` and run in onnxruntime, an
independent runtime: its outputs equal the torch model's, computed outside the export
mode, within 1e-5. A tp=2 or cp=2 layout is refused on entry, and so is tpkit's
emulated fp8 (either nesting order); a layer of a tp=2 state is refused at its collective
(tests/test_bad_input.py, ``te-api-onnx-*``: also a MoE layer and TorchScript's
exporter, ``dynamo=False``)."""
import pytest
import torch

from dist import run

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _export_and_run(model, args, path, feeds, **kw):
    import onnxruntime as ort

    import tpkit.te_api as te
    with te.onnx_export(enabled=True):
        torch.onnx.export(model, args, path, dynamo=True, verbose=False, **kw)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return [torch.from_numpy(sess.run(None, {n: t.numpy() for n, t in zip(names, f)})[0])
            for f in feeds]


def _export_rank(tmp):
    import tpkit
    from tpkit.models import GPT, GPTConfig, Llama, LlamaConfig
    tpkit.init_parallel(tp=1)
    torch.manual_seed(0)
    out = {}
    gpt = GPT(GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                        num_gqa_groups=2, ffn_hidden_size=64)).eval()
    tok, tgt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    tgt[0, 3] = -100                                   # ignore_index: 0, not in the mean
    (got,) = _export_and_run(gpt, (tok, tgt), f"{tmp}/gpt.onnx", [(tok, tgt)])
    with torch.no_grad():
        out["gpt"] = (got, gpt(tok, tgt))
    llama = Llama(LlamaConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                              num_heads=4, num_gqa_groups=2, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16})).eval()
    feeds = [(torch.randint(0, 64, (2, 8)),), (torch.randint(0, 64, (3, 13)),)]
    dyn = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    got = _export_and_run(llama, feeds[0], f"{tmp}/llama.onnx", feeds, dynamic_shapes=dyn)
    with torch.no_grad():
        out["llama"] = [(g, llama(*f)) for g, f in zip(got, feeds)]
    import tpkit.te_api as te       # a model written against TE's API (TE's defaults)
    stack = torch.nn.Sequential(te.TransformerLayer(32, 64, 4, num_gqa_groups=2,
                                                    normalization="RMSNorm",
                                                    activation="swiglu"),
                                te.LayerNormMLP(32, 64)).eval()   # eval: no dropout
    x = torch.randn(8, 2, 32)
    (got,) = _export_and_run(stack, (x,), f"{tmp}/te_api.onnx", [(x,)])
    with torch.no_grad():
        out["te_api"] = (got, stack(x))
    return out


@pytest.mark.slow
def test_gpt_and_llama_run_in_onnxruntime_as_in_torch(tmp_path):
    (out,) = run(_export_rank, 1, str(tmp_path))
    got, ref = out["gpt"]
    assert got.shape == ref.shape == ()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for got, ref in [*out["llama"], out["te_api"]]:   # llama's second feed: other b and s
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def _refusals():
    import tpkit
    import tpkit.te_api as te
    msgs = []
    for layout in ({"tp": 2}, {"cp": 2}):
        tpkit.init_parallel(**layout)
        with pytest.raises(ValueError) as e:
            with te.onnx_export(True):
                pass
        msgs.append(str(e.value))
        tpkit.destroy_parallel()
    return msgs


def test_model_parallel_layouts_are_refused_on_entry():
    for tp_msg, cp_msg in run(_refusals, 2):
        for msg, what in ((tp_msg, "tp=2"), (cp_msg, "cp=2")):
            assert f"the current layout has {what}" in msg, msg
            assert "export at tp=cp=pp=ep=1" in msg and "load_full" in msg, msg


def test_emulated_fp8_is_refused_in_either_order():
    import tpkit.te_api as te
    with pytest.raises(ValueError, match="inside fp8_autocast.*export outside fp8_autocast"):
        with te.fp8_autocast(fp8_recipe="current"):
            with te.onnx_export(True):
                pass
    with pytest.raises(ValueError, match="inside onnx_export.*export without fp8_autocast"):
        with te.onnx_export(True):
            with te.fp8_autocast(fp8_recipe="current"):
                pass
    with te.onnx_export(False):      # TE's no-op: fp8 runs as usual
        with te.fp8_autocast(fp8_recipe="current"):
            pass
