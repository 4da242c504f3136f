"""nki-kernels: hand-tiled NKI kernels for LLM inference on AWS Trainium (Trn2, Trn3)."""
__version__ = "0.1.0"
__all__ = []
