"""Typed, torch-free configuration of a hivepath run: the lattice shape and the training recipe.

This module is the part of ``models`` the coordinator may import: it must never import torch.
It knows the lattice's shape (module ids, paths, parameter counts) without building it.

A run's compatibility key is :meth:`LatticeConfig.content_hash`: the same config gives the same hash
on every machine and in every process, so peers with different models never average together.

Presets and the run-config file are in :mod:`models.presets`; the field checks the dataclasses
run are in :mod:`models.config_fields`; the codec names are :data:`models.codec_spec.CODECS`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from models import strict_json
from models.codec_spec import ENTROPY_STAGES, codec_spec, is_codec, wire_name
from models.config_fields import check_types, non_negative, positive, stable_hash
from models.config_fields import from_dict as build_from_dict
from models.errors import ConfigError

__all__ = [
    "LatticeConfig",
    "InnerConfig",
    "OuterConfig",
    "DataConfig",
    "RunConfig",
    "Path_",
    "AGGREGATORS",
    "parse_path",
    "format_path",
    "is_module_id",
]

Path_ = tuple[int, ...]
"""A path through the lattice: one module index per level, e.g. ``(1, 0)``."""

AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")
"""How a reducer combines the members' pseudo-gradients: the weighted mean (DiLoCo), or a robust
aggregator that bounds what a hostile member can do (trimmed mean; centered clipping, Karimireddy et al. 2021)."""

_MODULE_RE = re.compile(r"^(embed|head)(_\d+(_\d+)*)?$|^L(\d+)M(\d+)$")
_RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def format_path(path: Path_) -> str:
    """``(1, 0)`` -> ``"1,0"`` (the form used on the command line and in file names as ``1-0``)."""
    return ",".join(str(i) for i in path)


def parse_path(text: str, levels: Optional[int] = None) -> Path_:
    """Parse ``"1,0"``, ``"1-0"``, ``"(1, 0)"`` or ``"L0M1-L1M0"`` into ``(1, 0)``."""
    raw = text.strip().strip("()")
    if raw.startswith("L"):
        parts = raw.split("-")
        out = []
        for level, part in enumerate(parts):
            m = re.fullmatch(r"L(\d+)M(\d+)", part)
            if not m or int(m.group(1)) != level:
                raise ConfigError("path", f"'{text}' is not a path like 0,1 or L0M0-L1M1")
            out.append(int(m.group(2)))
        path = tuple(out)
    else:
        try:
            path = tuple(int(p) for p in re.split(r"[,\-\s]+", raw) if p != "")
        except ValueError:
            raise ConfigError("path", f"'{text}' is not a path like 0,1 (one module index per level)") from None
    if not path:
        raise ConfigError("path", f"'{text}' is empty; give one module index per level, e.g. 0,1")
    if levels is not None and len(path) != levels:
        raise ConfigError("path", f"'{text}' has {len(path)} indices but the lattice has {levels} levels")
    return path


def is_module_id(text: str) -> bool:
    """True for well-formed module ids (``embed``, ``head``, ``embed_0_1``, ``L0M1``)."""
    return bool(_MODULE_RE.match(text))


@dataclass(frozen=True)
class LatticeConfig:
    """Shape of the module lattice (DiPaCo, Douillard et al. 2024): ``levels`` x ``modules_per_level``
    transformer modules between an embedding and a head. A 1x1 lattice is a dense GPT."""

    vocab_size: int = 256
    """Number of token ids (256 for byte-level; the BPE vocabulary size otherwise)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    blocks_per_module: int = 2
    """Transformer blocks stacked in each lattice module."""
    levels: int = 2
    """Number of lattice levels; a path picks one module per level."""
    modules_per_level: int = 2
    """Modules at each level; the lattice has ``modules_per_level ** levels`` paths."""
    seq_len: int = 128
    """Training context length in tokens."""
    dropout: float = 0.0
    """Dropout probability inside blocks (0 for small runs)."""
    shared_embed: bool = True
    """True: one ``embed`` and one ``head`` shared by every path. False: each path owns
    ``embed_{i}_{j}`` and ``head_{i}_{j}``."""
    tie_embeddings: bool = True
    """True: the head projects with the embedding matrix and owns only its final norm."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first offending field."""
        check_types(self)
        for name in ("vocab_size", "d_model", "n_heads", "blocks_per_module", "levels", "modules_per_level", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ConfigError("vocab_size", f"must be >= 2, got {self.vocab_size}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.levels > 16 or self.modules_per_level > 64:
            raise ConfigError("levels", "the lattice is limited to 16 levels of at most 64 modules")

    # -- identity -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def content_hash(self) -> str:
        """A stable 16-hex-digit hash of every field: the run's compatibility key."""
        return stable_hash(self.to_dict())

    # -- shape --------------------------------------------------------------------------------

    @property
    def num_paths(self) -> int:
        return self.modules_per_level**self.levels

    def paths(self) -> list[Path_]:
        """Every path, in lexicographic order."""
        return list(itertools.product(range(self.modules_per_level), repeat=self.levels))

    def check_path(self, path: Path_) -> Path_:
        path = tuple(path)
        if len(path) != self.levels or any(not 0 <= i < self.modules_per_level for i in path):
            raise ConfigError(
                "path",
                f"{format_path(path)} is not in a {self.levels}-level lattice of "
                f"{self.modules_per_level} modules per level",
            )
        return path

    def embed_id(self, path: Optional[Path_] = None) -> str:
        return "embed" if self.shared_embed else "embed_" + "_".join(map(str, self.check_path(path)))

    def head_id(self, path: Optional[Path_] = None) -> str:
        return "head" if self.shared_embed else "head_" + "_".join(map(str, self.check_path(path)))

    @staticmethod
    def block_id(level: int, index: int) -> str:
        return f"L{level}M{index}"

    def path_modules(self, path: Path_) -> list[str]:
        """Module ids of one path, input to output: ``[embed, L0M_, L1M_, ..., head]``."""
        path = self.check_path(path)
        return [self.embed_id(path)] + [self.block_id(l, i) for l, i in enumerate(path)] + [self.head_id(path)]

    def module_ids(self) -> list[str]:
        """Every module id of the lattice, embeddings first, then levels, then heads."""
        if self.shared_embed:
            embeds, heads = ["embed"], ["head"]
        else:
            embeds = [self.embed_id(p) for p in self.paths()]
            heads = [self.head_id(p) for p in self.paths()]
        blocks = [self.block_id(l, i) for l in range(self.levels) for i in range(self.modules_per_level)]
        return embeds + blocks + heads

    def paths_through(self, module_id: str) -> list[Path_]:
        """Paths that contain ``module_id`` (DiPaCo scales its delta by sqrt of their count)."""
        return [p for p in self.paths() if module_id in self.path_modules(p)]

    def module_kind(self, module_id: str) -> str:
        """``"embed"``, ``"block"`` or ``"head"``."""
        if module_id.startswith("embed"):
            return "embed"
        if module_id.startswith("head"):
            return "head"
        if _MODULE_RE.match(module_id):
            return "block"
        raise ConfigError("module", f"'{module_id}' is not a module id (embed, head or L<level>M<index>)")

    # -- size ---------------------------------------------------------------------------------

    def block_param_count(self) -> int:
        """Parameters of one pre-norm block: two weight-only LayerNorms, qkv, proj, 4x MLP (no biases)."""
        d = self.d_model
        return 12 * d * d + 2 * d

    def module_param_count(self, module_id: str) -> int:
        """Parameters of one module, computed without building it (matches ``ModularLM``)."""
        kind = self.module_kind(module_id)
        d = self.d_model
        if kind == "embed":
            return self.vocab_size * d + self.seq_len * d
        if kind == "head":
            return d + (0 if self.tie_embeddings else self.vocab_size * d)
        return self.blocks_per_module * self.block_param_count()

    def path_param_count(self, path: Optional[Path_] = None) -> int:
        path = path if path is not None else self.paths()[0]
        return sum(self.module_param_count(m) for m in self.path_modules(path))

    def total_param_count(self) -> int:
        return sum(self.module_param_count(m) for m in self.module_ids())

    def training_memory_bytes(self, module_ids: list[str], batch_size: int) -> int:
        """Rough bytes to train ``module_ids`` in fp32 with AdamW and DiLoCo state.

        Per parameter: weight, grad, two Adam moments, the global copy, outer momentum and
        error feedback (7 x 4 bytes). Activations: per token and block about 20 * d_model floats
        plus the attention matrix per head.
        """
        params = sum(self.module_param_count(m) for m in module_ids)
        blocks = sum(self.blocks_per_module for m in module_ids if self.module_kind(m) == "block")
        tokens = batch_size * self.seq_len
        act = tokens * blocks * (20 * self.d_model + self.n_heads * self.seq_len) * 4
        has_head = any(self.module_kind(m) == "head" for m in module_ids)
        logits = tokens * self.vocab_size * 4 * 3 if has_head else 0  # logits, softmax and their grad
        return params * 28 + act + logits


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer (AdamW) that every peer runs on its own path."""

    lr: float = 3e-3
    """Peak AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    warmup_steps: int = 50
    """Linear learning-rate warm-up in inner steps."""
    decay_steps: int = 0
    """When > 0: after the warm-up, cosine decay from ``lr`` to ``min_lr_ratio * lr`` at inner step
    ``decay_steps`` (then constant), as in DiLoCo's inner optimizer; 0 keeps ``lr`` constant (an
    open-ended volunteer run). A peer counts its own inner steps."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this (0 disables)."""
    batch_size: int = 16
    """Sequences per inner step on one peer."""

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "lr", "batch_size")
        non_negative(self, "weight_decay", "warmup_steps", "grad_clip", "decay_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if 0 < self.decay_steps <= self.warmup_steps:
            raise ConfigError("decay_steps", f"must be 0 (no decay) or more than warmup_steps ({self.warmup_steps}), "
                                             f"got {self.decay_steps}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True)
class OuterConfig:
    """DiLoCo's outer step (Douillard et al. 2023): Nesterov SGD on averaged pseudo-gradients."""

    lr: float = 0.7
    """Outer learning rate."""
    momentum: float = 0.9
    """Outer momentum."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo's default)."""
    inner_steps: int = 50
    """H: inner steps between outer steps (a round ends after H steps ...)."""
    round_seconds: float = 0.0
    """... or after this many seconds of inner work when > 0 (time-bounded rounds)."""
    round_timeout: float = 30.0
    """Seconds a round's exchange may take before slow or gone members are dropped."""
    codec: str = "int8"
    """Pseudo-gradient codec: none, fp16, int8 (blockwise absmax), int4 (:data:`models.codec_spec.CODECS`)
    or a sparse ``topk{K}b{B}`` (top-K of every 1024 values at B bits with decayed error feedback,
    :mod:`models.sparse_spec`; e.g. ``topk16b2``).
    The coordinator hands it to every peer in its assignment, unchanged: a module's group must share it."""
    entropy: str = "zstd"
    """Lossless stage on the codec's bytes on the wire: zstd or none (:data:`models.codec_spec.ENTROPY_STAGES`)."""
    error_feedback: bool = True
    """Carry what the codec dropped into the next round's delta."""
    sqrt_sharing: bool = False
    """DiPaCo: scale a module's averaged delta by sqrt(number of paths sharing it)."""
    overlap: bool = False
    """Run round t's exchange behind round t+1's inner steps and apply it at the first step after it
    returned (the steps taken meanwhile kept on top). A peer whose exchange is still in flight when
    round t+1's steps are done keeps stepping (at most ``inner_steps`` more) instead of waiting idle
    (``DiLoCoOptimizer(train_through_waits=True)``)."""
    aggregator: str = "mean"
    """mean, trimmed_mean or centered_clip (see AGGREGATORS)."""
    norm_bound: float = 0.0
    """When > 0, a contribution whose norm exceeds this many times the group's median norm is
    scaled down to it before aggregation (0 disables)."""
    max_group_size: int = 0
    """When > 0, a round of a module with more live holders than this splits into groups of about this
    size, whose delegates meet in groups of delegates (as many levels as it takes for none to exceed
    this) and then a top group; every holder applies the same bytes (:mod:`peer.averaging.hierarchy`).
    0: one group a module, whatever its size."""

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "lr", "inner_steps", "round_timeout")
        non_negative(self, "round_seconds", "norm_bound", "max_group_size")
        if self.max_group_size == 1:
            raise ConfigError("max_group_size", "must be 0 (one group a module) or at least 2, got 1")
        if self.aggregator not in AGGREGATORS:
            raise ConfigError("aggregator", f"'{self.aggregator}' is not one of {', '.join(AGGREGATORS)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum}")
        if not is_codec(self.codec):
            try:
                codec_spec(self.codec)
            except ValueError as e:
                raise ConfigError("codec", str(e)) from None
        if self.entropy not in ENTROPY_STAGES:
            raise ConfigError("entropy", f"'{self.entropy}' is not one of {', '.join(ENTROPY_STAGES)}")

    def wire_codec(self, codec: Optional[str] = None) -> str:
        """The codec name peers exchange pseudo-gradients with: ``codec`` (default: this config's)
        under this config's entropy stage, e.g. ``int8+zstd`` (:func:`models.codec_spec.wire_name`)."""
        return wire_name(self.codec if codec is None else codec, self.entropy)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset the run trains on."""

    corpus: str = "default"
    """``default`` (the built-in corpus) or a directory of documents every peer has."""
    tokenizer: str = "bytes"
    """``bytes`` or ``bpe:VOCAB`` (e.g. ``bpe:4096``)."""
    manifest_hash: str = ""
    """The dataset's manifest hash; empty until the data is prepared. Peers with other data are refused."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.tokenizer != "bytes" and not re.fullmatch(r"bpe:\d+", self.tokenizer):
            raise ConfigError("tokenizer", f"'{self.tokenizer}' is not 'bytes' or 'bpe:VOCAB' (e.g. bpe:4096)")
        if self.manifest_hash and not re.fullmatch(r"[0-9a-f]{16,64}", self.manifest_hash):
            raise ConfigError("manifest_hash", f"'{self.manifest_hash}' is not a hex digest")


@dataclass(frozen=True)
class RunConfig:
    """Everything peers must agree on to train together; the coordinator hands it out at join."""

    run_id: str = "hivepath"
    """Short slug naming the run; prefixes every DHT key."""
    seed: int = 0
    """Seed of the initial weights: every peer starts from the same model."""
    lattice: LatticeConfig = field(default_factory=LatticeConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        check_types(self)
        if not _RUN_ID_RE.match(self.run_id):
            raise ConfigError("run_id", f"'{self.run_id}' must be 1-40 lowercase letters, digits or '-'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        """Build from a nested mapping (e.g. parsed TOML); unknown keys are errors."""
        return build_from_dict(cls, data, "")

    def to_json(self) -> str:
        return strict_json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self, **tables: Mapping[str, Any]) -> str:
        """This run as a run-config file (every field written out, no preset), with ``tables`` after it:
        ``cfg.to_toml(coordinator={"lease_timeout": 15.0})`` adds the coordinator's ``[coordinator]``
        table. :func:`models.presets.load_run_config` reads it back to an equal config."""
        import tomli_w

        clash = set(tables) & set(self.to_dict())
        if clash:
            raise ConfigError(", ".join(sorted(clash)), "is a section of the run itself, not an extra table")
        return tomli_w.dumps({**self.to_dict(), **{k: dict(v) for k, v in tables.items()}})

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text))

    def content_hash(self) -> str:
        """Hash of the whole run recipe (lattice, optimizers, data, seed)."""
        return stable_hash(self.to_dict())

    def replace(self, **sections: Any) -> "RunConfig":
        """``cfg.replace(outer={"codec": "fp16"}, run_id="x")``: override fields, validated."""
        data = self.to_dict()
        for key, value in sections.items():
            if isinstance(value, Mapping):
                if key not in data or not isinstance(data[key], dict):
                    raise ConfigError(key, "is not a config section")
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return RunConfig.from_dict(data)
