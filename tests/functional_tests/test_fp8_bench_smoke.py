"""python -m benchmarks fp8 (kernels, sweep, engine) and fp8-accuracy on the CPU: every row runs and the
tables carry what they claim (plumbing only; the GPU runs measure)."""
from benchmarks.commands import fp8, fp8_accuracy
from tests.helpers.hf_models import make_tiny_checkpoint


def test_kernels_and_engine_smoke(capsys):
    rows = fp8.main(["kernels", "--smoke"])
    assert {r["kind"] for r in rows} == {"linear", "moe", "decode attention"}
    assert all(r["bf16_us"] > 0 and r["fp8_us"] > 0 for r in rows)
    rows = fp8.main(["engine", "--smoke", "--long", "--configs", "bf16", "fp8+kv"])
    assert [r["config"] for r in rows] == ["bf16", "fp8+kv"]
    assert rows[1]["kv_tokens"] > 2 * rows[0]["kv_tokens"]  # e4m3 against the float32 model's pool
    assert all(r[w]["failed"] == 0 and r[w]["tok_s"] > 0 for r in rows for w in ("A", "batch1", "long"))
    assert all(r["long"]["decode_ms"] > 0 for r in rows)
    assert "long decode ms" in capsys.readouterr().out.splitlines()[-3]


def test_sweep_smoke(tmp_path, capsys):
    rows = fp8.main(["sweep", "--smoke", "--json", str(tmp_path / "sweep.json")])
    assert [r["m"] for r in rows] == [1, 20] and all(len(r["tried"]) == 2 and r["best"][2] > 0 for r in rows)
    assert not rows[0]["now"][1] and rows[1]["now"][1]  # in-GEMM quantization in the small bucket only
    assert "best tiles" in capsys.readouterr().out and (tmp_path / "sweep.json").is_file()


def test_accuracy_smoke(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "m", with_tokenizer=True, hidden_size=128,
                                head_dim=32, vocab_size=512)
    results = fp8_accuracy.main(["--model", str(ckpt), "--dtype", "float32", "--tokens", "6", "--prompts", "2",
                                 "--ppl-tokens", "80", "--window", "40", "--out", str(tmp_path / "acc.json")])
    assert list(results) == ["bf16", "fp8 weights", "fp8 KV", "fp8 weights + KV"]
    assert all(r["ppl"] > 1 for r in results.values())
    assert results["fp8 weights"]["max_abs_logprob_diff"] > 0 and (tmp_path / "acc.json").is_file()
