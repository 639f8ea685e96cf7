"""Issue 40's TE behaviour, as the fake TE models it, checked against TE 2.20.2's sources
(parsed with ``ast``, nothing imported; the wheel as in tests/te/test_te_contract.py).
tests/te/test_te_multigpu.py relies on each: if TE changes one, the check here fails first.

Row 1: GroupedLinear does not pad (the caller must) and the alignment rule; row 2: a
module's amax joins the global buffer once, on its first forward, and the outermost
autocast's exit MAX-reduces the concatenated buffer; rows 3 and 8: DotProductAttention's
tracker handling (no fork under SP, the states registered for CUDA graphs, the capture
assertion) and graph capture's ``register_generator_state``; row 4: fp8 scales replayed
only in TE's checkpoint's recompute phase; row 9: quantized_model_init keeps the recipe
as given and modules ask it for its type; row 10: autocast keys hold ``id(group)`` and
the state tpkit.te.forget_groups drops. (Row 5 is torch's behaviour, not TE's.)
"""
import ast
import os

import pytest

import te_contract as c

FAKE_DIR = os.path.dirname(c.FAKE_FILE)
Q = c.PT + "quantization.py"
BASE = c.PT + "module/base.py"
DPA = c.PT + "attention/dot_product_attention/dot_product_attention.py"
DIST = c.PT + "distributed.py"


@pytest.fixture(scope="module")
def real():
    return c.sources_or_skip()


def fake(name: str) -> str:
    with open(os.path.join(FAKE_DIR, name)) as f:
        return f.read()


def code(source: str, qualname: str) -> str:
    """``qualname``'s code, normalised by ast (comments and docstrings gone)."""
    fn = c._find(ast.parse(source), qualname)
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and \
        isinstance(fn.body[0].value, ast.Constant) else fn.body
    return "\n".join(ast.unparse(n) for n in body)


def if_tests(source: str, qualname: str) -> list[str]:
    return [ast.unparse(n.test) for n in ast.walk(c._find(ast.parse(source), qualname))
            if isinstance(n, ast.If)]


pinned = pytest.mark.skipif(c.TE_VERSION != c.PINNED_TE_VERSION,
                            reason=f"the fake mirrors TE {c.PINNED_TE_VERSION}")


@pinned
def test_row1_grouped_linear_leaves_padding_to_the_caller(real):
    gl = real[c.PT + "module/grouped_linear.py"]
    assert "get_align_size_for_quantization" not in gl and "Fp8Padding" not in gl
    assert code(real[Q], "get_align_size_for_quantization") == \
        code(fake("quantization.py"), "get_align_size_for_quantization")
    # tpkit.te reads both from transformer_engine.pytorch.quantization
    assert c.exporting_file(real, "FP8GlobalStateManager", Q) == Q
    assert "Fp8Padding" in c.exported_names(real[c.PT + "__init__.py"])   # TE's own padding


@pinned
def test_row2_amax_registered_once_on_first_forward_and_reduced_in_order(real):
    add = code(real[Q], "FP8GlobalStateManager.add_fp8_tensors_to_global_buffer")
    assert "if index_in_buffer in fp8_meta:\n    return" in add
    assert "if index_in_buffer in fp8_meta:\n    return" in code(
        fake("quantization.py"), "FP8GlobalStateManager.add_fp8_tensors_to_global_buffer")
    assert ".append(fp8_meta[fp8_meta_tensor_key].amax_history[0])" in add
    prepare = code(real[BASE], "TransformerEngineBaseModule.prepare_forward")
    assert "FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)" in prepare
    assert "add_fp8_tensors_to_global_buffer" not in code(
        real[BASE], "TransformerEngineBaseModule.__init__")
    reduce = code(real[Q], "FP8GlobalStateManager.reduce_and_update_fp8_tensors")
    assert "contiguous_amax = torch.cat(amax_buffer)" in reduce
    assert "cls.reduce_tensor_across_group_op_max(contiguous_amax, group)" in reduce
    assert "ReduceOp.MAX" in code(real[Q],
                                  "FP8GlobalStateManager.reduce_tensor_across_group_op_max")
    real_exit = if_tests(real[Q], "FP8GlobalStateManager.autocast_exit")
    assert real_exit == if_tests(fake("quantization.py"), "FP8GlobalStateManager.autocast_exit")
    assert "autocast_exit" in code(real[Q], "autocast.__exit__")


@pinned
def test_rows3_and_8_attention_tracker_and_graph_capture(real):
    init = c._find(ast.parse(real[DPA]), "DotProductAttention.__init__")
    fake_init = c._find(ast.parse(fake("__init__.py")), "DotProductAttention.__init__")

    def no_fork(fn):
        return [(ast.unparse(n.test), ast.unparse(n.body[0])) for n in ast.walk(fn)
                if isinstance(n, ast.If) and "attention_dropout_ctx" in ast.unparse(n)]
    want = no_fork(init)[0]
    assert want[0] == "sequence_parallel or get_rng_state_tracker is None"
    assert want[1] == "attention_dropout_ctx = nullcontext"
    assert no_fork(fake_init)[0] == (want[0], "attention_dropout_ctx = contextlib.nullcontext")
    assert "set_all_rng_states(self.rng_states_tracker.get_states())" in ast.unparse(init)
    assert "_distributed.set_all_rng_states(self.rng_states_tracker.get_states())" in \
        ast.unparse(fake_init)
    assert "isinstance(self.rng_states_tracker, CudaRNGStatesTracker)" in \
        code(real[DPA], "DotProductAttention.forward")
    assert "isinstance(self.rng_states_tracker, CudaRNGStatesTracker)" in \
        code(fake("__init__.py"), "DotProductAttention.forward")
    graph = real[c.PT + "graph.py"]
    assert "for _, state in get_all_rng_states().items():" in graph
    assert "fwd_graph.register_generator_state(state)" in graph
    assert "set_all_rng_states(self.states_)" in code(real[DIST], "CudaRNGStatesTracker.set_states")
    exported = c.exported_names(real[c.PT + "__init__.py"])
    assert {"make_graphed_callables", "CudaRNGStatesTracker"} <= exported


@pinned
def test_row4_fp8_scales_replayed_only_in_te_checkpoint(real):
    dist_src = real[DIST]
    assert "activation_recompute_forward(activation_recompute=True, recompute_phase=False)" \
        in dist_src
    assert "recompute_phase=True" in dist_src
    prepare = c._find(ast.parse(real[BASE]), "TransformerEngineBaseModule.prepare_forward")
    branch = next(n for n in ast.walk(prepare) if isinstance(n, ast.If) and
                  ast.unparse(n.test) == "self.fp8 and in_fp8_activation_recompute_phase()")
    assert "get_old_fp8_meta_tensors_for_recompute" in ast.unparse(branch.body)
    assert "add_fp8_tensors_to_global_buffer" in ast.unparse(branch.orelse)   # first forward
    assert "add_fp8_tensors_to_global_buffer" not in ast.unparse(branch.body)
    fake_prepare = code(fake("__init__.py"), "GroupedLinear._prepare_fp8_forward")
    assert "if not _distributed.in_fp8_activation_recompute_phase():" in fake_prepare


@pinned
def test_row9_model_init_keeps_the_recipe_as_given(real):
    init = code(real[Q], "quantized_model_init")
    assert "qstate.fp8_recipe = get_default_fp8_recipe() if recipe is None else recipe" in init
    assert "qstate.fp8_recipe = DelayedScaling() if recipe is None else recipe" in \
        code(fake("__init__.py"), "quantized_model_init")
    assert "recipe.delayed()" in real[BASE]   # modules ask the recipe for its type


@pinned
def test_row10_autocast_state_is_keyed_by_group_identity(real):
    key = code(real[Q], "FP8GlobalStateManager.get_unique_autocast_key")
    assert "group_id = id(group) if group is not None else None" in key
    assert "group_id = id(group) if group is not None else None" in \
        code(fake("quantization.py"), "FP8GlobalStateManager.get_unique_autocast_key")
    assert code(real[Q], "FP8GlobalStateManager.get_key_in_buffer").endswith(
        "return f'{fwd_bwd_key}_{autocast_key}'")
    fields = {f for f, _, _ in c.class_fields(real[Q], "FP8GlobalState")[0]}
    assert {"autocast_arguments", "global_amax_buffer", "global_amax_history_buffer",
            "global_scale_buffer", "autocast_depth"} <= fields   # what forget_groups edits
    assert "recipe, group = qstate.autocast_arguments[autocast_key]" in \
        code(real[Q], "FP8GlobalStateManager.reduce_and_update_fp8_tensors")
    assert code(real[Q], "FP8GlobalStateManager.get_buffer_info") == \
        code(fake("quantization.py"), "FP8GlobalStateManager.get_buffer_info")
