"""The warm-up's choice under expert parallelism (warmup.py, collective_prebuild.py), with the
CUDA parts stood in for: a collective graph runner gets the dry pass over its plan, the dry
pass runs with the model's EP exchange stood in for (and gets it back after), and the real
captures keep each graph's eager run (every rank runs them together). The all-to-all exchange
and runners without build threads get no dry pass. What the dry pass meets: test_ep_dry_pass.py."""
from types import SimpleNamespace

import pytest
import torch

from megatron_async.config import ExpertExchange
from megatron_async.inference.text_generation_controllers import collective_prebuild, warmup
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport
from megatron_async.parallel.dry_exchange import LocalExchange
from megatron_async.parallel.state import ParallelState
from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer


class _Graphs:
    collective, emulate, captures_without_eager_run, capture_retries = True, False, 0, 0

    def __init__(self):
        self.built = []

    def warmup(self, built=False, agree=None):
        self.built.append(built)
        return 3


def _runner(exchange=ExpertExchange.ALL_GATHER):
    model = build_moe_layer(MOE_CONFIGS["softmax"], 16, ParallelState(ep_rank=0, ep_size=2, ep_exchange=exchange))
    device = SimpleNamespace(is_cuda=False, device="cpu")
    return SimpleNamespace(model=model, graphs=_Graphs(), device=device, context=None, last_samples=torch.zeros(1))


@pytest.fixture
def prebuilt(monkeypatch):
    calls = []

    def prebuild(runner, threads):
        calls.append(threads)
        return PrebuildReport(kernels=7, threads=threads, shapes=5)

    monkeypatch.setattr(warmup, "can_prebuild", lambda runner, threads: bool(threads))
    monkeypatch.setattr(warmup, "prebuild_collective", prebuild)
    return calls


def test_a_collective_runner_prebuilds_its_plan_and_keeps_the_eager_runs_without_an_agreement(prebuilt):
    runner = _runner()
    report = warmup.run_warmup(runner, eager=False, build_threads=4)
    assert prebuilt == [4] and report.prebuild.kernels == 7 and report.graphs_captured == 3
    assert runner.graphs.built == [False]  # a whole dry pass, but no rank could retry a failed capture with the rest


@pytest.mark.parametrize("others_built", [True, False])
def test_collective_captures_skip_their_eager_runs_only_when_every_rank_built_everything(prebuilt, others_built):
    runner, asked = _runner(), []

    def agree(values):  # another rank's dry pass complete or not
        asked.append(values)
        return [max(v, int(not others_built)) for v in values]

    warmup.run_warmup(runner, eager=False, build_threads=4, agree=agree)
    assert asked == [[0]] and runner.graphs.built == [others_built]


@pytest.mark.parametrize("case", ["all_to_all", "no_threads", "not_collective"])
def test_no_dry_pass_where_it_cannot_stand_in(prebuilt, case):
    runner = _runner(ExpertExchange.ALL_TO_ALL if case == "all_to_all" else ExpertExchange.ALL_GATHER)
    runner.graphs.collective = case != "not_collective"
    report = warmup.run_warmup(runner, eager=False, build_threads=0 if case == "no_threads" else 4)
    assert prebuilt == [] and report.prebuild is None and runner.graphs.built == [False]


def test_the_dry_pass_holds_the_stand_ins_and_gives_the_exchange_back(monkeypatch):
    runner, seen = _runner(), {}
    real = runner.model.experts.parallel
    runner.graphs.plan = SimpleNamespace(keys=lambda: [])

    def listed(r, shapes, threads, share=None):
        seen.update(exchanger=r.model.experts.parallel.ep_exchanger, share=share, shapes=shapes)
        return PrebuildReport(kernels=0, threads=threads)

    monkeypatch.setattr(collective_prebuild, "prebuild_listed", listed)
    collective_prebuild.prebuild_collective(runner, 4)
    assert isinstance(seen["exchanger"], LocalExchange) and seen["shapes"] == []
    assert seen["share"] is None  # no process group: this rank builds all it records
    assert runner.model.experts.parallel is real
