"""BookkeepingLayout (one declaration -> byte offsets -> typed views) and ContextGPUView
(one H2D copy per engine step, contents equal to the host snapshot)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.contexts.bookkeeping_layout import BookkeepingLayout, FieldSpec  # noqa: E402
from megatron_async.inference.contexts.step_snapshot import bookkeeping_fields  # noqa: E402
from megatron_async.inference.contexts.gpu_view import ContextGPUView  # noqa: E402

FIELDS = [
    FieldSpec("a", torch.int64, (3,)),  # 24 bytes -> padded to 32
    FieldSpec("b", torch.bool, (5,)),  # 5 -> 16
    FieldSpec("c", torch.float32, (2, 3)),  # 24 -> 32
    FieldSpec("d", torch.int32, (4,)),  # 16 -> 16
]


def test_offsets_are_aligned_and_packed_in_declaration_order():
    layout = BookkeepingLayout(FIELDS)
    assert layout.offsets == {"a": 0, "b": 32, "c": 48, "d": 80}
    assert layout.nbytes == 96
    assert all(off % 16 == 0 for off in layout.offsets.values())
    assert [f.nbytes for f in FIELDS] == [24, 5, 24, 16]


def test_engine_declaration_has_no_overlapping_fields():
    layout = BookkeepingLayout(bookkeeping_fields(max_tokens=37, max_rows=5, max_blocks=3))
    spans = sorted((layout.offsets[f.name], layout.offsets[f.name] + f.nbytes) for f in layout.fields)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.nbytes and layout.nbytes % 16 == 0


def test_views_have_declared_dtype_and_shape_and_share_the_buffer():
    layout = BookkeepingLayout(FIELDS)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buf)
    for f in FIELDS:
        assert views[f.name].dtype == f.dtype and tuple(views[f.name].shape) == f.shape
        assert views[f.name].data_ptr() == buf.data_ptr() + layout.offsets[f.name]
    views["d"][:] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert buf[80:96].view(torch.int32).tolist() == [1, 2, 3, 4]


def test_host_and_device_views_agree_field_by_field_after_one_copy():
    layout = BookkeepingLayout(FIELDS)
    host = torch.zeros(layout.nbytes, dtype=torch.uint8)
    hv = layout.views(host)
    hv["a"][:] = torch.tensor([-1, 2**40, 7])
    hv["b"][:] = torch.tensor([True, False, True, True, False])
    hv["c"][:] = torch.arange(6, dtype=torch.float32).view(2, 3) / 3
    hv["d"][:] = torch.tensor([5, -6, 7, 8], dtype=torch.int32)
    view = ContextGPUView(layout, torch.device("cpu"))
    view.copy_from(host)
    assert view.num_copies == 1
    for f in FIELDS:
        assert torch.equal(getattr(view, f.name), hv[f.name]), f.name
    # the device views are fixed-address slices of the one device buffer
    assert view.c.data_ptr() == view.buffer.data_ptr() + layout.offsets["c"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_copies_land_in_step_order_behind_a_busy_device():
    """CUDA stages the H2D copy on a copy stream: while the compute stream is still busy with the
    step before (a long sleep), the next steps' copies must neither overwrite the staging buffer
    before the views took it nor reach the views before the compute stream gets there."""
    layout = BookkeepingLayout(FIELDS)
    view = ContextGPUView(layout, torch.device("cuda"))
    hosts = [torch.full((layout.nbytes,), k, dtype=torch.uint8).pin_memory() for k in (11, 22, 33)]
    seen = []
    for host in hosts:
        torch.cuda._sleep(20_000_000)  # ~10 ms of device time before this step reads its views
        view.copy_from(host)
        seen.append(view.buffer.clone())
    torch.cuda.synchronize()
    assert [int(t.min()) for t in seen] == [int(t.max()) for t in seen] == [11, 22, 33]
    assert view.num_copies == 3


def test_unknown_field_is_an_attribute_error():
    view = ContextGPUView(BookkeepingLayout(FIELDS), torch.device("cpu"))
    with pytest.raises(AttributeError):
        view.nope  # noqa: B018


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        BookkeepingLayout([FieldSpec("x", torch.int32, (2,)), FieldSpec("x", torch.int64, (1,))])


@pytest.mark.parametrize("buf", [torch.zeros(95, dtype=torch.uint8), torch.zeros(96, dtype=torch.int8)])
def test_too_small_or_mistyped_buffer_rejected(buf):
    with pytest.raises(ValueError):
        BookkeepingLayout(FIELDS).views(buf)


# ---------------------------------------------------------------- one copy per engine step
def _llm(async_scheduling: bool) -> LLM:
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=24, max_requests=4, max_tokens=12,
                          max_sequence_length=48, async_scheduling=async_scheduling)
    return LLM(inference_config=cfg)  # built-in tiny model


def _check_contents_after_every_copy(llm: LLM, monkeypatch) -> list[int]:
    """Wrap the copy so every snapshot is compared with the host buffer it came from."""
    ctx, view = llm.context, llm.context.gpu_view
    original = view.copy_from
    checked = []

    def copy_and_compare(host: torch.Tensor) -> None:
        original(host)
        assert host is ctx._host_buffers[ctx._ring]  # the buffer just filled for this step
        assert torch.equal(view.buffer, host)
        for name, host_view in ctx.layout.views(host).items():
            assert torch.equal(getattr(view, name), host_view), name
        checked.append(view.num_copies)

    monkeypatch.setattr(view, "copy_from", copy_and_compare)
    return checked


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [22] * 9, [30, 31]]
LENGTHS = [9, 3, 6, 1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_copy_per_engine_step(async_scheduling, monkeypatch):
    llm = _llm(async_scheduling)
    checked = _check_contents_after_every_copy(llm, monkeypatch)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=n) for n in LENGTHS]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.generated_tokens) for o in outs] == LENGTHS
    st = llm.engine.stats
    assert st.prefill_steps >= 2 and st.decode_steps > 0  # chunked prefill and decode both ran
    assert llm.context.gpu_view.num_copies == st.steps == len(checked)
    if async_scheduling:
        assert st.overlapped_steps > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_copy_per_step_when_a_request_stops_early(async_scheduling, monkeypatch):
    llm = _llm(async_scheduling)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=8)
    ref = llm.generate([PROMPTS[0]], greedy)[0].generated_tokens
    before = llm.context.gpu_view.num_copies
    assert before == llm.engine.stats.steps
    # stop on the 3rd greedy token (not earlier in the continuation), 5 tokens before the length limit
    eos = ref[2]
    assert eos not in ref[:2]
    out = llm.generate([PROMPTS[0]], SamplingParams(top_k=1, num_tokens_to_generate=8, termination_id=eos))[0]
    assert out.finish_reason == "stop" and out.generated_tokens == ref[:3]
    assert llm.context.gpu_view.num_copies == llm.engine.stats.steps
    assert not llm.engine.has_unfinished_requests()
