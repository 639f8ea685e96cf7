"""The fake TE (tests/fake_te) has exactly the real TE 2.20.2's signatures for what tpkit
uses, checked by parsing the real wheel's sources with ``ast``. With CI=true a wheel that
cannot be obtained fails the test; elsewhere it skips with the reason.

With ``TE_CONTRACT_VERSION`` naming another release, the tests that compare the fake with the
pinned release skip and the others (what tpkit passes to TE) check that release."""
import inspect
import os
import tomllib

import pytest

import te_contract as c
from te_fake import fake_te  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def real():
    """name -> source text of every real TE file the contract reads."""
    return c.sources_or_skip()


pinned_only = pytest.mark.skipif(
    c.TE_VERSION != c.PINNED_TE_VERSION,
    reason=f"the fake mirrors TE {c.PINNED_TE_VERSION}; TE_CONTRACT_VERSION={c.TE_VERSION} "
           "checks only what tpkit passes")


@pytest.fixture(scope="module")
def fake_src():
    with open(c.FAKE_FILE) as f:
        return f.read()


@pinned_only
def test_fake_signatures_equal_real(real, fake_src):
    diffs = []
    for fake_q, (path, real_q) in c.SIGNATURES.items():
        want, got = c.signature(real[path], real_q), c.signature(fake_src, fake_q)
        if want != got:
            missing = [p for p in want if p not in got]
            extra = [p for p in got if p not in want]
            diffs.append(f"{fake_q} vs {path}:{real_q}: missing {missing}, extra {extra}"
                         + ("" if missing or extra else " (order differs)"))
    assert not diffs, "\n".join(diffs)


def test_fake_runtime_signatures_are_its_source(fake_te, fake_src):
    """What tpkit calls at run time is what the contract parsed (no wrappers)."""
    for fake_q in c.SIGNATURES:
        obj = fake_te
        for part in fake_q.split("."):
            obj = getattr(obj, part)
        params = [(p.name, p.kind.name) for p in inspect.signature(obj).parameters.values()
                  if p.name != "self"]
        assert params == [(n, k) for n, k, _ in c.signature(fake_src, fake_q)], fake_q


def test_real_exports_what_tpkit_uses(real, fake_te):
    """Every name tpkit.te reads; of a renamed pair, either (the pinned release has both)."""
    exported = c.exported_names(real[c.PT + "__init__.py"])
    either = set(c.RENAMED) | set(c.RENAMED.values())
    assert set(c.EXPORTS) - either <= exported, set(c.EXPORTS) - either - exported
    for new, old in c.RENAMED.items():
        assert new in exported or old in exported, (new, old)
    if c.TE_VERSION == c.PINNED_TE_VERSION:
        assert set(c.EXPORTS) | set(c.OPTIONAL) <= exported, set(c.EXPORTS) - exported
    assert all(hasattr(fake_te, n) for n in c.EXPORTS)


def test_real_takes_what_tpkit_passes(real):
    """Each argument tpkit passes is a parameter of the real callable (positional ones in
    order) or one it takes out of ``**kwargs``; of a renamed pair, the callable tpkit.te
    picks in this release is checked."""
    exported = c.exported_names(real[c.PT + "__init__.py"])
    skipped = {old if new in exported else new for new, old in c.RENAMED.items()}
    problems = []
    for fake_q, passed in c.TPKIT_PASSES.items():
        if fake_q.split(".")[0] in skipped or (fake_q in c.OPTIONAL and fake_q not in exported):
            continue
        where, real_q = c.locate(real, *c.SIGNATURES[fake_q])
        sig = c.signature(real[where], real_q)
        names = [n for n, kind, _ in sig if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD",
                                                     "KEYWORD_ONLY")]
        if isinstance(passed, tuple):
            if tuple(names[:len(passed)]) != passed:
                problems.append(f"{real_q}: leading parameters {names[:len(passed)]}, tpkit "
                                f"passes {list(passed)} positionally")
            continue
        missing = set(passed) - set(names)
        if missing and any(kind == "VAR_KEYWORD" for _, kind, _ in sig):
            missing -= c.kwargs_read(real[where], real_q)  # checkpoint pops its options
            for op_path, op_q in c.NORM_OPS.items():  # norms hand theirs to the fused op
                if op_q.split(".")[0] == real_q.split(".")[0] and op_path in real:
                    missing -= {n for n, _, _ in c.signature(real[op_path], op_q)}
        if missing:
            problems.append(f"{real_q} lacks {sorted(missing)}")
    assert not problems, "\n".join(problems)


def test_real_modules_keep_tp_size(real):
    """wire_parallel_groups checks ``module.tp_size``: TE sets that attribute."""
    for path, cls in c.TP_SIZE_CLASSES.items():
        if path not in real:  # an older release keeps the class in another file
            path = next(p for p in sorted(real) if p.startswith(c.PT) and
                        f"class {cls}(" in real[p])
        assert c.assigns_self_attr(real[path], f"{cls}.__init__", "tp_size"), cls
        assert not c.assigns_self_attr(real[path], f"{cls}.__init__", "tensor_parallel_size")


@pinned_only
def test_norm_kwargs_and_enum(real, fake_te):
    """The fake norms accept exactly the options TE's norms pass on to their fused op, and
    the default of set_context_parallel_group's last argument is the same enum member."""
    for path, qualname in c.NORM_OPS.items():
        ops_kw = {n for n, kind, _ in c.signature(real[path], qualname) if kind == "KEYWORD_ONLY"}
        assert ops_kw == set(fake_te.NORM_OP_KWARGS), (path, ops_kw)
    members = c.enum_members(real[c.PT + "constants.py"], "CPLoadBalancingStrategy")
    assert members == {m.name: repr(m.value) for m in fake_te.CPLoadBalancingStrategy}


@pinned_only
def test_versions_agree(real, fake_te):
    import transformer_engine
    import tpkit.te
    from packaging.specifiers import SpecifierSet
    assert transformer_engine.__version__ == c.TE_VERSION == tpkit.te.CHECKED_TE_VERSION
    assert "metadata.version" in real["transformer_engine/__init__.py"]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["te"]
    spec = SpecifierSet(extra[0].split("]", 1)[1])
    assert c.TE_VERSION in spec, (extra, c.TE_VERSION)
    with open(os.path.join(ROOT, "README.md")) as f:
        assert c.TE_VERSION in f.read()


@pinned_only
def test_fake_transformer_layer_sets_layout_attributes_like_te(real, fake_src):
    path = c.PT + "transformer.py"
    want = c.self_assignments(real[path], "TransformerLayer.__init__")
    got = c.self_assignments(fake_src, "TransformerLayer.__init__")
    for attr in c.CONTAINER_ATTRS:
        assert (attr in want) == (attr in got), (attr, want.get(attr), got.get(attr))
    # TE turns SP off at tp_size 1; the fake must compute it the same way
    assert got["sequence_parallel"] == want["sequence_parallel"], \
        (got["sequence_parallel"], want["sequence_parallel"])
    real_set_tp = c.self_assignments(real[path], "TransformerLayer.set_tensor_parallel_group")
    fake_set_tp = c.self_assignments(fake_src, "TransformerLayer.set_tensor_parallel_group")
    assert set(real_set_tp) == set(fake_set_tp), (real_set_tp, fake_set_tp)


# --- fp8 recipes ----------------------------------------------------------------------------
@pinned_only
def test_fake_recipes_equal_real(real):
    """The fake's recipe classes have TE's fields (name, annotation, default source, in
    order), TE's class attributes, and TE's Format members."""
    with open(c.FAKE_RECIPE_FILE) as f:
        fake = f.read()
    for cls in c.RECIPE_CLASSES:
        want, got = c.class_fields(real[c.RECIPE_FILE], cls), c.class_fields(fake, cls)
        assert want == got, (cls, want, got)
    assert c.enum_members(real[c.RECIPE_FILE], "Format") == c.enum_members(fake, "Format")


def _norm(v):
    """A recipe field value comparable across TE's and tpkit's types."""
    if hasattr(v, "name") and hasattr(v, "value"):   # an Enum member (TE's Format)
        return v.name
    if type(v).__name__ == "QParams":
        return ("QParams", v.power_2_scale, v.amax_epsilon)
    if type(v).__name__ == "MMParams":
        return ("MMParams", v.use_split_accumulator)
    return v


@pinned_only
def test_tpkit_recipes_have_te_fields_and_defaults(fake_te, monkeypatch):
    """tpkit.fp8's recipes carry every field of TE's (the fake, checked above against TE's
    source), with TE's defaults; what tpkit has beyond them is a TE 1.x field kept for the
    emulation, or one TE 2.20.2 keeps as a class attribute (same value)."""
    import dataclasses
    import sys

    import tpkit.fp8
    import tpkit.te
    from tpkit.layout.config import FP8_RECIPES
    for var in ("NVTE_BACKWARD_OVERRIDE", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
                "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        monkeypatch.delenv(var, raising=False)   # TE read them when the fake was imported
    te_recipe = sys.modules["transformer_engine.common.recipe"]
    for cls_name in FP8_RECIPES.values():
        te_obj, ours = getattr(te_recipe, cls_name)(), getattr(tpkit.fp8, cls_name)()
        te_fields = [f.name for f in dataclasses.fields(te_obj)]
        our_fields = [f.name for f in dataclasses.fields(ours)]
        assert set(te_fields) <= set(our_fields), (cls_name, set(te_fields) - set(our_fields))
        for name in te_fields:
            assert _norm(getattr(ours, name)) == _norm(getattr(te_obj, name)), (cls_name, name)
        for name in set(our_fields) - set(te_fields):
            if name in tpkit.te._CLASS_ATTRS:
                assert _norm(getattr(ours, name)) == _norm(getattr(type(te_obj), name)), name
            else:
                assert getattr(ours, name) == tpkit.te._TPKIT_ONLY[name], (cls_name, name)
