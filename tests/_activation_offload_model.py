"""A small GPT-style model whose blocks (and head) run under non-reentrant torch.utils.checkpoint,
shared by the activation-offload tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, heads: int = 2, layers: int = 4, ckpt_head: bool = True,
                 reentrant: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.ckpt_head = ckpt_head
        self.reentrant = reentrant

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        if self.ckpt_head:
            return checkpoint(self._loss, x, targets, use_reentrant=self.reentrant)
        return self._loss(x, targets)


# What the offloader still holds, read from its private state: only the tests ask (no caller in the package).
def pending_io(off) -> int:
    """Requests of the offloader's current step not completed yet (0 once the step has ended)."""
    return sum(not h.done() for h in off._handles)


def held_bytes(off) -> int:
    """Bytes of activation memory the offloader itself references right now."""
    return sum(s.nbytes * ((s.data is not None) + (s.host is not None) + (s.prefetch is not None)) for s in off._order)
