"""Pure NumPy references (fp32), the shared shapes table and the accuracy rules.

Installed as ``nki_kernels.reference``; import it by that name only.
"""
