"""Fake Transformer Engine top-level package (see tests/fake_te/README.md)."""
__version__ = "2.20.2"
FAKE = True
