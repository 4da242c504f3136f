"""examples/tensor_parallel.py: a Llama layer sharded over N = 1, 2, 8 ranks (column-parallel QKV
and gate/up, row-parallel o_proj and down, KV heads replicated when N > n_kv) equals the
unsharded transformers layer by the attention accuracy rule (stock bf16 layer as the
same-precision reference, the layer in float64 as the exact one), and the ranks agree."""
import copy
import importlib.util
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from nki_kernels.reference.compare import assert_attention_close  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)       # one core per test process (pytest -n 2 already uses both)
_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"
_spec = importlib.util.spec_from_file_location("tensor_parallel_example", _PATH)
tp = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tp          # dataclasses resolve the module's annotations through it
_spec.loader.exec_module(tp)


@pytest.fixture(scope="module")
def setup():
    model = tp.tiny_llama()
    T = 16
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        exact = tp.stock_layer(copy.deepcopy(model).double(), x.double())
        stock = tp.stock_layer(model, x)
    return model, x, tp.rope_tables(model.model.rotary_emb, x, T), stock, exact


@pytest.mark.parametrize("n", [1, 2, 8])
def test_sharded_layer_equals_unsharded(setup, n):
    model, x, (cos, sin), stock, exact = setup
    shards = [tp.shard_layer(model.model.layers[0], r, n) for r in range(n)]
    assert sum(s.n_q for s in shards) == 8
    assert [s.n_kv for s in shards] == ([2] if n == 1 else [1] * n)
    with torch.no_grad():
        y = tp.tp_layer(shards, x, cos, sin)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert_attention_close(y.float().numpy(), stock.float().numpy(), exact.numpy(),
                           what=f"N={n}")


def test_kv_replication_map():
    """n_kv = 2 over 8 ranks: ranks 0-3 read KV head 0, ranks 4-7 KV head 1 (GQA groups of 4)."""
    assert [tp.kv_heads_of_rank(r, 8, 8, 2) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [tp.kv_heads_of_rank(r, 2, 8, 2) for r in range(2)] == [[0], [1]]
    assert tp.kv_heads_of_rank(1, 2, 8, 4) == [2, 3]


def test_bad_rank_count(setup):
    model = setup[0]
    with pytest.raises(ValueError, match=r"tensor_parallel: 3 ranks must divide n_q=8"):
        tp.shard_layer(model.model.layers[0], 0, 3)
