"""The adaptive speculative policy (speculative/policy.py): per step, drafting only where its
expected tokens pay for the measured cost of a verify step at that batch size. Against a
simulated device (tests/helpers/spec_policy_sim.py: step cost a function of batch and width,
drafts accepted per position at a set rate) it never falls below plain decoding where verify
steps are expensive, and keeps most of the ideal speed-up where they are cheap."""
import pytest

from megatron_async.inference.speculative.step_cost import StepCosts, bucket
from tests.helpers.spec_policy_sim import device_costs, make_policy, ratio_to_plain, run

LARGE_BATCH = device_costs(3.9, 0.042)  # batch 128: a 3-token verify step costs ~3.8 plain steps (H100, measured)
BATCH_ONE = device_costs(1.49, 0.14)  # batch 1: a 3-token verify step costs ~1.19 plain steps


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.8, 0.96])
def test_never_slower_than_plain_where_verify_steps_cost_more_than_they_bring(acceptance):
    first, later = ratio_to_plain(LARGE_BATCH, 128, acceptance, steps=128)
    assert later >= 0.99, later  # its costs measured: no verify step pays at batch 128
    assert first >= 0.95, first  # the first workload pays a trial step or two per width


@pytest.mark.parametrize("acceptance, least", [(0.8, 2.1), (0.96, 2.6), (0.5, 1.25)])
def test_keeps_the_speed_up_where_verify_steps_are_cheap(acceptance, least):
    # ideal (the best width, costs and acceptance known): 80 % 2.30x, 96 % 2.97x, 50 % 1.46x
    _, later = ratio_to_plain(BATCH_ONE, 1, acceptance, steps=128)
    assert later >= least, later


def test_rule_per_step():
    policy = make_policy(k=3)
    reqs = [_req(0.9) for _ in range(4)]
    assert policy.choose_cap(reqs, 1) == 0  # a plain step's cost at this batch first
    policy.costs.observe(4, 1, 1.0, step=1)
    assert policy.choose_cap(reqs, 2) == 1  # width 2 unmeasured and it may pay: try it (narrow first)
    policy.costs.observe(4, 2, 1.1, step=2)
    assert policy.choose_cap(reqs, 3) == 3  # width 4: its lower bound 1.1 < G(4) = 3.44: try it
    policy.costs.observe(4, 4, 1.3, step=3)
    assert policy.choose_cap(reqs, 4) == 3  # G(4) / 1.3 = 2.6 beats G(2) / 1.1 = 1.7
    policy.costs.observe(4, 4, 5.0, step=4)  # now wide steps cost 1.3 + 0.2 * 3.7 = 2.04 plain steps
    assert policy.choose_cap(reqs, 5) == 1  # 1.9 / 1.1 beats 3.44 / 2.04
    low = [_req(0.05) for _ in range(4)]
    assert policy.choose_cap(low, 5) == 0  # 1.05 tokens per row do not pay 1.1 steps


def test_a_smaller_batch_bounds_a_larger_one_without_trying_it():
    policy = make_policy(k=3)
    for rows in (64, 128):
        policy.costs.observe(rows, 1, 1.0, step=1)
    policy.costs.observe(64, 2, 2.0, step=1)
    policy.costs.observe(64, 4, 4.0, step=1)
    reqs = [_req(0.9) for _ in range(128)]  # G(2) = 1.9 < 2.0, G(4) = 3.44 < 4.0: no trial at 128
    assert policy.choose_cap(reqs, 2) == 0
    assert policy.costs.ratio_bounds(128, 2) == (2.0, float("inf")) and policy.costs.ratio_bounds(32, 2) == (1.0, 2.0)


def test_a_losing_width_is_tried_again_after_its_cost_allows():
    policy = make_policy(k=3)
    reqs = [_req(0.9) for _ in range(8)]
    policy.costs.observe(8, 1, 1.0, step=1)
    policy.costs.observe(8, 2, 3.0, step=1)
    policy.costs.observe(8, 4, 6.0, step=1)
    assert policy.choose_cap(reqs, 2) == 0
    assert policy.choose_cap(reqs, 250) == 0
    assert policy.choose_cap(reqs, 300) == 0  # plain 299 steps old: measured again first
    policy.costs.observe(8, 1, 1.0, step=300)
    assert policy.choose_cap(reqs, 400) == 0
    assert policy.choose_cap(reqs, 402) == 1  # (3 - 1) / 0.005 = 400 steps after: width 2 tried again


def test_buckets_and_counts():
    assert [bucket(b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 128)] == [1, 2, 4, 8, 8, 16, 16, 32, 128]
    costs = StepCosts()
    costs.observe(100, 1, 2.0, step=0)
    costs.observe(100, 1, 4.0, step=5)
    assert costs.cell(112, 1).seconds == pytest.approx(2.4) and costs.cell(112, 1).step == 5
    policy = make_policy(k=2)
    sim = run(policy, BATCH_ONE, 1, 0.9, steps=50)
    assert sim.verify_steps > 25 and policy.off_rows["cost"] >= 1


def _req(acceptance: float):
    from types import SimpleNamespace

    return SimpleNamespace(spec_acceptance=acceptance, spec_drafts_fresh=True, banned_sequences=(),
                           sampling_params=SimpleNamespace(has_penalties=False, structured_outputs=None))
