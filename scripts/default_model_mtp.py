"""MTP (multi-token prediction) head for the default model, DeepSeek-V3 style.

Given the base model's final hidden state ``h_t`` (the tensor the ORT-GenAI builder
emits as ``hidden_states``: the output of the final RMSNorm) and the embedding of the
next token ``x_{t+1}``, the head predicts ``x_{t+2}``::

    x  = W_proj @ concat[RMSNorm(h_t), RMSNorm(E(x_{t+1}))]
    x  = x + SwiGLU(RMSNorm(x))              # attention-free residual block
    h' = RMSNorm_final(x)                    # exported as ``mtp_hidden_states``
    logits = h' @ E^T                        # lm_head tied with the base embedding

``h'`` has the same meaning as the base's ``hidden_states`` (the input of the tied
lm_head), so chaining feeds ``h'`` back with the embedding of the token just drafted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MTPConfig:
    """Sizes of the MTP head."""

    hidden_size: int = 256
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (standard ONNX ops when exported)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class MTPHead(nn.Module):
    """One MTP step: (h_t, E(x_{t+1})) -> h' (post final norm)."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        h, i, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.hidden_norm = RMSNorm(h, eps)
        self.embed_norm = RMSNorm(h, eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.mlp_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.final_norm = RMSNorm(h, eps)
        for lin in (self.proj, self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embeds)], -1))
        y = self.mlp_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.final_norm(x)

    def round_to_fp16(self) -> None:
        """Round the matrices to fp16 values (what the exported file stores)."""
        with torch.no_grad():
            for lin in (self.proj, self.gate_proj, self.up_proj, self.down_proj):
                lin.weight.copy_(lin.weight.half().float())

    def save(self, folder: Path) -> None:
        """Save weights and config to ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), folder / "mtp.pt")
        (folder / "mtp_config.json").write_text(json.dumps(asdict(self.cfg), indent=2))

    @classmethod
    def load(cls, folder: Path) -> MTPHead:
        """Load a head saved with :meth:`save`."""
        cfg = MTPConfig(**json.loads((folder / "mtp_config.json").read_text()))
        head = cls(cfg)
        head.load_state_dict(torch.load(folder / "mtp.pt", weights_only=True))
        return head.eval()


class MTPExport(nn.Module):
    """Self-contained export wrapper; matrices and the tied embedding stored as fp16."""

    def __init__(self, head: MTPHead, embed_weight: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.eps = head.cfg.rms_norm_eps
        self.register_buffer("embed_fp16", embed_weight.detach().half().clone())
        for name in ("proj", "gate_proj", "up_proj", "down_proj"):
            w = getattr(head, name).weight.detach().half().clone()
            self.register_buffer(f"{name}_fp16", w)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return norm.weight * (x * torch.rsqrt(var + self.eps))

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head
        emb = self.embed_fp16.float()
        e = F.embedding(input_ids, emb)
        x = torch.cat([self._norm(h.hidden_norm, hidden_states), self._norm(h.embed_norm, e)], -1)
        x = x @ self.proj_fp16.float().t()
        y = self._norm(h.mlp_norm, x)
        g = F.silu(y @ self.gate_proj_fp16.float().t())
        u = y @ self.up_proj_fp16.float().t()
        x = x + (g * u) @ self.down_proj_fp16.float().t()
        out = self._norm(h.final_norm, x)
        logits = out @ emb.t()
        return logits, out
