"""dry_blocks.blocks_to_run: a dry capture runs the shortest prefix of the blocks that holds every
(block before, block) pair of the model and ends like it."""
import torch

from megatron_async.inference.text_generation_controllers.dry_blocks import block_signature, blocks_to_run
from tests.helpers.engine_harness import make_llm
from tests.helpers.hf_models import make_tiny_checkpoint


def test_alike_layers_run_two_and_a_different_block_runs_the_prefix_up_to_it(tmp_path):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "q", num_hidden_layers=6)
    blocks = make_llm(path).model.blocks  # attention and MLP blocks alternate: 12
    assert blocks_to_run(blocks) == [0, 1, 2, 3]
    assert block_signature(blocks[2]) == block_signature(blocks[4])  # the KV index is left out
    blocks[8].mixer.window_probe = 7  # a setting only block 8 has (as a sliding window would be)
    assert blocks_to_run(blocks) == list(range(10))


class _Mixer(torch.nn.Module):
    def __init__(self, kind: str, index: int):
        super().__init__()
        self.kind, self.kv_index = kind, index
        self.weight = torch.nn.Parameter(torch.zeros(4, 4 if kind != "E" else 8))


def test_a_pattern_that_does_not_repeat_runs_until_every_pair_and_the_last_kind_ran():
    blocks = [_Mixer(k, i) for i, k in enumerate("M-M*M-M-E*M-M-")]
    run = blocks_to_run(blocks)
    sigs = [block_signature(b) for b in blocks]
    real = {(sigs[i - 1] if i else None, sigs[i]) for i in range(len(blocks))}
    ran = {(sigs[run[j - 1]] if j else None, sigs[i]) for j, i in enumerate(run)}
    assert ran == real and sigs[run[-1]] == sigs[-1] and run == list(range(len(run)))
    assert len(run) == 12  # the last new pair, ('*', 'M'), then the last kind, '-'
