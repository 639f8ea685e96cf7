"""tpkit.verify (issue 43): a user's model (tests/verify_models.py, written the way users
write theirs) with each mistake users make planted behind a switch, verified at three
layouts in one batch (one set of processes per layout for every case); the report must
name the right first module, and the clean model must pass everywhere. The command line
runs tpkit's own Llama (tpkit layers) the user's way, and a planted case for its exit 1.

The reference each report is checked against is written here by hand: which module a
mistake must be reported at follows from where it was planted, not from tpkit.verify."""
import os
import subprocess
import sys

import pytest
import torch

import byom_models
import verify_models as vm
from tpkit.plans import Attention, Column, Plan
from tpkit.verifier import Layout, expected_piece, parse_layouts, verify_all

LAYOUTS = "2x1x1,2x2x1+sp,1x2x2"
TP2 = ("2x1x1", "2x2x1+sp")
ALL = ("2x1x1", "2x2x1+sp", "1x2x2")


def _case(mistakes=vm.Mistakes(), build=None, **kw):
    case = dict(build_model=build or (lambda: vm.Decoder(mistakes=mistakes)),
                make_batch=vm.make_batch, plan=vm.plan(), optimizer=vm.optimizer)
    case.update(kw)
    return case


M = vm.Mistakes
# name: (case, {layout: (what the report says, the first module)}; other layouts: OK)
PLANTED = {
    "clean": (_case(), {}),
    "unsharded input at cp=2": (
        _case(plan=vm.plan(shard=vm.no_shard)),
        {"2x2x1+sp": ("output", "embed"), "1x2x2": ("output", "embed")}),
    "missing SP gradient sum": (
        _case(plan=vm.plan(norm=vm.Keep())),
        {"2x2x1+sp": ("parameter gradient", "layers.0.attn_norm")}),
    "row style on a column-split weight": (
        _case(build=vm.build_transposed),
        {lay: ("output", "layers.0.mlp.down") for lay in ALL}),
    "optimizer holding swapped-out parameters": (
        _case(M(cached_params=True)),
        {lay: ("update of the parameter", "embed") for lay in ALL}),
    "q/k/v in the wrong order": (
        _case(plan=vm.plan(qkv=("q_proj", "v_proj", "k_proj"))),
        {lay: ("output", "layers.0.attn") for lay in ALL}),
    "dropout mask identical across TP ranks": (
        _case(M(same_dropout=True)),
        {lay: ("dropout mask", "layers.0.mlp.drop") for lay in TP2}),
    "wrong KV-head split under GQA": (
        _case(M(tile_kv=True)),
        {lay: ("output", "layers.0.attn") for lay in ALL}),
    # issue 51: a fused gate/up given Column() without segments= (trained wrong, no word)
    "fused gate/up without segments": (
        _case(M(fused_gate_up=True), plan=vm.plan(fused=Column())),
        {lay: ("output", "layers.0.mlp") for lay in TP2}),
    "fused gate/up with segments": (
        _case(M(fused_gate_up=True), plan=vm.plan(fused=Column(segments=(64, 64)))), {}),
    # a plan that makes a layer raise (kv_heads=4 for the model's 2): named with its error
    "a plan whose attention raises": (
        _case(plan=Plan({**vm.plan().layers, "layers.*.attn": Attention(
            heads="heads", kv_heads=4, qkv=("q_proj", "k_proj", "v_proj"), out="o_proj")},
            shard_inputs=vm.shard_inputs)),
        {lay: ("error", "layers.0.attn") for lay in ALL}),
    # a ready plan (nanoGPT's GPT, its tied head and its position table: no batch dim)
    "nanoGPT, ready plan": (dict(build_model=lambda: byom_models.nanogpt(),
                                 make_batch=vm.make_batch), {}),
    # bf16 autocast on both sides: the wider tolerance passes the clean model and still
    # names the missing sum
    "clean, bf16 autocast": (_case(precision="bf16-mixed"), {}),
    "missing SP gradient sum, bf16 autocast": (
        _case(plan=vm.plan(norm=vm.Keep()), precision="bf16-mixed"),
        {"2x2x1+sp": ("parameter gradient", "layers.0.attn_norm")}),
}


@pytest.fixture(scope="module")
def reports():
    """A planted mistake is reported in the first step (every step is compared in forward
    order, and each mistake is in the first forward, backward or update), so the planted
    cases run one step; the cases that must pass run verify's default three, where a false
    report after an update would show."""
    return verify_all({name: dict(case, steps=1) if want else case
                       for name, (case, want) in PLANTED.items()}, layouts=LAYOUTS,
                      timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_mistake_reported_at_its_first_module(reports, name):
    report, want = reports[name], PLANTED[name][1]
    text = str(report)
    assert report.ok == (not want), text
    for result in report.results:
        lay = str(result.layout)
        if lay not in want:
            assert result.ok and result.text.startswith(f"{lay}: OK"), text
            continue
        what, module = want[lay]
        assert not result.ok, text
        first = result.findings[0]
        assert (first.what, first.module) == (what, module), text
        assert f"{what} of module '{module}'" in result.text, text
        assert "hint:" in result.text, text
    if name == "unsharded input at cp=2":
        assert "unsharded" in text
    if name.startswith("missing SP gradient sum"):
        assert "add up to the reference's" in text
    if name == "a plan whose attention raises":
        assert "raised RuntimeError" in text and "every module before it agrees" in text
    if name == "fused gate/up without segments":
        assert "child 'layers.0.mlp.proj_in' has no segments" in text and \
            "Column(segments=(size, size, ...))" in text
    if name == "optimizer holding swapped-out parameters":
        assert "not the model's parameters" in text


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(
            os.path.dirname(os.path.abspath(vm.__file__)))]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tpkit.cli.verify", *args],
                          cwd=os.path.dirname(os.path.abspath(vm.__file__)), env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_cli_verifies_tpkit_llama_at_three_layouts():
    """tpkit's own 2-layer Llama (tpkit layers, built at each layout): exit 0, one line
    per layout and the time taken (issue 43 asks for < 60 s here; not asserted)."""
    r = _cli("verify_models:build_llama", "--layouts", LAYOUTS)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == list(ALL), r.stdout
    assert all(": OK" in ln and "tpkit layers" in ln for ln in lines[:3]), r.stdout
    assert lines[3].startswith("verified: 3 layout(s) in ") and " s " in lines[3], r.stdout
    print(r.stdout)


@pytest.mark.slow
def test_cli_exits_1_naming_the_module(capsys):
    from tpkit.cli.verify import main
    assert main(["verify_models:build_transposed", "--plan", "verify_models:PLAN",
                 "--optimizer", "verify_models:optimizer", "--layouts", "2x1x1"]) == 1
    out = capsys.readouterr().out
    assert "output of module 'layers.0.mlp.down'" in out, out
    assert out.strip().splitlines()[-1].startswith("FAILED"), out


def test_cli_bad_argument_is_one_line_exit_2(capsys):
    from tpkit.cli.verify import main
    assert main(["verify_models:build", "--layouts", "2x2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layouts: '2x2' is not a layout" in err[0], err
    assert main(["verify_models:missing"]) == 2
    assert "'verify_models' has no 'missing'" in capsys.readouterr().err


def test_layouts_parse():
    assert parse_layouts("2x1x1, 2x2x1+sp,1x2x2") == [
        Layout(2, 1, 1), Layout(2, 2, 1, True), Layout(1, 2, 2)]
    assert str(Layout(2, 2, 1, True)) == "2x2x1+sp" and Layout(2, 2, 2).world == 8


def test_expected_piece_cuts_as_the_layout_does():
    """Each rank's piece of a reference activation [b=4, s=16, h], written out by hand:
    CP rank r holds chunks r and 3-r of 4 (load-balanced), SP then the TP rank's half of
    those tokens, DP the replica's rows; a fused column output is cut per segment."""
    ref = torch.arange(4 * 16 * 6, dtype=torch.float32).view(4, 16, 6)
    lay = Layout(2, 2, 2, True)
    coords = dict(tp=1, cp=1, dp=1)
    tokens = list(range(4, 8)) + list(range(8, 12))          # chunks 1 and 2 (cp rank 1)
    want = ref[2:4, tokens[4:], :]                            # dp rank 1, SP: tp rank 1's half
    got, why = expected_piece(ref, want.shape, coords, lay, rows=4, seq=16)
    assert why is None and torch.equal(got, want)
    # a column-parallel output [b, s, 4 + 2] with segments (4, 2): tp rank 1 holds 2:4 and 5:6
    lay = Layout(2, 1, 1)
    want = torch.cat([ref[..., 2:4], ref[..., 5:6]], -1)
    got, why = expected_piece(ref, want.shape, dict(tp=1, cp=0, dp=0), lay, 4, 16, (4, 2))
    assert why is None and torch.equal(got, want)
    # the whole sequence on a CP rank is named as such
    got, why = expected_piece(ref, ref.shape, dict(tp=0, cp=0, dp=0), Layout(1, 2, 1), 4, 16)
    assert got is None and why == "unsharded"
