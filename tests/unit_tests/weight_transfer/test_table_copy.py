"""The one-launch copy of many same-dtype pairs (``table_copy.TableCopy``, interpreted on CPU):
whole tensors, QKV-like row groups read at a stride, an unaligned view, rows cut into several
work items; every byte equals ``copy_``'s, nothing outside the destinations is written; pairs
that do not qualify (dtypes differ, inner dim strided) are named so."""
import torch

from megatron_async.weight_transfer import table_copy
from megatron_async.weight_transfer.table_copy import TableCopy, geometry, qualifies


def test_many_pairs_copy_bit_for_bit_in_a_few_launches():
    torch.manual_seed(0)
    shard = torch.randn(4, 6, 16).to(torch.bfloat16)  # 4 query groups of (4 q, 1 k, 1 v) rows of 16
    qkv = torch.full((6 * 4, 16), 7.0, dtype=torch.bfloat16)  # destination [q; k; v], each group after group
    q, k, v = qkv[:16].view(4, 4, 16), qkv[16:20].view(4, 1, 16), qkv[20:].view(4, 1, 16)
    big_src, big_dst = torch.randn(37, 24), torch.zeros(37, 24)  # one long row, cut into pieces
    rows_src, rows_dst = torch.randn(9, 40)[:, :24], torch.zeros(9, 24)  # rows, several items
    odd_src, odd_dst = torch.randn(50)[3:40], torch.zeros(41)  # unaligned addresses
    dsts = [q, k, v, big_dst, odd_dst[1:38], rows_dst]
    srcs = [shard[:, :4], shard[:, 4:5], shard[:, 5:6], big_src, odd_src, rows_src]
    copy = TableCopy(dsts, srcs, item_elements=64)
    assert copy.launches == 3  # (2-byte), (4-byte aligned), (4-byte unaligned)
    assert sorted(t.shape[0] for _, _, t in copy.tables) == [1, 6, 14 + 5]  # items of <= 64 elements: q k v 4 + 1 + 1; a long row 14, 9 rows 5
    assert copy.run() == sum(d.numel() for d in dsts)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert odd_dst[0] == 0 and odd_dst[38:].eq(0).all()  # nothing beyond the destination


def test_geometry_merges_dims_and_refuses_a_strided_inner_dim():
    x = torch.zeros(4, 6, 16)
    assert geometry(x[:, :4].clone(), x[:, :4]) == ([1, 4, 64], [0, 64, 1], [0, 96, 1])
    assert geometry(x.clone(), x) == ([1, 1, 384], [0, 0, 1], [0, 0, 1])
    assert geometry(x[..., ::2].clone(), x[..., ::2]) is None
    assert not qualifies(x.clone(), x)  # on the CPU the caller keeps its own copies
    assert not qualifies(x.clone().to(torch.bfloat16), x)


def test_auto_takes_the_table_only_once_its_compile_is_ready():
    """An engine's "auto" copy kernel: the foreach lists until the table kernel's off-start-up
    compile finished, the table after, and never the table if that compile failed (here: no GPU)."""
    from megatron_async.inference.engines.weight_receiver import WeightReceiver

    receiver = object.__new__(WeightReceiver)
    receiver._ipc_kernel, receiver.table_compile = "auto", None
    assert receiver.ipc_copy_kernel() == "foreach"  # a CPU engine: no compile started

    class _Compile:
        done = False

        def ready(self):
            return self.done

    receiver.table_compile = compile_ = _Compile()
    assert receiver.ipc_copy_kernel() == "foreach"
    compile_.done = True
    assert receiver.ipc_copy_kernel() == "table"
    receiver._ipc_kernel = "foreach"  # an explicit choice wins
    assert receiver.ipc_copy_kernel() == "foreach"
    failed = table_copy.TableCompile(torch.device("cpu"), [torch.bfloat16])
    assert failed.wait(30) is False and failed.ready() is False
