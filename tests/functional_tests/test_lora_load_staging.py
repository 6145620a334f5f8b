"""Loading a LoRA adapter in two phases: ``prepare`` (read, check, stage; no engine state) off the
step loop, then an install between two steps that only issues copies. The server's engine loop
keeps stepping while an adapter is prepared on another thread; the install reads no device value
(no sync: on CUDA the stream still has work queued behind a long kernel when it returns); a
prepared adapter fills the slots exactly as a direct load does; bad adapters are refused at
prepare with nothing changed. An unload runs no tensor op at all (the slot is marked free; the next
load overwrites every linear's part of it), and on CUDA an install into a freed slot copies on a
stream of its own while the steps in flight run."""
import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)
pytest.importorskip("prometheus_client")

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.models.lora import LoRAError  # noqa: E402
from megatron_async.models.lora.staging import StagedAdapter, image_bytes  # noqa: E402
from megatron_async.serve.engine_loop import EngineLoop  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from tests.helpers.engine_harness import make_llm  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.lora_adapters import make_peft_adapter  # noqa: E402

ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_requests=4, num_kv_blocks=128,
              max_sequence_length=256)
WAIT_S = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_staging")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base")
    return base, make_peft_adapter(base, root / "a", 8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=1)


def _slot_state(adapters, slot: int) -> list[torch.Tensor]:
    return [t.clone() for s in {id(t.slots): t.slots for t in adapters.targets.values()}.values()
            for t in s.slot_views(slot)]


def test_prepared_adapter_installs_what_a_load_writes(files):
    base, path = files
    llm = make_llm(base, **ENGINE)
    adapters = llm.engine.context.lora
    staged = llm.prepare_lora(path)
    assert isinstance(staged, StagedAdapter) and not adapters.loaded  # prepare changed nothing
    llm.load_lora("direct", path)
    llm.load_lora("staged", staged)
    direct, prepared = _slot_state(adapters, adapters.slot_of("direct")), _slot_state(adapters, adapters.slot_of("staged"))
    assert any(t.abs().sum() > 0 for t in direct)
    assert all(torch.equal(a, b) for a, b in zip(direct, prepared))
    p = SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True)
    outs = llm.generate([[3, 5, 7, 9]] * 3, [replace(p, lora=n) for n in ("direct", "staged", None)])
    assert outs[0].generated_tokens == outs[1].generated_tokens != outs[2].generated_tokens
    other = make_llm(base, **ENGINE)
    with pytest.raises(LoRAError, match="another engine"):
        other.load_lora("x", staged)
    assert not other.engine.context.lora.loaded
    other.close()
    llm.close()


def test_bad_adapters_refused_at_prepare(files, tmp_path):
    base, path = files
    llm = make_llm(base, **ENGINE)
    adapters = llm.engine.context.lora
    before = _slot_state(adapters, 0)
    with pytest.raises(LoRAError, match="no such file"):
        llm.prepare_lora(tmp_path / "missing")
    a = next(iter(adapters.targets))
    shape_a, shape_b = adapters.targets[a].slots.full_shapes(adapters.targets[a].part, 4)
    nan = {f"{a}.lora_A.weight": torch.full(shape_a, float("nan")), f"{a}.lora_B.weight": torch.ones(shape_b)}
    with pytest.raises(LoRAError, match="NaN or infinite"):
        llm.prepare_lora(nan)
    with pytest.raises(LoRAError, match="NaN or infinite"):
        llm.load_lora("nan", nan)
    assert not adapters.loaded and all(torch.equal(x, y) for x, y in zip(before, _slot_state(adapters, 0)))
    llm.close()


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_install_reads_no_device_value(files):
    """Every op the install runs, recorded: copies and zero-fills only (a host read of a tensor,
    ``.item()`` / ``bool()`` / ``.tolist()``, is ``_local_scalar_dense``: a device sync on CUDA)."""
    base, path = files
    llm = make_llm(base, **ENGINE)
    staged = llm.prepare_lora(path)
    with _Ops() as rec:
        llm.load_lora("a", staged)
    ops = set(rec.ops)
    assert "_local_scalar_dense" not in ops and "equal" not in ops, ops
    assert {"_foreach_copy_", "_foreach_zero_"} <= ops and ops <= {"_foreach_copy_", "_foreach_zero_", "_to_copy",
                                                                   "slice", "view", "alias", "select"}, ops
    assert rec.ops.count("_foreach_copy_") == 2  # a, b of every linear together, then the scales
    llm.close()


def test_unload_writes_nothing_and_the_next_load_overwrites_the_slot(files, tmp_path):
    base, path = files
    other = make_peft_adapter(base, tmp_path / "b", 4, 8, ["k_proj", "up_proj"], seed=3)
    llm = make_llm(base, **ENGINE)
    adapters = llm.engine.context.lora
    llm.load_lora("a", path)
    slot = adapters.slot_of("a")
    held = _slot_state(adapters, slot)
    with _Ops() as rec:
        llm.unload_lora("a")
    assert rec.ops == [], rec.ops  # no zeroing: no tensor op at all
    assert all(torch.equal(x, y) for x, y in zip(held, _slot_state(adapters, slot)))
    assert set(adapters.last_lora_ms["unload"]) == {"users", "free"}
    llm.load_lora("b", other)
    assert adapters.slot_of("b") == slot  # the freed slot, still holding "a"'s weights until now
    assert set(adapters.last_lora_ms["install"]) == {"checks", "order", "copy", "zero", "commit"}
    reference = make_llm(base, **ENGINE)
    reference.load_lora("b", other)
    want = _slot_state(reference.engine.context.lora, reference.engine.context.lora.slot_of("b"))
    assert all(torch.equal(x, y) for x, y in zip(_slot_state(adapters, slot), want))
    p = SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True, lora="b")
    prompt = [[3, 5, 7, 9]]
    assert llm.generate(prompt, p)[0].generated_tokens == reference.generate(prompt, p)[0].generated_tokens
    reference.close()
    llm.close()


def test_every_stage_asks_for_one_buffer_size(files, tmp_path):
    """Whatever an adapter touches, its staging buffer is the image of every adapted linear: the
    size of the buffer pinned at build, so the host allocator's cache serves it without pinning."""
    base, path = files
    other = make_peft_adapter(base, tmp_path / "c", 2, 4, ["up_proj"], seed=4)
    llm = make_llm(base, **ENGINE)
    adapters = llm.engine.context.lora
    sizes = {llm.prepare_lora(p).flat.untyped_storage().nbytes() for p in (path, other)}
    assert sizes == {image_bytes(adapters.targets)}
    assert set(adapters.last_lora_ms["prepare"]) == {"read", "check", "alloc", "layout", "finite"}
    llm.close()


@pytest.mark.gpu
def test_freed_slot_install_overlaps_the_steps_in_flight(files, tmp_path, monkeypatch):
    """An unload, then ~1 s of work queued on the compute stream, then a load into the freed slot:
    neither call syncs the device, and the load's copies finish on their own stream first."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base, path = files
    other = make_peft_adapter(base, tmp_path / "d", 4, 8, ["k_proj", "up_proj"], seed=5)
    llm = make_llm(base, device="cuda", dtype="bfloat16", **ENGINE)
    adapters = llm.engine.context.lora
    llm.load_lora("a", path)
    staged = llm.prepare_lora(other)
    torch.cuda.synchronize()
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1) or real_sync(*a, **k))
    compute = torch.cuda.current_stream()
    llm.unload_lora("a")  # the slot is free once the compute stream passes this point
    torch.cuda._sleep(2_000_000_000)  # steps launched after the unload (none reads the slot)
    llm.load_lora("b", staged)
    assert not syncs and not compute.query(), "the unload or the install waited for the device"
    adapters.writer.copy_stream.synchronize()
    assert not compute.query(), "the install's copies waited for the compute stream"
    real_sync()
    reference = make_llm(base, device="cuda", dtype="bfloat16", **ENGINE)
    reference.load_lora("b", other)
    want = _slot_state(reference.engine.context.lora, reference.engine.context.lora.slot_of("b"))
    assert all(torch.equal(x, y) for x, y in zip(_slot_state(adapters, adapters.slot_of("b")), want))
    reference.close()
    llm.close()


@pytest.mark.gpu
def test_install_does_not_wait_for_the_device(files):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base, path = files
    llm = make_llm(base, device="cuda", dtype="bfloat16", **ENGINE)
    staged = llm.prepare_lora(path)
    assert staged.flat.is_pinned()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of queued device work ahead of the install's copies
    llm.load_lora("a", staged)
    assert not torch.cuda.current_stream().query(), "the install waited for the device"
    torch.cuda.synchronize()
    llm.load_lora("b", path)
    adapters = llm.engine.context.lora
    a, b = _slot_state(adapters, adapters.slot_of("a")), _slot_state(adapters, adapters.slot_of("b"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    llm.close()


def test_server_steps_while_an_adapter_is_prepared(files):
    """The prepare of /v1/load_lora_adapter is held until the engine thread completed more steps
    of a running request: the loop was not blocked by it. Then the install lands and answers 200."""
    base, path = files
    llm = make_llm(base, **ENGINE)
    params = SamplingParams(top_k=1, num_tokens_to_generate=150, ignore_eos=True)
    want = llm.generate([[2, 4, 6, 8]], params)[0].generated_tokens
    adapters, engine = llm.engine.context.lora, llm.engine
    entered, release, stepped = threading.Event(), threading.Event(), threading.Event()
    steps, at_entry = [0], [None]
    real_prepare, real_step = adapters.prepare, engine.step

    def held_prepare(source, config=None):
        if not isinstance(source, StagedAdapter):
            entered.set()
            assert release.wait(WAIT_S), "the engine loop did not step while the adapter was prepared"
        return real_prepare(source, config)

    def counted_step():
        res = real_step()
        steps[0] += 1
        if at_entry[0] is not None and steps[0] >= at_entry[0] + 5:
            stepped.set()
        return res

    adapters.prepare, engine.step = held_prepare, counted_step
    loop = EngineLoop(engine, ServerMetrics("t"))
    loop.start()
    try:
        async def main():
            sub = Submission([Choice([2, 4, 6, 8], params)], asyncio.get_running_loop())
            loop.submit(sub)
            await sub.admitted
            first = await asyncio.wait_for(sub.events.get(), WAIT_S)  # the request is running
            assert first.update is not None
            answer = asyncio.ensure_future(loop.admin("load_lora_adapter", {"lora_name": "a", "lora_path": str(path)}))
            assert await asyncio.to_thread(entered.wait, WAIT_S)
            at_entry[0] = steps[0]
            assert await asyncio.to_thread(stepped.wait, WAIT_S)  # 5 more steps while the prepare is held
            assert "a" not in adapters.loaded and not answer.done()
            release.set()
            status, body = await asyncio.wait_for(answer, WAIT_S)
            assert status == 200, body
            tokens = list(first.update.new_tokens)
            while True:
                ev = await asyncio.wait_for(sub.events.get(), WAIT_S)
                if ev.update is not None:
                    tokens += ev.update.new_tokens
                if ev.output is not None or ev.error is not None:
                    assert ev.error is None
                    return tokens

        tokens = asyncio.run(main())
        assert tokens == want  # the base-model request went on unchanged
        assert "a" in adapters.loaded
    finally:
        release.set()
        loop.stop()
    llm.close()


def test_follower_rank_settles_each_load_by_its_name(files, tmp_path):
    """A TP rank > 0 (``follow_rank0``) holds two adapters' loads at once and installs each when
    rank 0 says so, in rank 0's order (each settle names its adapter)."""
    from megatron_async.dp_engine.engine_ops import follow_rank0

    base, path = files
    other = make_peft_adapter(base, tmp_path / "b", 4, 8, ["k_proj", "up_proj"], seed=2)
    llm = make_llm(base, **ENGINE)
    adapters = llm.engine.context.lora
    order = []
    real_load = adapters.load
    adapters.load = lambda name, source: order.append(name) or real_load(name, source)
    commands = iter([["admin", "load_lora_adapter", {"lora_name": "a", "lora_path": str(path)}],
                     ["admin", "load_lora_adapter", {"lora_name": "b", "lora_path": str(other)}],
                     ["settle", "load_lora_adapter:b"], ["settle", "load_lora_adapter:a"], "stop"])

    class Rank0:
        def broadcast_object(self, _):
            return next(commands)

    follow_rank0(llm.engine, Rank0())
    assert order == ["b", "a"] and sorted(adapters.loaded) == ["a", "b"]
    reference = make_llm(base, **ENGINE)
    reference.load_lora("a", path)
    reference.load_lora("b", other)
    for name in ("a", "b"):
        got = _slot_state(adapters, adapters.slot_of(name))
        want = _slot_state(reference.engine.context.lora, reference.engine.context.lora.slot_of(name))
        assert all(torch.equal(x, y) for x, y in zip(got, want)), name
    reference.close()
    llm.close()
