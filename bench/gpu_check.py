"""kvlm on an NVIDIA GPU, checked and measured in one prepared run (issue 40): nothing downloaded, random bf16 weights
made on the GPU from transformers configs of Qwen2.5-0.5B and a 7B shape, every section timed and kept apart so one
failure does not hide the others. Prints a table and writes JSON (--out).

    python -m bench.gpu_check [--out gpu_check.json] [--requests 256] [--skip-7b]
    python -m bench.gpu_check --smoke     # the script's own logic on a CPU: tiny shapes, Triton's interpreter

On the device machine (shared/notes/gpu.md: torch 2.11+cu130, triton 3.6.0, transformers; no gguf, llguidance,
fastapi/uvicorn): carry their wheels (the device tool's README says how) and run
`pip install --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python -m bench.gpu_check`.

Sections: the card's ceilings (copy GB/s counting read + write, an 8192^3 bf16 matmul's TFLOP/s); the GPU tests
(tests/kernels/test_gpu_*.py and tests/engine/test_triton_backend.py, on the GPU); logits against transformers (SDPA)
on the same weights, in fp32 and bf16, with cells scattered in the pool (two sequences decoding in turns) and a
shared prefix (seq_cp), greedy continuations in fp32; one decode step (a CUDA graph's replay) and one engine step
under torch.cuda.set_sync_debug_mode("error") (the first host wait each meets); batch-1 and batch-64 decode tokens/s
with CUDA graphs, batch 1 eager too; a 2048-token prefill's TFLOP/s (7B shape);
nano-vllm's benchmark (random 100-1024-token prompts and outputs through LLM.generate); transformers' generate with
a static cache, batch 1, and batched, on the same card in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
SHAPES = {  # transformers' Qwen2Config fields of the real models
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
GPU_TESTS = ["tests/kernels/test_gpu_attention.py", "tests/kernels/test_gpu_layer_ops.py",
             "tests/engine/test_triton_backend.py", "tests/engine/test_cuda_graphs.py",
             "tests/units/test_device_settings.py", "tests/units/test_batch_sampling.py"]


class Report:
    """Each section's figures, or its error, in the order run."""

    def __init__(self) -> None:
        self.sections: dict[str, dict] = {}

    def run(self, name: str, section, *args) -> dict | None:
        start = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            result = section(*args)
        except Exception as exc:  # noqa: BLE001 - a failed section is reported and the others still run
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        self.sections[name] = result
        print(json.dumps(result), flush=True)
        return result

    def table(self) -> str:
        rows = [f"| {name} | {key} | {value} |" for name, result in self.sections.items()
                for key, value in result.items()]
        return "\n".join(["| section | measure | value |", "|---|---|---|", *rows])


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, function, repeats: int = 1) -> float:
    """Seconds per call of `function`, after one warm-up call."""
    function()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def environment(device: str) -> dict:
    import transformers
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    if device == "cuda":
        result.update(card=torch.cuda.get_device_name(), memory_gib=round(torch.cuda.mem_get_info()[1] / 2**30, 1))
    return result


def ceilings(device: str) -> dict:
    """Copy bandwidth (1 GiB, read + write) and a square bf16 matmul's throughput: what the targets are held to."""
    size = 2**30 if device == "cuda" else 2**24
    source, target = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8,
                                                                                      device=device)
    copy = timed(device, lambda: target.copy_(source), 20)
    n = 8192 if device == "cuda" else 256
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    matmul = timed(device, lambda: a @ b, 20)
    return {"copy GB/s": round(2 * size / copy / 1e9, 1), "bf16 matmul TFLOP/s": round(2 * n**3 / matmul / 1e12, 1)}


def gpu_tests(device: str) -> dict:
    """The GPU kernels' and backend's tests, on the GPU (or the interpreter, for --smoke)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS],
                          cwd=HERE, capture_output=True, text=True, check=False)
    print(done.stdout[-6000:], done.stderr[-2000:], flush=True)
    return {"exit status": done.returncode, "summary": done.stdout.strip().splitlines()[-1][:200]}


def make_folder(shape: str, dtype: torch.dtype, device: str, folder: Path):
    """A random Qwen2 of `shape` made on the device, saved as a Hugging Face folder kvlm loads; the model too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0,
                         attn_implementation="sdpa", torch_dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return model


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary (kvlm reads a folder's tokenizer.json; the ids are random)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def load_kvlm(folder: Path, dtype: str, device: str, n_ctx: int, n_seq_max: int = 4):
    from kvlm.loader.load import load_model
    from kvlm.loader.memory_plan import MemoryRequest

    return load_model(str(folder), dtype, quant=None, progress=False, device=device,
                      memory=MemoryRequest(n_ctx=n_ctx, n_seq_max=n_seq_max))


def fidelity(device: str, folder_of, dtype_name: str, smoke: bool) -> dict:
    """kvlm's logits against transformers' on the same weights: two sequences decoding in turns (their cells
    interleaved in the pool), a third sharing the first's prefix; greedy continuations in fp32."""
    from kvlm import Batch, Context, LLM, SamplingParams

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    shape = "tiny" if smoke else "qwen2.5-0.5b"
    folder, reference = folder_of(shape, dtype)
    model = load_kvlm(folder, dtype_name, device, 512)
    vocab = SHAPES[shape]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (40, 31)]
    ctx = Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=4, kv_dtype="f32" if dtype_name ==
                  "float32" else "bf16")
    seqs, nexts = [list(p) for p in prompts], []
    for s, prompt in enumerate(prompts):
        assert int(ctx.decode(Batch.for_sequence(prompt, seq_id=s))) == 0, ctx.last_error
        nexts.append(int(torch.argmax(ctx.get_logits_ith(-1))))
    for _ in range(6):  # both sequences in each batch: their new cells interleave
        for s, token in enumerate(nexts):
            seqs[s].append(token)
        batch = Batch(tokens=nexts, pos=[len(seqs[0]) - 1, len(seqs[1]) - 1], seq_ids=[0, 1], logits=[True, True])
        assert int(ctx.decode(batch)) == 0, ctx.last_error
        nexts = [int(torch.argmax(ctx.get_logits_ith(i))) for i in range(2)]
    ours = [ctx.get_logits_ith(i).float() for i in range(2)]
    ctx.memory.seq_cp(0, 2, 0, 20)  # a third sequence on the first one's first 20 cells
    tail = torch.randint(0, vocab, (5,), generator=generator).tolist()
    assert int(ctx.decode(Batch.for_sequence(tail, seq_id=2, start_pos=20))) == 0, ctx.last_error
    ours.append(ctx.get_logits_ith(-1).float())
    theirs = []
    with torch.no_grad():
        for ids in (seqs[0], seqs[1], seqs[0][:20] + tail):
            theirs.append(reference(torch.tensor([ids], device=reference.device)).logits[0, -1].float().cpu())
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs)]
    result = {"max relative error": f"{max(errors):.2e}", "target": "<= 1e-3" if dtype == torch.float32 else "<= 1e-2"}
    if dtype == torch.float32:
        llm = LLM(model, n_ctx=512, max_num_seqs=4)
        out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].token_ids
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompts[0]], device=reference.device), max_new_tokens=16,
                                      do_sample=False, min_new_tokens=16)[0, len(prompts[0]):].tolist()
        result["greedy equal"] = out == want
    return result


def sync_debug(device: str, folder_of, smoke: bool) -> dict:
    """A decode step (its graph recorded by the step before), then an engine step (the decode and sampling), with
    host waits made errors: where each still waits on the GPU (an engine step must, once, for the sampled ids)."""
    from kvlm import LLM, Batch, Context, SamplingParams

    if device != "cuda":
        return {"skipped": "no GPU"}
    folder, _ = folder_of("tiny" if smoke else "qwen2.5-0.5b", torch.bfloat16)
    model = load_kvlm(folder, "bfloat16", device, 256)
    ctx = Context(model, n_ctx=256, n_seq_max=1, kv_dtype="bf16")
    ctx.decode(Batch.for_sequence(list(range(10, 40))))
    ctx.decode(Batch.for_sequence([41], start_pos=30))
    result = {"graphs recorded": sorted(ctx.decode_graphs.graphs) if ctx.decode_graphs else "none"}
    torch.cuda.set_sync_debug_mode("error")
    try:
        status = ctx.decode(Batch.for_sequence([42], start_pos=31))
        result["decode step: first wait"] = "none" if int(status) == 0 else ctx.last_error[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine = LLM(model, n_ctx=256, max_num_seqs=2).engine
    engine.add_request(list(range(10, 40)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step(), engine.step()
    torch.cuda.set_sync_debug_mode("warn")  # (the one wait it must make: a warning, not an error)
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
        result["engine step: waits"] = [str(w.message)[:160] for w in caught]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return result


def decode_speed(device: str, folder_of, shape: str, batches: tuple[int, ...], steps: int) -> dict:
    """Tokens/s of decode steps at each batch size after 128-token prompts; bytes read per batch-1 token against
    the card's copy bandwidth."""
    from kvlm import Batch, Context

    folder, _ = folder_of(shape, torch.bfloat16)
    model = load_kvlm(folder, "bfloat16", device, 128 + steps + 8, max(batches))
    result = {}
    for n in batches:
        ctx = Context(model, n_ctx=n * (128 + steps + 8), n_batch=4096, n_ubatch=4096, n_seq_max=n, kv_dtype="bf16")
        for s in range(n):
            assert int(ctx.decode(Batch.for_sequence(list(range(100, 228)), seq_id=s))) == 0, ctx.last_error
        seconds = timed(device, _decode_steps(ctx, n, 128), steps)
        result[f"batch {n} tok/s"] = round(n / seconds, 1)
        if n == 1:
            result["batch 1 GB/s of weights"] = round(model.decoder.nbytes / seconds / 1e9, 1)
            eager = Context(model, n_ctx=128 + steps + 8, n_batch=4096, n_ubatch=4096, n_seq_max=1, kv_dtype="bf16",
                            cuda_graphs=False)
            assert int(eager.decode(Batch.for_sequence(list(range(100, 228))))) == 0, eager.last_error
            result["batch 1 eager tok/s"] = round(1 / timed(device, _decode_steps(eager, 1, 128), steps), 1)
    return result


def _decode_steps(ctx, n: int, first_position: int):
    """A decode step of n sequences, each call one position further."""
    from kvlm import Batch

    position = [first_position]

    def step() -> None:
        batch = Batch(tokens=[7] * n, pos=[position[0]] * n, seq_ids=list(range(n)), logits=[True] * n)
        assert int(ctx.decode(batch)) == 0, ctx.last_error
        position[0] += 1

    return step


def prefill_speed(device: str, folder_of, shape: str, n_tokens: int) -> dict:
    from kvlm import Batch, Context

    folder, _ = folder_of(shape, torch.bfloat16)
    model = load_kvlm(folder, "bfloat16", device, n_tokens + 8, 1)
    ctx = Context(model, n_ctx=n_tokens + 8, n_batch=n_tokens, n_ubatch=n_tokens, n_seq_max=1, kv_dtype="bf16")
    tokens = list(range(100, 100 + n_tokens))

    def prefill() -> None:
        ctx.memory.seq_rm(0, 0, -1)
        assert int(ctx.decode(Batch.for_sequence(tokens))) == 0, ctx.last_error

    seconds = timed(device, prefill, 3)
    c = SHAPES[shape]
    layer = 2 * c["hidden_size"] ** 2 + 2 * c["hidden_size"] * c["hidden_size"] // c["num_attention_heads"] * \
        c["num_key_value_heads"] + 3 * c["hidden_size"] * c["intermediate_size"]
    flops = 2 * n_tokens * (layer * c["num_hidden_layers"] + c["hidden_size"] * c["vocab_size"] / n_tokens)
    return {"tok/s": round(n_tokens / seconds, 1), "TFLOP/s": round(flops / seconds / 1e12, 1)}


def requests_benchmark(device: str, folder_of, shape: str, n_requests: int, shortest: int, longest: int) -> dict:
    """nano-vllm's benchmark: random prompts and outputs of shortest..longest tokens (100..1024), greedy, eos
    ignored."""
    from kvlm import LLM, SamplingParams

    folder, _ = folder_of(shape, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (n_requests, 2), generator=generator).tolist()
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [torch.randint(1, vocab, (p,), generator=generator).tolist() for p, _ in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    llm = LLM(str(folder), "bfloat16", quant=None, device=device, n_ctx=min(n_requests, 64) * 2 * longest,
              max_num_seqs=min(n_requests, 64), max_num_batched_tokens=4096)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    return {"requests": n_requests, "output tokens": generated, "output tok/s": round(generated / seconds, 1)}


def transformers_generate(device: str, folder_of, shape: str, batch: int, new_tokens: int) -> dict:
    """transformers' own generate on the same weights and card: a static cache at batch 1, then `batch` prompts."""
    _, model = folder_of(shape, torch.bfloat16)
    vocab = SHAPES[shape]["vocab_size"]
    ids = torch.randint(1, vocab, (1, 128), device=model.device)
    single = timed(device, lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                  do_sample=False, cache_implementation="static"))
    many = torch.randint(1, vocab, (batch, 128), device=model.device)
    batched = timed(device, lambda: model.generate(many, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                   do_sample=False))
    return {"batch 1 static-cache tok/s": round(new_tokens / single, 1),
            f"batch {batch} tok/s": round(batch * new_tokens / batched, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--skip-tests", action="store_true", help="not the GPU tests (they take a minute or two)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Triton's interpreter")
    args = parser.parse_args()
    smoke = args.smoke
    if smoke:
        os.environ["KVLM_BACKEND"] = "triton"  # (TRITON_INTERPRET=1 must be set before python starts)
    device = "cpu" if smoke else "cuda"
    report, folders, scratch = Report(), {}, Path(tempfile.mkdtemp(prefix="kvlm-gpu-check-"))

    def folder_of(shape: str, dtype: torch.dtype):
        if (shape, dtype) not in folders:
            folders[shape, dtype] = (scratch / f"{shape}-{dtype}".replace("torch.", ""), None)
            model = make_folder(shape, dtype, device, folders[shape, dtype][0])
            folders[shape, dtype] = (folders[shape, dtype][0], model)
        return folders[shape, dtype]

    big = "tiny" if smoke else "qwen2.5-0.5b"
    report.run("environment", environment, device)
    report.run("ceilings", ceilings, device)
    if not args.skip_tests:
        report.run("gpu tests", gpu_tests, device)
    report.run("fidelity fp32", fidelity, device, folder_of, "float32", smoke)
    report.run("fidelity bf16", fidelity, device, folder_of, "bfloat16", smoke)
    report.run("sync debug", sync_debug, device, folder_of, smoke)
    report.run("decode 0.5B", decode_speed, device, folder_of, big, (1, 2) if smoke else (1, 64), 4 if smoke else 64)
    report.run("transformers 0.5B", transformers_generate, device, folder_of, big, 4 if smoke else 64,
               4 if smoke else 128)
    report.run("requests 0.5B", requests_benchmark, device, folder_of, big, 3 if smoke else args.requests,
               *((8, 16) if smoke else (100, 1024)))
    if not args.skip_7b and not smoke:
        folders.clear()  # the 0.5B models' GPU memory back before the 7B ones
        torch.cuda.empty_cache()
        report.run("decode 7B", decode_speed, device, folder_of, "qwen2.5-7b", (1, 64), 32)
        report.run("prefill 7B", prefill_speed, device, folder_of, "qwen2.5-7b", 2048)
        report.run("transformers 7B", transformers_generate, device, folder_of, "qwen2.5-7b", 64, 64)
    print(report.table())
    args.out.write_text(json.dumps(report.sections, indent=1))


if __name__ == "__main__":
    main()
