"""Kimi-K3 decode-step replay (issues 21, 27): stock vs patched vs the roof, op by op, per deployment mode
(modes.json, read by modes.py). See replay.py."""
