"""An independent dense reference of the MTP heads (no paged KV, no engine modules): the main
model's hidden states from Hugging Face transformers, then one MTP depth written out in plain
torch from the checkpoint's ``mtp.*`` tensors (Llama / Qwen2 / Qwen3 decoder layers)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_async.models.checkpoint import iter_safetensors, read_hf_config, safetensors_files
from tests.helpers.hf_models import load_hf_reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _linear(x: torch.Tensor, sd: dict, name: str) -> torch.Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


class MTPReference:
    """Teacher-forced MTP logits of one sequence, all in float32."""

    def __init__(self, path: str | Path):
        self.cfg = read_hf_config(path)
        self.hf = load_hf_reference(path)
        self.sd = {n: t.float() for n, t in iter_safetensors(safetensors_files(path))}
        self.eps = float(self.cfg.get("rms_norm_eps", 1e-6))
        self.num_heads = self.cfg["num_attention_heads"]
        self.num_kv_heads = self.cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.num_heads

    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        sd, L, D = self.sd, x.shape[0], self.head_dim
        q = _linear(x, sd, f"{p}.q_proj").view(L, self.num_heads, D)
        k = _linear(x, sd, f"{p}.k_proj").view(L, self.num_kv_heads, D)
        v = _linear(x, sd, f"{p}.v_proj").view(L, self.num_kv_heads, D)
        if f"{p}.q_norm.weight" in sd:
            q, k = _rms(q, sd[f"{p}.q_norm.weight"], self.eps), _rms(k, sd[f"{p}.k_norm.weight"], self.eps)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, self.num_heads * D)
        return _linear(out, sd, f"{p}.o_proj")

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        sd = self.sd
        return _linear(F.silu(_linear(x, sd, f"{p}.gate_proj")) * _linear(x, sd, f"{p}.up_proj"), sd, f"{p}.down_proj")

    @torch.no_grad()
    def main_hidden(self, tokens: list[int]) -> torch.Tensor:
        """[L, H] the main model's final-normed hidden states."""
        return self.hf.model(torch.tensor([tokens])).last_hidden_state[0].float()

    @torch.no_grad()
    def depth_output(self, depth: int, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """Depth ``depth`` at positions 0..L-1 (rope position = index) from ``hidden`` [L, H]
        and the embeddings of ``next_ids``: its normed output [L, H]."""
        sd, eps, L = self.sd, self.eps, hidden.shape[0]
        emb = sd["model.embed_tokens.weight"][torch.tensor(next_ids)]
        x = torch.cat([_rms(emb, sd["mtp.pre_fc_norm_embedding.weight"], eps),
                       _rms(hidden, sd["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
        x = x @ sd["mtp.fc.weight"].T
        layer = f"mtp.layers.{depth}"
        pos = torch.arange(L)[None]
        cos, sin = (t[0].float() for t in self.hf.model.rotary_emb(x[None], pos))
        x = x + self._attention(_rms(x, sd[f"{layer}.input_layernorm.weight"], eps), f"{layer}.self_attn", cos, sin)
        x = x + self._mlp(_rms(x, sd[f"{layer}.post_attention_layernorm.weight"], eps), f"{layer}.mlp")
        return _rms(x, sd["mtp.norm.weight"], eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.sd.get("lm_head.weight", self.sd["model.embed_tokens.weight"])
        return hidden @ head.T

    def teacher_forced(self, tokens: list[int], depth: int = 0) -> torch.Tensor:
        """[L - 1, vocab]: at position i, depth ``depth`` on the main hidden h_i and token i + 1
        (its logits predict token i + 2)."""
        hidden = self.main_hidden(tokens)[:-1]
        return self.logits(self.depth_output(depth, hidden, tokens[1:]))

    def greedy_drafts(self, known: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``known`` (whose last token is the newest emitted one, at
        position len - 1), chaining depth 0 as the engine's MTP drafter does: step 1 at the
        position before it, then each step one position further on the previous step's output
        and draft. Each step is the last position of a teacher-forced pass over an extended
        sequence (causal attention: the earlier positions are unchanged)."""
        hidden = self.main_hidden(known)[:-1]
        next_ids = list(known[1:])
        drafts = []
        for _ in range(k):
            out = self.depth_output(0, hidden, next_ids)
            drafts.append(int(self.logits(out[-1]).argmax()))
            hidden = torch.cat([hidden, out[-1:]])
            next_ids.append(drafts[-1])
        return drafts
