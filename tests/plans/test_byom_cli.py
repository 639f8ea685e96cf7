"""tpkit-launch's flags placed after the script (issue 35): the script gets them, so the
launcher says where they belong (one warning line), unless the script has a
tpkit_preflight hook (it takes and checks such flags itself: launch/train.py --tp)."""
from tpkit.cli import launch


def test_flag_after_the_script_is_pointed_at(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert launch.main(["--dry-run", str(script), "--tp", "2", "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--tp comes after the script {script}" in err and \
        f"tpkit-launch --tp 2 {script}" in err, err
    # given before the script too, or a script with a hook: nothing to say
    assert launch.main(["--dry-run", "--tp", "2", "--nproc-per-node", "2", str(script),
                        "--tp", "2"]) == 0
    hooked = tmp_path / "hooked.py"
    hooked.write_text("def tpkit_preflight(argv, launch):\n    pass\n")
    assert launch.main(["--dry-run", str(hooked), "--tp", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_model_built_before_the_layout_says_when_to_build_it():
    """A tpkit layer (or tpkit.parallelize) before fabric.launch(): no layout exists yet."""
    import pytest
    import tpkit
    from tpkit.nn import ColumnParallelLinear
    assert not tpkit.is_initialized()
    for build in (lambda: ColumnParallelLinear(4, 4),
                  lambda: tpkit.parallelize(__import__("torch").nn.Linear(4, 4))):
        with pytest.raises(RuntimeError, match=r"build the model after fabric\.launch\(\)"):
            build()


def test_sliding_window_longer_than_the_window_is_refused():
    """Mistral's sliding window: the plan's attention is plain causal, so a sequence longer
    than the window is a ValueError (shorter ones are the same computation)."""
    import pytest
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    import tpkit
    from tpkit.layout.planning import fake_state
    from tpkit.layout.config import ParallelConfig
    torch.manual_seed(0)
    m = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=8))
    ref = m(input_ids=torch.arange(8)[None] % 64).logits
    with fake_state(ParallelConfig(), 1) as state:
        model = tpkit.parallelize(m, state=state)
        torch.testing.assert_close(model(input_ids=torch.arange(8)[None] % 64).logits, ref)
        with pytest.raises(ValueError, match="sliding window of 8 tokens"):
            model(input_ids=torch.arange(12)[None] % 64)
