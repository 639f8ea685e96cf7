"""Rewrite docs/train.md's field table from tpkit.train.JobConfig's declarations.

    python tools/train_fields.py          # from the repository root

tests/train/test_job_config.py fails while the table and the fields disagree."""
import os
import re

from tpkit.train.config import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "train.md")

text = open(PATH).read()
new = re.sub(r"(<!-- fields: start -->\n).*?(<!-- fields: end -->)",
             lambda m: m.group(1) + markdown_table() + m.group(2), text, flags=re.S)
with open(PATH, "w") as f:
    f.write(new)
print("docs/train.md:", "unchanged" if new == text else "table rewritten")
