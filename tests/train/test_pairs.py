"""Issue 54: the trainer's refused option pairs, generated. tpkit.train.pairs checks every
pair of its OPTIONS as the pre-flight does; docs/train.md's "Refused pairs" list must be
exactly that (rewrite it with ``python tools/train_pairs.py``)."""
import os
import re

from tpkit.train.pairs import OPTIONS, markdown_list, refusal, refused_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doc_list() -> str:
    text = open(os.path.join(ROOT, "docs", "train.md")).read()
    m = re.search(r"<!-- pairs: start -->\n(.*?)<!-- pairs: end -->", text, re.S)
    assert m, "docs/train.md has no <!-- pairs: start/end --> block"
    return m.group(1)


def test_docs_list_the_refused_pairs():
    """Planted: a pair's line deleted from docs/train.md, or a refusal lifted without
    rewriting the page: this fails, naming the line."""
    want, have = markdown_list().splitlines(), _doc_list().splitlines()
    assert have == want, (sorted(set(want) - set(have)), sorted(set(have) - set(want)))


def test_each_pair_is_refused_or_accepted_as_listed():
    """Every option alone is accepted; every pair not listed is accepted; each listed
    pair's message names both options' flags (the value and the fix)."""
    refused = {(a, b): why for a, b, why in refused_pairs()}
    for (a, b), why in refused.items():
        assert "\n" not in why and ("drop" in why or "use" in why), why
        named = [f for f in OPTIONS[a] + OPTIONS[b] if f.startswith("--")
                 and f.split("=")[0] in why]
        assert named, (a, b, why)
    # lifted by issue 54: none of these pairs is refused
    for a, b in [("pp", "bf16-mixed"), ("pp", "16-mixed"), ("pp", "fp8"),
                 ("compile", "init-from-hf"), ("grad-accum", "init-from-hf"),
                 ("hsdp", "tp"), ("fsdp", "cp"), ("fsdp-bf16", "sp"),
                 ("pp", "init-from-hf"), ("pp", "offload"), ("offload", "init-from-hf"),
                 ("compile", "offload")]:
        assert (a, b) not in refused and (b, a) not in refused, (a, b)
        assert refusal(OPTIONS[a] + OPTIONS[b]) is None
