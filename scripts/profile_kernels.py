"""Per-kernel device time (torch.profiler) and host cProfile of serial decode steps on CUDA,
at decode batches 8 and 128 of the qwen3-0.6b default model: where a step's time goes."""
import cProfile, pstats, random, time
import torch
from torch.profiler import profile, ProfilerActivity
from megatron_async import LLM, SamplingParams, InferenceConfig

def engine(n, mode):
    cfg = InferenceConfig(max_requests=max(n, 8), max_tokens=4096, buffer_size_gb=4, async_scheduling=mode != "serial", attention_backend="triton")
    llm = LLM(device="cuda", dtype="bfloat16", default_model="qwen3-0.6b", inference_config=cfg)
    rng = random.Random(0)
    for _ in range(n):
        llm.engine.add_request([rng.randrange(1000, 100000) for _ in range(300)], SamplingParams(top_k=1, ignore_eos=True, num_tokens_to_generate=400))
    for _ in range(6): llm.engine.step()
    torch.cuda.synchronize()
    return llm

for n in (8, 128):
    llm = engine(n, "serial")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(10): llm.engine.step()
        torch.cuda.synchronize()
    print(f"==== batch {n}: device time per kernel over 10 serial decode steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    t = time.perf_counter()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(10): llm.engine.step()
    pr.disable(); torch.cuda.synchronize()
    print(f"==== batch {n}: host profile, mean serial step {(time.perf_counter()-t)/10*1e3:.2f} ms")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    del llm; torch.cuda.empty_cache()
