"""Rewrite docs/train.md's list of refused option pairs from tpkit.train.pairs.

    python tools/train_pairs.py          # from the repository root

tests/train/test_pairs.py fails while the list and refused_pairs() disagree."""
import os
import re

from tpkit.train.pairs import markdown_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "train.md")

text = open(PATH).read()
new = re.sub(r"(<!-- pairs: start -->\n).*?(<!-- pairs: end -->)",
             lambda m: m.group(1) + markdown_list() + m.group(2), text, flags=re.S)
with open(PATH, "w") as f:
    f.write(new)
print("docs/train.md:", "unchanged" if new == text else "list rewritten")
