"""``python -m tpkit.data``: the ``tpkit-data`` command (tpkit.data.preprocess)."""
import sys

from .preprocess import main

if __name__ == "__main__":
    sys.exit(main())
