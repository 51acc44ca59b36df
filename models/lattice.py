"""The module lattice: ``ModularLM`` holds every module by id, ``PathModel`` composes one path.

DiPaCo (Douillard et al. 2024, "DiPaCo: Distributed Path Composition") trains a lattice of modules
where each path (one module per level, between an embedding and a head) is a normal transformer
language model. Modules are the unit of averaging and checkpointing, so each is initialised from its
own generator seeded by ``(seed, module_id)``: a peer that builds only its path gets bit-identical
initial weights to a process that builds the whole lattice.

Blocks are GPT-style pre-norm transformer blocks (weight-only LayerNorm, no biases) with causal
attention through :func:`torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import LatticeConfig, Path_, format_path

__all__ = ["ModularLM", "PathModel", "Block", "Embed", "Head", "module_seed"]

_INIT_STD = 0.02


def module_seed(seed: int, module_id: str) -> int:
    """A 63-bit seed derived from the run seed and a module id, the same on every machine."""
    digest = hashlib.sha256(f"{seed}:{module_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (keeps parameter counts at ``d`` per norm)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: LatticeConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc_out = nn.Linear(4 * d, d, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        x = x + self.drop(self.proj(y))
        x = x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))  # (B, T, C)
        return x


class Embed(nn.Module):
    """Token and learned position embeddings: ``(B, T)`` ids -> ``(B, T, C)``."""

    def __init__(self, cfg: LatticeConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)


class Head(nn.Module):
    """Final norm and output projection; with tied embeddings it projects with the embed matrix."""

    def __init__(self, cfg: LatticeConfig):
        super().__init__()
        self.ln_f = LayerNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, tied_weight: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.ln_f(x)  # (B, T, C)
        if self.lm_head is not None:
            return self.lm_head(x)  # (B, T, V)
        return F.linear(x, tied_weight)  # (B, T, V)


class BlockStack(nn.Module):
    """A lattice module: ``blocks_per_module`` transformer blocks in sequence."""

    def __init__(self, cfg: LatticeConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks_per_module))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return x


def _build_module(cfg: LatticeConfig, module_id: str, seed: int) -> nn.Module:
    kind = cfg.module_kind(module_id)
    module: nn.Module = {"embed": Embed, "head": Head, "block": BlockStack}[kind](cfg)
    gen = torch.Generator().manual_seed(module_seed(seed, module_id))
    # GPT-2 scaled init: residual projections shrink with the depth of a path.
    depth = max(1, cfg.levels * cfg.blocks_per_module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith("proj.weight") or name.endswith("fc_out.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (_INIT_STD / math.sqrt(2 * depth)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _INIT_STD)
    return module


class ModularLM(nn.Module):
    """Every module of a DiPaCo lattice, keyed by module id in ``self.mods``.

    ``module_ids`` limits construction to some modules (a peer builds only its path). Each module's
    initial weights depend only on ``(seed, module_id)``.
    """

    def __init__(self, cfg: LatticeConfig, seed: int = 0, module_ids: Optional[Iterable[str]] = None):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        wanted = cfg.module_ids() if module_ids is None else list(module_ids)
        known = set(cfg.module_ids())
        for mid in wanted:
            if mid not in known:
                cfg.module_kind(mid)  # raises for malformed ids
                raise ValueError(f"module '{mid}' is not in this lattice ({', '.join(cfg.module_ids())})")
        order = [m for m in cfg.module_ids() if m in set(wanted)]
        self.mods = nn.ModuleDict({mid: _build_module(cfg, mid, seed) for mid in order})

    def path_model(self, path: Path_) -> "PathModel":
        """The path ``path`` as a plain language model sharing this lattice's parameters."""
        ids = self.cfg.path_modules(path)
        missing = [m for m in ids if m not in self.mods]
        if missing:
            raise ValueError(f"path {format_path(path)} needs modules not built here: {', '.join(missing)}")
        return PathModel(self.cfg, {m: self.mods[m] for m in ids}, ids)

    def module_state(self, mid: str) -> dict[str, torch.Tensor]:
        """The named tensors of module ``mid`` (detached, on their current device)."""
        return {k: v.detach() for k, v in self.mods[mid].state_dict().items()}

    def load_module_state(self, mid: str, state: dict[str, torch.Tensor]) -> None:
        """Load one module's tensors (strict: names and shapes must match)."""
        self.mods[mid].load_state_dict(state, strict=True)


class PathModel(nn.Module):
    """One path through the lattice: ``embed -> L0M_ -> ... -> head``, a normal causal LM."""

    def __init__(self, cfg: LatticeConfig, modules: dict[str, nn.Module], module_ids: list[str]):
        super().__init__()
        self.cfg = cfg
        self.module_ids: list[str] = list(module_ids)
        self.embed = modules[module_ids[0]]
        self.stack = nn.ModuleList(modules[m] for m in module_ids[1:-1])
        self.head = modules[module_ids[-1]]

    def modules_by_id(self) -> dict[str, nn.Module]:
        """The path's modules keyed by id, input to output."""
        mods = [self.embed, *self.stack, self.head]
        return dict(zip(self.module_ids, mods))

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``idx`` (B, T) token ids -> logits (B, T, V) and mean cross-entropy when ``targets`` given."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds seq_len={self.cfg.seq_len}")
        x = self.embed(idx)  # (B, T, C)
        for module in self.stack:
            x = module(x)  # (B, T, C)
        logits = self.head(x, self.embed.tok.weight)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
