"""The memory plan: before any weight is read, what the weights and the KV cache will take, and whether that fits
the memory this process has.

From the file's header alone (each tensor's shape and stored type), the compute settings and the memory asked for
(n_ctx, sequences, KV dtype), it counts:

- weights: each matrix as the decoder will hold it (a quantized file's blocks as they are; dense in the activation
  dtype otherwise), vectors, the embedding (a tied LM head shares its blocks);
- KV: what the model's memory kind allocates for n_ctx cells and n_seq_max sequences (kvlm.memory.layout);
- compute: working buffers (logits of a whole micro-batch, activations).

The limit is the memory this process may have: its cgroup's limit where there is one, else physical memory. A plan
whose weights + KV + compute exceed what is left of it (less a margin) is refused with each part named and what
would fit; `budget` (`--memory-budget`) caps it further. When n_ctx is not given, it is the largest that fits, up
to the model's own context length (as llama.cpp's --fit).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlm.core.errors import KvlmError
from kvlm.core.family import ATTENTION, SLIDING
from kvlm.core.config import ModelConfig
from kvlm.loader.weights import ModelWeights
from kvlm.memory.kv_store import AUTO, KV_DTYPES, resolve_kv_dtype
from kvlm.memory.layout import memory_bytes, memory_layout
from kvlm.model.settings import FROM_FILE, ComputeSettings

MiB = 1 << 20
MARGIN_FRACTION = 0.05  # of the limit, kept free for the OS and whatever else runs
CTX_STEP = 256  # a fitted n_ctx is a multiple of this
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
STACKED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
           "ffn_gate_shexp": "shared_gate_up", "ffn_up_shexp": "shared_gate_up",
           "attn_qkv": "delta_in", "attn_gate": "delta_in", "ssm_beta": "delta_in", "ssm_alpha": "delta_in"}
LINEAR_PARTS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp",
                "ffn_up_shexp", "ffn_down_shexp", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ssm_in",
                "shortconv.in_proj", "shortconv.out_proj"}
HALF_TYPES = {"F16", "BF16", "float16", "bfloat16"}  # stored 2 bytes a value, as the native dense product keeps them
EXPERT_PARTS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
FLOAT32_PARTS = {"ffn_gate_inp", "ffn_gate_inp_shexp"}  # routers: float32 whatever the activations


class MemoryPlanError(KvlmError):
    """The model and its memory do not fit: nothing was read."""


@dataclass(frozen=True)
class MemoryRequest:
    """The memory a caller will ask of the model: n_ctx None for the largest that fits."""

    n_ctx: int | None = None
    n_seq_max: int = 1
    kv_dtype: str = AUTO
    n_ubatch: int = 512
    swa_full: bool = False
    keep_extra: int = 0  # positions a sequence keeps beyond its window (the engine's prefix-cache block)
    state_checkpoints: int = 0  # copies of one sequence's recurrent states the engine's prefix caching keeps


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv: int
    compute: int
    limit: int
    limit_source: str
    in_use: int          # this process's resident memory when planned (Python, torch, the tokenizer)
    budget: int | None   # explicit, or None
    n_ctx: int
    kv_dtype: str
    n_seq_max: int
    state_copies: int = 0  # copies of a sequence's recurrent states kept for prefix reuse (within `kv`)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def lines(self) -> list[tuple[str, str]]:
        """(label, text) for `kvlm inspect` and the server's log."""
        cap = f"budget {_mib(self.budget)}" if self.budget is not None else \
            f"{self.limit_source} {_mib(self.limit)}, {_mib(self.in_use)} in use"
        copies = f", {self.state_copies} state copies for prefix reuse" if self.state_copies else ""
        return [("weights", _mib(self.weights)),
                ("kv cache", f"{_mib(self.kv)} (n_ctx {self.n_ctx}, {self.kv_dtype}, {self.n_seq_max} sequences"
                             f"{copies})"),
                ("buffers", _mib(self.compute)), ("total", f"{_mib(self.total)} of {cap}")]


def plan_memory(config: ModelConfig, weights: ModelWeights, settings: ComputeSettings, request: MemoryRequest,
                budget: int | None = None, kernels: bool = True, where: str = "the model") -> MemoryPlan:
    """The plan for loading `weights` with `settings` and allocating `request`'s memory; MemoryPlanError if it
    does not fit (each part named, and what would)."""
    return fit(config, weight_bytes(config, weights, settings, kernels), settings, request, budget, where)


def fit(config: ModelConfig, held: int, settings: ComputeSettings, request: MemoryRequest,
        budget: int | None = None, where: str = "the model", ranks: int = 1, loaded: bool = False) -> MemoryPlan:
    """The plan for weights that take `held` bytes and `request`'s memory.

    `ranks` > 1: `config` and `held` are one tensor-parallel rank's, and that many ranks share this
    machine (each with its share of the KV cache and buffers of its own). `loaded`: the weights are in this
    process's memory already (so not counted twice)."""
    if budget is not None and (not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    kv_dtype = resolve_kv_dtype(request.kv_dtype, settings.torch_dtype, settings.quant is not None)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {AUTO}, {', '.join(KV_DTYPES)}, got {request.kv_dtype!r}")
    if settings.device != "cpu":
        limit, source, in_use = device_memory(settings.device)
        in_use = max(0, in_use - (held * ranks if loaded else 0))
    else:
        limit, source = memory_limit()
        in_use = max(0, resident_bytes() - (held * ranks if loaded else 0))
    usable = budget if budget is not None else int(limit * (1 - MARGIN_FRACTION)) - in_use
    compute = compute_bytes(config, request) * ranks
    held *= ranks
    kv_of = lambda n_ctx, dtype=kv_dtype: ranks * memory_bytes(  # noqa: E731
        config, n_ctx, request.n_seq_max, dtype, request.n_ubatch, request.swa_full, request.keep_extra,
        request.state_checkpoints)
    n_ctx = request.n_ctx if request.n_ctx is not None else _largest_ctx(config, usable - held - compute, kv_of)
    state_copies = request.state_checkpoints if memory_layout(config, 1).state_bytes else 0
    plan = MemoryPlan(held, kv_of(max(n_ctx, 1)), compute, limit, source, in_use, budget,
                      max(n_ctx, 1), kv_dtype, request.n_seq_max, state_copies)
    if n_ctx < 1 or plan.total > usable:
        raise MemoryPlanError(_refusal(config, plan, usable, kv_of, where))
    return plan


def weight_bytes(config: ModelConfig, weights: ModelWeights, settings: ComputeSettings,
                 kernels: bool = True) -> int:
    """The bytes the decoder will hold, from the tensors' entries alone."""
    dtype_bytes = settings.torch_dtype.itemsize
    groups: dict[tuple, list[str]] = {}
    held = 0
    for name in weights.names():
        entry = weights.entry(name)
        parts = name.split(".")
        part, kind = (".".join(parts[2:-1]), parts[-1]) if name.startswith("blk.") and len(parts) > 3 else ("", "")
        if part in EXPERT_PARTS and kind == "weight":
            held += _entry_bytes([entry], settings, kernels, dtype_bytes)
        elif part in EXPERT_PARTS:  # gpt-oss's experts' biases: float32 for the native experts, else dense
            native = kernels and settings.quant is not None
            held += math.prod(entry.shape) * (4 if native else dtype_bytes)
        elif len(entry.shape) == 1 or (part not in LINEAR_PARTS and name not in ("token_embd.weight", "output.weight")):
            float32 = (len(entry.shape) == 1 and _float32_vector(name)) or part in FLOAT32_PARTS
            held += math.prod(entry.shape) * (4 if float32 else dtype_bytes)
        elif part in LINEAR_PARTS and kind == "weight":
            groups.setdefault((parts[1], STACKED.get(part, part)), []).append(name)
    for names in groups.values():
        held += _entry_bytes([weights.entry(n) for n in names], settings, kernels, dtype_bytes)
    embedding = weights.entry("token_embd.weight")
    embedding_blocks = kernels and settings.matrix_storage([embedding.stored_as]) == FROM_FILE
    held += embedding.nbytes if embedding_blocks else math.prod(embedding.shape) * dtype_bytes
    head = weights.head_entry()
    tied = weights.output_name != "output.weight" and weights.shard is None
    if tied and embedding_blocks:  # the tied head multiplies by the embedding's own blocks
        return held
    return held + _entry_bytes([head], settings, kernels, dtype_bytes, head=True)  # a matrix of its own


def _float32_vector(name: str) -> bool:
    """Mamba2's and Gated DeltaNet's A, D and time-step bias, routers' biases and attention sinks stay float32
    whatever the activations."""
    return name.endswith(("ssm_a", "ssm_d", "ssm_dt.bias", "ffn_gate_inp.bias", "attn_sinks.weight"))


def _entry_bytes(entries: list, settings: ComputeSettings, kernels: bool, dtype_bytes: int,
                 head: bool = False) -> int:
    """The bytes held of one matrix stacked from parts with these entries."""
    numel = sum(math.prod(e.shape) for e in entries)
    storage = settings.matrix_storage([e.stored_as for e in entries]) if kernels else None
    if head and storage == "int4":
        storage = "int8"
    if storage is None:  # dense: f16/bf16 kept as stored by the native dense product (batch-invariant modes)
        native_dense = kernels and settings.batch_invariant and not settings.reference
        return numel * (2 if native_dense and all(e.stored_as in HALF_TYPES for e in entries) else dtype_bytes)
    return sum(e.nbytes for e in entries) if storage == FROM_FILE else numel // 32 * (34 if storage == "int8" else 20)


def compute_bytes(config: ModelConfig, request: MemoryRequest) -> int:
    """Working buffers: a micro-batch's logits (float32, every token an output at worst, as in perplexity) and its
    activations (float32 at worst)."""
    tokens = request.n_ubatch
    n_kv, head_dim = max(config.attention_geometry(kind) for kind in (ATTENTION, SLIDING))  # Gemma 4's full layers'
    q_width = config.n_head * head_dim * (2 if config.family.attention_output_gate else 1)  # + Qwen3.5's gate
    n_ff = max(config.layer_n_ff or (config.n_ff,))
    widest = max(n_ff * 2, q_width + 2 * n_kv * head_dim, config.n_layer * config.per_layer_embd,
                 config.ssm_inner * 2 + 2 * config.ssm_groups * config.ssm_state + config.n_head + 2 * config.ssm_heads)
    return tokens * config.vocab_size * 4 + tokens * (widest + 4 * config.n_embd) * 4


def _largest_ctx(config: ModelConfig, room: int, kv_of) -> int:
    """The largest n_ctx up to the model's own whose memory fits in `room` bytes (a multiple of CTX_STEP unless it
    is the model's own); 0 if not even CTX_STEP fits."""
    if kv_of(config.n_ctx_train) <= room:
        return config.n_ctx_train
    low, high = 0, config.n_ctx_train // CTX_STEP  # in steps: low fits (or is 0), high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if kv_of(middle * CTX_STEP) <= room else (low, middle)
    return low * CTX_STEP


def _refusal(config: ModelConfig, plan: MemoryPlan, usable: int, kv_of, where: str) -> str:
    cap = (f"the memory budget is {_mib(plan.budget)}" if plan.budget is not None else
           f"this process can use {_mib(usable)} ({plan.limit_source} {_mib(plan.limit)}, less {_mib(plan.in_use)} "
           f"already in use and a {MARGIN_FRACTION:.0%} margin)")
    need = (f"weights {_mib(plan.weights)} + KV cache {_mib(plan.kv)} (n_ctx {plan.n_ctx}, {plan.kv_dtype}, "
            f"{plan.n_seq_max} sequences) + compute buffers {_mib(plan.compute)} = {_mib(plan.total)}")
    room = usable - plan.weights - plan.compute
    if room <= 0:
        advice = (f"the weights and buffers alone need {_mib(plan.weights + plan.compute)}: use a more quantized file "
                  "or a machine with more memory")
    else:
        options = []
        smaller = sorted((d for d in KV_DTYPES if kv_of(CTX_STEP, d) < kv_of(CTX_STEP, plan.kv_dtype)),
                         key=lambda d: -kv_of(CTX_STEP, d))
        for dtype in [plan.kv_dtype, *smaller]:
            n_ctx = _largest_ctx(config, room, lambda n, dtype=dtype: kv_of(n, dtype))
            if n_ctx >= CTX_STEP:
                options.append(f"--n-ctx {n_ctx}" + ("" if dtype == plan.kv_dtype else f" with --kv-dtype {dtype}"))
        advice = "what would fit: " + ("; ".join(options) if options else "no context: use more memory")
    return f"{where} does not fit in memory: {need}, but {cap}. {advice[0].upper()}{advice[1:]}."


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """"6GiB", "6G", "512MiB", "6GB" (powers of 1000), "123456" (bytes) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    unit = None if match is None else match[2] + ("b" if match[4] and not match[3] else "")
    if match is None or unit not in _UNITS or (match[3] and not match[2]):
        raise ValueError(f"not a size: {text!r} (write bytes, or a number with K, M, G, T, e.g. 6GiB)")
    return int(float(match[1]) * _UNITS[unit])


def _mib(n: int | None) -> str:
    return f"{(n or 0) / MiB:.0f} MiB"


def device_memory(device: str) -> tuple[int, str, int]:
    """(bytes, where from, bytes in use) of a GPU's memory: what the weights, the K/V cells and the states take
    there, however much the host has."""
    where = torch.device(device)
    free, total = torch.cuda.mem_get_info(where)
    cached = torch.cuda.memory_reserved(where) - torch.cuda.memory_allocated(where)  # torch's, free to reuse
    return total, f"{torch.cuda.get_device_name(where)} memory", max(0, total - free - cached)


def memory_limit() -> tuple[int, str]:
    """(bytes, where from): this process's cgroup memory limit where it has one below physical memory, else
    physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _cgroup_limit()
    return (cgroup, "cgroup limit") if cgroup is not None and cgroup < physical else (physical, "physical memory")


def _cgroup_limit() -> int | None:
    """The tightest memory limit of this process's cgroup and its parents (v2 memory.max, v1 limit_in_bytes)."""
    limits = []
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        for directory in [folder, *folder.parents]:
            if not directory.is_relative_to(base):
                break
            try:
                text = (directory / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():  # "max" (v2) means none
                limits.append(int(text))
    return min(limits) if limits else None


def resident_bytes() -> int:
    """This process's resident memory now."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes() -> int:
    """The most resident memory this process has had (VmHWM). Unlike getrusage's ru_maxrss, which Linux carries
    over through exec from a parent's fork, it is this program's own."""
    try:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, ValueError, StopIteration):
        return 0
