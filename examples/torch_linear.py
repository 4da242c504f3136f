"""A PyTorch ``nn.Linear`` replacement backed by the nki-kernels matmul torch op.

``torch.ops.nki_kernels.matmul`` (``nki_kernels.torch.matmul``): on CPU tensors the kernel runs on
the nki-kernels emulator; on XLA tensors of a trn instance with the Neuron SDK, the real ``nki``
kernel. It has a fake implementation, so ``torch.compile(layer, fullgraph=True)`` traces it
(docs/torch.md).

    python examples/torch_linear.py
"""
from __future__ import annotations

import torch

from nki_kernels.torch import matmul


class NkiLinear(torch.nn.Module):
    """``y = x @ W + b`` with the weight stored [in_features, out_features] (K on partitions)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(in_features, out_features, dtype=dtype)
                                         / in_features ** 0.5, requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.weight.data)   # [T, out]
        y = y.reshape(*lead, y.shape[-1])
        return y + self.bias if self.bias is not None else y


def main():
    torch.manual_seed(0)
    layer = NkiLinear(512, 1024)
    x = torch.randn(2, 64, 512, dtype=torch.bfloat16)     # [batch, tokens, hidden]
    y = layer(x)                                          # [2, 64, 1024] bf16
    ref = x.float() @ layer.weight.float() + layer.bias.float()
    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"NkiLinear: out {tuple(y.shape)} {y.dtype}, max relative error vs fp32 {err:.2e}")
    yc = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    print(f"torch.compile(fullgraph=True): same result {torch.equal(yc, y)}")


if __name__ == "__main__":
    main()
