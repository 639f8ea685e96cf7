"""Fake ``transformer_engine.common`` (see tests/fake_te/README.md)."""
