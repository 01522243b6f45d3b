"""Kimi-K3 decode-step replay (issue 21): stock vs ours vs the roof, op by op. See replay.py."""
