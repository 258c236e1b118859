"""The `kvlm` command: generate, pull, inspect."""
from __future__ import annotations

import argparse
import json
import sys

from kvlm.errors import KvlmError
from kvlm.fetch import DEFAULT_MODEL, KNOWN_MODELS, pull
from kvlm.generate import GenerationSettings, generate
from kvlm.load import load_config, load_model
from kvlm.memory.kv_store import KV_DTYPES, kv_bytes_for
from kvlm.model.linear import QUANTS
from kvlm.tokenizer import StreamDecoder


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except (KvlmError, ValueError) as exc:
        print(f"kvlm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlm", description="Run small LLMs on the CPU, KV cache first.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt or one chat message")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="known name, .gguf path or Hugging Face folder")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text, tokenized as is")
    source.add_argument("--chat", help="one user message, rendered with the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    gen.add_argument("--quant", choices=QUANTS, default=None,
                     help="keep layer weights int8/int4 (needs --dtype bfloat16): faster decode")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(handler=_generate)

    pull_cmd = commands.add_parser("pull", help="download a known model into the cache")
    pull_cmd.add_argument("name", choices=sorted(KNOWN_MODELS))
    pull_cmd.set_defaults(handler=_pull)

    inspect = commands.add_parser("inspect", help="print a model's config and KV cache size")
    inspect.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    inspect.add_argument("--ctx", type=int, default=None, help="context length (default: the model's)")
    inspect.set_defaults(handler=_inspect)
    return parser


def _generate(args: argparse.Namespace) -> int:
    settings = GenerationSettings(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        ignore_eos=args.ignore_eos, use_cache=not args.no_cache,
    )
    model = load_model(args.model, args.dtype, quant=args.quant)
    tokenizer = model.tokenizer
    text = args.prompt if args.prompt is not None else tokenizer.apply_chat_template(
        [{"role": "user", "content": args.chat}]
    )
    prompt_ids = tokenizer.encode(text)
    if args.json:
        result = generate(model, prompt_ids, settings)
        print(json.dumps({
            "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
            "token_ids": result.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "finish_reason": result.finish_reason,
            "timings": result.timings,
        }))
        return 0
    stream = StreamDecoder(tokenizer, skip_special_tokens=True)
    result = generate(model, prompt_ids, settings, on_token=lambda t: _write(stream.feed(t)))
    _write(stream.flush() + "\n")
    timings = result.timings
    print(
        f"[{len(prompt_ids)} prompt tokens at {timings['prefill_tokens_per_s']:.1f} tok/s, "
        f"{len(result.token_ids)} generated at {timings['decode_tokens_per_s']:.1f} tok/s, "
        f"finish: {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _pull(args: argparse.Namespace) -> int:
    print(pull(args.name))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    n_ctx = args.ctx or config.n_ctx_train
    for key, value in config.describe().items():
        print(f"{key:20} {value}")
    print(f"{'n_ctx':20} {n_ctx}")
    for dtype in KV_DTYPES:
        size = kv_bytes_for(config, n_ctx, dtype)
        print(f"kv_bytes ({dtype:4})     {size} ({size / 2**20:.2f} MiB)")
    return 0
