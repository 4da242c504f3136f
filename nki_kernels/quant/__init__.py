"""Low-precision ops: RMSNorm + quantize (FP8 per token, MXFP8) and the MXFP8 matmul."""
