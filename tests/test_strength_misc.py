"""Guards for weak spots found by planting bugs (issue 26) that need no launched script.

- DeepSpeed's ``sequence_share`` with *unequal* token counts on the CP ranks (padding,
  packed sequences): with equal counts a wrong reduction (local count times cp, a mean
  instead of a sum) gives the same number, so the counts differ here, and so do the DP
  replicas'. Reference: the mean over the replica's whole sequence, computed here."""
import torch

from dist import run


def _share_worker():
    import tpkit
    from tpkit.integrations.deepspeed import sequence_share
    state = tpkit.init_parallel(cp=2)              # 4 ranks: cp=2, dp=2
    n = 3 + 2 * state.cp_rank + 4 * state.dp_rank  # 3/5 tokens, 7/9 tokens
    g = torch.Generator().manual_seed(100 * state.dp_rank + state.cp_rank)
    tok = torch.rand(n, generator=g, dtype=torch.float64).requires_grad_()
    share = sequence_share(tok.sum(), n)
    share.backward()
    return state.dp_rank, state.cp_rank, tok.detach(), share.item(), tok.grad


def test_sequence_share_with_unequal_token_counts():
    results = run(_share_worker, 4)
    for dp in (0, 1):
        mine = sorted((r for r in results if r[0] == dp), key=lambda r: r[1])
        assert [len(r[2]) for r in mine] == [3 + 4 * dp, 5 + 4 * dp]
        whole = torch.cat([r[2] for r in mine])
        # the shares of a replica's CP ranks add up to the mean over its whole sequence
        assert abs(sum(r[3] for r in mine) - whole.mean().item()) < 1e-12
        for _, _, tok, share, grad in mine:
            assert abs(share - tok.sum().item() / len(whole)) < 1e-12
            assert torch.allclose(grad, torch.full_like(grad, 1 / len(whole)))  # no grad via n
