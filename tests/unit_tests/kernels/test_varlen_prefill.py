"""The two-part mixed-step attention (``varlen_prefill``): the new tokens' attention among
themselves (flash attention on CUDA; here a torch stand-in with the same outputs) merged with
each row's cached prefix by ``merge_prefix_attention`` equals attention over all the row's keys.
Rows with and without a cached prefix, decode rows, prefixes that end inside a key tile, GQA,
and both log-sum-exp layouts. In Triton's interpreter on CPU; the GPU test compares the real
path with the one-kernel path on an engine."""
import pytest
import torch

from megatron_async.kernels.triton_prefill_attention import merge_prefix_attention
from paged_attention_cases import make_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU box, interpreted on CPU
ROWS = [(0, 37), (21, 19), (0, 1), (48, 1), (5, 64), (33, 2)]  # (cached prefix, new tokens)


def new_token_reference(case) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each row's new tokens among themselves: (out [T, H, D], lse [T, H])."""
    q, k, v, cu = case.q.float(), case.k.float(), case.v.float(), case.meta.cu_query_lens.tolist()
    group = q.shape[1] // k.shape[1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
    for a, b in zip(cu[:-1], cu[1:]):
        kk, vv = k[a:b].repeat_interleave(group, 1), v[a:b].repeat_interleave(group, 1)
        s = torch.einsum("thd,shd->hts", q[a:b], kk) * case.scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse[a:b] = torch.logsumexp(s, -1).T
        out[a:b] = torch.einsum("hts,shd->thd", torch.softmax(s, -1), vv)
    return out.to(case.q.dtype), lse


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_merged_prefix_equals_attention_over_all_keys(heads_first, kv_heads):
    case = make_case(ROWS, num_heads=4, num_kv_heads=kv_heads, head_dim=16, block_size=8, seed=kv_heads, device=DEV)
    expected, cache = case.reference()
    out, lse = new_token_reference(case)
    if heads_first:  # [H, T] storage, as some torch versions return it
        lse_store = lse.T.contiguous()
        strides = (lse_store.stride(1), lse_store.stride(0))
    else:
        lse_store, strides = lse, (lse.stride(0), lse.stride(1))
    got = merge_prefix_attention(case.q, cache, case.meta, case.scale, out, lse_store, strides, block_q=4, block_n=16)
    assert got is out
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # rows without a prefix keep the new-token output untouched (the merge skipped them)
    fresh = [i for i, (c, _) in enumerate(ROWS) if c == 0]
    cu = case.meta.cu_query_lens.tolist()
    base, _ = new_token_reference(case)
    for r in fresh:
        assert torch.equal(got[cu[r]:cu[r + 1]], base[cu[r]:cu[r + 1]])
    # and rows with one were really changed by it
    assert not torch.allclose(got[cu[1]:cu[2]], base[cu[1]:cu[2]])
