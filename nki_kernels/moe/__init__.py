"""Mixture-of-experts ops: ``router_topk`` and ``fused_moe`` (docs/moe.md)."""
