"""The trainer: a typed job config (file + flags) and one Trainer (docs/train.md)."""
