"""The bench harness (installed as ``nki_kernels.bench``)."""
