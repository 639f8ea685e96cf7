"""``python -m tpkit.data``: the ``tpkit-data`` command (tpkit.data.preprocess)."""
from .preprocess import main

if __name__ == "__main__":
    main()
