"""What the fused decode layers (one native call per attention or Gated DeltaNet layer, kvlm.model.fused) save a
decode step, measured in one process: the same context decodes `--steps` greedy steps with them, then as many with
every layer run op by op, alternating for `--rounds` rounds, so this VM's drift between runs (15-40%) falls on both
alike. kvlm's defaults otherwise; the file by default bench/big_model_file.py's Qwen3.5-0.8B-shaped one.

    python -m bench.fused_layers [--shape qwen3.5-0.8b | --model FILE.gguf] [--steps 30] [--rounds 5] [--sequences 1]

Prints each round's milliseconds per step, the medians and their ratio. The tokens are the same either way (the
fused layers compute the op-by-op bits: tests/kernels/test_decode_layer.py).
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OpenMP's threads before they start

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.common import machine_line  # noqa: E402
from bench.multi_sequence import KvlmContext  # noqa: E402
from kvlm import load_model  # noqa: E402
from kvlm.loader.memory_plan import MemoryRequest  # noqa: E402
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype  # noqa: E402

PROMPT_TOKENS = 64
N_CTX = 4096


class Steps:
    """Sequences decoding together, one greedy token each per step, carried on from call to call."""

    def __init__(self, ctx: KvlmContext, vocab: int, sequences: int) -> None:
        self.ctx, self.seq_ids = ctx, list(range(sequences))
        self.last = []
        for s in self.seq_ids:  # a prompt each, one batch each (the context's n_batch bounds a batch)
            prompt = [(7919 * (i + 31 * s)) % (vocab - 1000) + 500 for i in range(PROMPT_TOKENS)]
            ctx.decode(prompt, list(range(PROMPT_TOKENS)), [s] * PROMPT_TOKENS,
                       [i == PROMPT_TOKENS - 1 for i in range(PROMPT_TOKENS)])
            self.last.append(ctx.greedy(0))
        self.position = PROMPT_TOKENS

    def milliseconds(self, n: int) -> float:
        """n steps: milliseconds per step."""
        started = time.perf_counter()
        for _ in range(n):
            self.ctx.decode(self.last, [self.position] * len(self.seq_ids), self.seq_ids, [True] * len(self.seq_ids))
            self.last, self.position = [self.ctx.greedy(s) for s in self.seq_ids], self.position + 1
        return (time.perf_counter() - started) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-0.8b", help="bench/big_model_file.py's shape (made if missing)")
    parser.add_argument("--model", default=None, help="a GGUF file instead of the made one")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per round and setting")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=1, help="sequences decoding together")
    args = parser.parse_args()
    if args.model:
        path = Path(args.model)
    else:
        from bench.big_model_file import default_path, make_big_model
        path = make_big_model(default_path(args.shape), shape=args.shape)
    model = load_model(str(path), progress=False, memory=MemoryRequest(n_ctx=N_CTX, n_seq_max=args.sequences))
    fused = model.decoder.decode_layers
    if fused is None:
        raise SystemExit(f"{path.name}: no fused decode layers here (dense matrices, or no native kernels)")
    ctx = KvlmContext(model, N_CTX, args.sequences, resolve_kv_dtype(AUTO, model.decoder.dtype, model.decoder.quantized))
    steps = Steps(ctx, model.config.vocab_size, args.sequences)
    steps.milliseconds(5)  # warm-up
    times: dict[str, list[float]] = {"fused": [], "op by op": []}
    for _ in range(args.rounds):
        for name in times:
            model.decoder.decode_layers = fused if name == "fused" else None
            times[name].append(steps.milliseconds(args.steps))
    model.decoder.decode_layers = fused
    print(machine_line())
    print(f"{path.name}: {len(fused.layers)} fused attention layers, {len(fused.delta_layers)} fused Gated DeltaNet "
          f"layers of {model.config.n_layer}; {args.sequences} sequence(s), {args.steps} steps a round")
    for name, values in times.items():
        print(f"{name:9} ms/step: {' '.join(f'{v:.1f}' for v in values)}  median {statistics.median(values):.1f}")
    print(f"op by op / fused: {statistics.median(times['op by op']) / statistics.median(times['fused']):.2f}x")


if __name__ == "__main__":
    main()
