"""Dense-layer ops: tiled matmul, fused QKV projection, SwiGLU MLP (and their shared tiling)."""
