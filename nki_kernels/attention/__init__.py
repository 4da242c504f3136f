"""Shared attention components (online softmax, masks, tile scheduling) and attention kernels."""
