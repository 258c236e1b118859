"""The `kvlm` command: generate, chat, serve, pull, ls, rm, inspect, perplexity, bench."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

from kvlm.engine.chat_session import ChatSession
from kvlm.engine.engine import DEFAULT_DISK_TIER, memory_request
from kvlm.engine.llm import LLM
from kvlm.engine.request import RequestOutput
from kvlm.engine.scheduler import POLICIES
from kvlm.sampling.params import SamplingParams
from kvlm.core.errors import KvlmError
from kvlm.core.family import RECURRENT_KINDS
from kvlm.runtime.generate import GenerationSettings, generate
from kvlm.kernels import native_kernels
from kvlm.core.config import POOLINGS, ModelConfig
from kvlm.loader.fetch import DEFAULT_MODEL, KNOWN_MODELS, pull_model, resolve_model
from kvlm.loader.load import load_model, open_model
from kvlm.loader.memory_plan import parse_size, plan_memory
from kvlm.memory.kv_store import KV_DTYPES, kv_bytes_for
from kvlm.memory.layout import ISWA, memory_layout, recurrent_state_shapes
from kvlm.memory.recurrent import BANKS
from kvlm.model.settings import AUTO, DEVICES, DTYPES, QUANTS, resolve_settings
from kvlm.speculative.config import SpeculativeConfig
from kvlm.structured.params import StructuredOutputsParams
from kvlm.text.tokenizer import StreamDecoder, checked_template_kwargs


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
    _model_arguments(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text, tokenized as is")
    source.add_argument("--chat", help="one user message, rendered with the model's chat template")
    _template_arguments(gen)
    _sampling_arguments(gen)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (baseline)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=_json_schema, metavar="FILE|JSON",
                            help="the output must be JSON matching this schema (a file, or the schema itself)")
    constraint.add_argument("--regex", help="the output must match this regular expression")
    constraint.add_argument("--choice", nargs="+", metavar="TEXT", help="the output must be one of these texts")
    _swa_full_argument(gen)
    _speculative_argument(gen)
    gen.set_defaults(handler=_generate)

    chat = commands.add_parser("chat", help="talk with a model, turn by turn (an empty line or Ctrl-D ends)")
    _model_arguments(chat)
    chat.add_argument("--system", default=None, help="a system message for the conversation")
    _swa_full_argument(chat)
    _template_arguments(chat)
    _sampling_arguments(chat)
    _speculative_argument(chat)
    chat.set_defaults(handler=_chat)

    srv = commands.add_parser("serve", help="serve a model (or several) over OpenAI's and Anthropic's HTTP APIs")
    _model_arguments(srv, several=True)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    srv.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    srv.add_argument("--kv-dtype", choices=(AUTO, *KV_DTYPES), default=AUTO,
                     help="KV cache dtype (default: bf16 for bfloat16 activations, f16 for float32 ones over quantized "
                          "weights, f32 in the reference mode)")
    _swa_full_argument(srv)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)")
    srv.add_argument("--served-model-name", action="append", default=None,
                     help="the name clients use (default: from --model); once per --model, in the same order")
    srv.add_argument("--pooling", choices=POOLINGS, default=None,
                     help="how /v1/embeddings pools a text's states (default: the model's own; last for decoder models)")
    srv.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                     help="priority: requests' `priority` field orders them, lower first, preempting lower ones "
                          "(as vLLM's)")
    srv.add_argument("--preload", action="store_true",
                     help="with several --model: load them all at start (default: each at its first request)")
    srv.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                     help="unload a model no request used for SECONDS (it loads again when asked for)")
    srv.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                     help="keep at most N models loaded; loading another unloads the least recently used idle one")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    _speculative_argument(srv)
    _prefix_tier_arguments(srv)
    srv.set_defaults(handler=_serve)

    pull_cmd = commands.add_parser("pull", help="download a model into the cache: a known name, or a Hugging Face "
                                               "repository user/repo[:QUANT] (default quant Q4_K_M)",
                                   epilog="known models: " + "; ".join(f"{name}: {source.description}"
                                                                      for name, source in sorted(KNOWN_MODELS.items())))
    pull_cmd.add_argument("name", metavar="NAME")
    pull_cmd.set_defaults(handler=_pull)
    ls_cmd = commands.add_parser("ls", help="list the downloaded models (kvlm's cache and the Hugging Face cache) "
                                            "and the tiles files their starts keep")
    ls_cmd.set_defaults(handler=_ls)
    rm_cmd = commands.add_parser("rm", help="delete a downloaded model: a known name, user/repo:QUANT (that quant's "
                                            "files) or user/repo (the whole repository), with its tiles files")
    rm_cmd.add_argument("name", metavar="NAME")
    rm_cmd.set_defaults(handler=_rm)

    inspect = commands.add_parser("inspect", help="print a model's config, KV cache size and memory plan (reads no "
                                                  "weights)")
    inspect.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    inspect.add_argument("--ctx", type=int, default=None,
                         help="context length (default: the largest that fits, up to the model's)")
    inspect.add_argument("--max-num-seqs", type=int, default=1, help="sequences the plan is for (default 1)")
    inspect.add_argument("--kv-dtype", choices=(AUTO, *KV_DTYPES), default=AUTO)
    inspect.add_argument("--dtype", choices=(AUTO, *DTYPES), default=AUTO)
    inspect.add_argument("--quant", choices=(AUTO, None, *QUANTS), default=AUTO, type=_quant,
                         metavar="{auto,none,int8,int4}")
    _device_argument(inspect)
    _budget_argument(inspect)
    inspect.set_defaults(handler=_inspect)

    ppl = commands.add_parser("perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity")
    ppl.add_argument("file", help="a UTF-8 text file (at least 2 x --ctx tokens)")
    _model_arguments(ppl)
    ppl.add_argument("--ctx", "-c", type=int, dest="n_ctx", help="tokens per chunk, the same as --n-ctx (default 512)")
    ppl.set_defaults(n_ctx=512)  # also the default of --n-ctx, which sets the same value
    ppl.add_argument("--chunks", type=int, default=None, help="evaluate only the first N chunks (default: all)")
    ppl.add_argument("--kv-dtype", choices=(AUTO, *KV_DTYPES), default=AUTO,
                     help="KV cache dtype (default: bf16 for bfloat16 activations, f16 for float32 ones over quantized "
                          "weights, f32 in the reference mode)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object instead of the progress lines")
    ppl.set_defaults(handler=_perplexity)

    bench = commands.add_parser("bench", help="offline throughput: random prompts, all at once, fixed output length")
    _model_arguments(bench)
    bench.add_argument("--num-prompts", type=int, default=8)
    bench.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    bench.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (EOS ignored)")
    bench.add_argument("--seed", type=int, default=0, help="of the random prompt token ids")
    bench.add_argument("--json", action="store_true", help="print one JSON object (with the generated token ids)")
    _speculative_argument(bench)
    bench.set_defaults(handler=_bench)
    return parser


def _budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                        help="most memory for weights, the KV cache and buffers, e.g. 6GiB "
                             "(default: what the machine has)")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    if several:
        parser.add_argument("--model", action="append", default=None,
                            help=f"known name, .gguf path or Hugging Face folder; repeat it to serve several models "
                                 f"(default: {DEFAULT_MODEL})")
    else:
        parser.add_argument("--model", default=DEFAULT_MODEL, help="known name, .gguf path or Hugging Face folder")
    parser.add_argument("--dtype", choices=(AUTO, *DTYPES), default=AUTO,
                        help="activations; auto: bfloat16 where the CPU has bf16 instructions, else float32 "
                             "(float32 is the reference mode)")
    parser.add_argument("--quant", choices=(AUTO, None, *QUANTS), default=AUTO, type=_quant,
                        metavar="{auto,none,int8,int4}",
                        help="weights; auto: as the file stores them (its quantized blocks, read by native kernels); "
                             "none: dense; int8/int4: every layer matrix requantized to Q8_0/Q4_1")
    parser.add_argument("--n-ctx", type=int, default=None,
                        help="KV cache cells (tokens of context; default: the largest that fits in memory, up to the "
                             "model's own context length)")
    _device_argument(parser)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs (as vLLM's)")
    _budget_argument(parser)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="with --dtype float32 (the reference mode), logits that do not depend on the batch "
                             "(oneDNN products, float64 attention); every other mode is batch-invariant already")
    parser.add_argument("--compile", action="store_true",
                        help="run decode steps and prompt chunks through graphs compiled by torch.compile "
                             "(about a minute per batch size the first time, cached in $KVLM_HOME/inductor); "
                             "gives up batch invariance")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="split every layer's heads and MLP over N processes (gloo); under torchrun, N is "
                             "the number of ranks")


def _device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=(AUTO, *DEVICES), default=AUTO,
                        help="where the model runs: cuda (an NVIDIA GPU: bf16 weights, the KV cache in its memory, "
                             "Triton kernels), cpu, or auto (cuda where torch sees a GPU)")


def _swa_full_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swa-full", action="store_true",
                        help="keep every cell of sliding-window layers (more memory; prefix reuse is never cut short)")


def _speculative_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             '(prompt lookup) or \'{"model": NAME, "num_speculative_tokens": 4}\' (a draft model); '
                             'the output is unchanged, guesses are made only where they pay')


def _prefix_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-cache-ram", type=_size, default=0, metavar="SIZE",
                        help="keep finished conversations' states in RAM for later prompts that start with them, up "
                             "to SIZE, e.g. 4GiB (as llama.cpp's --cache-ram; default 0: only the KV cells' cache)")
    parser.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                        help="keep them on disk too, in DIR: a restarted server with the same model and settings "
                             "reuses the previous one's conversations")
    parser.add_argument("--prefix-cache-disk", type=_size, default=DEFAULT_DISK_TIER, metavar="SIZE",
                        help="most bytes kept in --prefix-cache-dir (default 10GiB), the least recently used "
                             "evicted first")


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _quant(text: str) -> str | None:
    return None if text == "none" else text


def _template_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template-kwargs", type=_template_kwargs, default={}, metavar="JSON",
                        help='extra chat template variables, e.g. \'{"enable_thinking": false}\'')


def _template_kwargs(text: str) -> dict:
    """argparse type of --chat-template-kwargs: a JSON object; argparse names the flag in its error."""
    try:
        return checked_template_kwargs(json.loads(text), "the value")
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)


def _json_schema(value: str) -> dict:
    """A JSON schema given as its text or as the path of a file holding it."""
    text = Path(value).read_text(encoding="utf-8") if not value.lstrip().startswith("{") else value
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON schema (nor a file holding one): {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"a JSON schema is an object, got {text[:80]!r}")
    return schema


def _constraint(args: argparse.Namespace) -> StructuredOutputsParams | None:
    if args.json_schema is not None:
        return StructuredOutputsParams(json=args.json_schema)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    return StructuredOutputsParams(choice=args.choice) if args.choice else None


def _generate(args: argparse.Namespace) -> int:
    params = dataclasses.replace(_sampling_params(args), structured_outputs=_constraint(args))
    if args.prompt is not None and args.chat_template_kwargs:
        raise ValueError("--chat-template-kwargs applies to --chat only; a --prompt is tokenized as is")
    model = _load_model(args, max_num_seqs=1)
    prompt_ids = model.tokenizer.encode(args.prompt) if args.prompt is not None else model.tokenizer.encode_chat(
        [{"role": "user", "content": args.chat}], **args.chat_template_kwargs)
    output = _recompute_every_step(model, prompt_ids, args) if args.no_cache else _stream(
        _llm(model, args, max_num_seqs=1).stream(prompt_ids, params), quiet=args.json)
    if args.json:
        print(json.dumps({"text": output.text, "token_ids": output.token_ids,
                          "prompt_token_ids": output.prompt_token_ids, "finish_reason": output.finish_reason,
                          "timings": output.timings}))
    else:
        _print_timings(output)
    return 0


def _stream(chunks, quiet: bool) -> RequestOutput:
    for chunk in chunks:
        if not quiet:
            _write(chunk.text)
        if chunk.finished:
            if not quiet:
                _write("\n")
            return chunk.output
    raise AssertionError("a stream always ends with a finished chunk")


def _recompute_every_step(model, prompt_ids: list[int], args: argparse.Namespace) -> RequestOutput:
    """The baseline without a KV cache: the single-sequence loop, recomputing the whole sequence per token."""
    settings = GenerationSettings(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                  ignore_eos=args.ignore_eos, use_cache=False)
    stream = StreamDecoder(model.tokenizer, skip_special_tokens=True)
    on_token = None if args.json else (lambda t: _write(stream.feed(t)))
    result = generate(model, prompt_ids, settings, on_token=on_token)
    if not args.json:
        _write(stream.flush() + "\n")
    return RequestOutput(
        request_id="0", prompt_token_ids=prompt_ids, token_ids=result.token_ids, finish_reason=result.finish_reason,
        text=model.tokenizer.decode(result.token_ids, skip_special_tokens=True),
        time_to_first_token=result.prefill_seconds or None, decode_seconds=result.decode_seconds or None,
    )


def _print_timings(output: RequestOutput) -> None:
    timings = output.timings
    print(f"[{len(output.prompt_token_ids)} prompt tokens at {timings['prefill_tokens_per_s']:.1f} tok/s, "
          f"{len(output.token_ids)} generated at {timings['decode_tokens_per_s']:.1f} tok/s, "
          f"finish: {output.finish_reason}]", file=sys.stderr)


def _load_model(args: argparse.Namespace, max_num_seqs: int, n_ctx: int | None = None):
    """The model, its memory planned for an engine of `max_num_seqs` sequences (refused before any weight is read
    if that does not fit)."""
    speculative = getattr(args, "speculative_config", None)
    request = memory_request(n_ctx or args.n_ctx, max_num_seqs, swa_full=getattr(args, "swa_full", False),
                             speculative_tokens=speculative.num_speculative_tokens if speculative else 0)
    return load_model(args.model, args.dtype, quant=args.quant, batch_invariant=args.batch_invariant,
                      compile=args.compile, tensor_parallel_size=args.tensor_parallel_size, memory=request,
                      memory_budget=args.memory_budget, device=args.device)


def _llm(model, args: argparse.Namespace, max_num_seqs: int) -> LLM:
    """An engine over the loaded model, with the context planned when it was loaded."""
    return LLM(model, n_ctx=args.n_ctx or model.plan.n_ctx, max_num_seqs=max_num_seqs, swa_full=args.swa_full,
               memory_budget=args.memory_budget, speculative_config=args.speculative_config,
               enforce_eager=args.enforce_eager)


def _chat(args: argparse.Namespace) -> int:
    llm = _llm(_load_model(args, max_num_seqs=1), args, max_num_seqs=1)
    session = ChatSession(llm, _sampling_params(args), system=args.system,
                          chat_template_kwargs=args.chat_template_kwargs)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            _write("> ")
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        output = _stream(session.send(line.rstrip("\n")), quiet=False)
        print(f"[prefilled {len(output.prompt_token_ids) - output.n_cached_tokens} new tokens, "
              f"reused {output.n_cached_tokens} cached]", file=sys.stderr)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _serve(args: argparse.Namespace) -> int:
    from kvlm.server.serve import (  # the web stack loads only for this command
        ServeSettings,
        serve,
    )

    return serve(ServeSettings(
        model=args.model or [DEFAULT_MODEL], host=args.host, port=args.port, dtype=args.dtype, quant=args.quant,
        n_ctx=args.n_ctx,
        batch_invariant=args.batch_invariant, compile=args.compile, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, memory_budget=args.memory_budget,
        kv_dtype=args.kv_dtype, swa_full=args.swa_full, api_key=args.api_key, served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
        speculative_config=args.speculative_config, enforce_eager=args.enforce_eager,
        prefix_cache_ram=args.prefix_cache_ram, prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk=args.prefix_cache_disk, pooling=args.pooling, scheduling_policy=args.scheduling_policy,
        preload=args.preload, idle_unload=args.idle_unload, max_loaded_models=args.max_loaded_models))


def _pull(args: argparse.Namespace) -> int:
    print(pull_model(args.name))
    return 0


def _ls(args: argparse.Namespace) -> int:
    from kvlm.loader.model_cache import cached_models
    from kvlm.loader.tile_cache import cache_directory, kept_tiles, tiles_of

    models, kept = cached_models(), kept_tiles()
    width = max([len(m.name) for m in models] + [4])
    print(f"{'NAME':{width}}  {'SIZE':>10}  {'TILES':>10}  WHERE")
    listed = set()
    for model in models:
        tiles = tiles_of(list(model.files), kept)
        listed.update(t.path for t in tiles)
        print(f"{model.name:{width}}  {model.size / 2**20:>7.1f} MiB  {sum(t.size for t in tiles) / 2**20:>7.1f} MiB  "
              f"{model.where}")
    others = [t for t in kept if t.path not in listed]
    if others:
        print(f"tiles of {len(others)} other model files (your own, or changed since): "
              f"{sum(t.size for t in others) / 2**20:.1f} MiB in {cache_directory()}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from kvlm.loader.model_cache import remove_model

    for path in remove_model(args.name):
        print(f"removed {path}")
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from kvlm.runtime.perplexity import (
        ChunkReport,
        check_chunks,
        check_n_ctx,
        format_final,
        format_running,
        iter_perplexity,
    )

    check_n_ctx(args.n_ctx)  # before the model loads
    check_chunks(args.chunks)
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {args.file}: {exc}") from None
    model = _load_model(args, max_num_seqs=1, n_ctx=args.n_ctx)
    for item in iter_perplexity(model, text, args.n_ctx, args.chunks, args.kv_dtype):
        if isinstance(item, ChunkReport):
            if not args.json:
                _write(format_running(item))
        elif args.json:
            print(json.dumps({"file": args.file, "model": str(model.source), **item.to_json()}))
        else:
            print(f"\n{format_final(item)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvlm.cli.benchmark import random_prompts, run_benchmark

    _check_positive(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    n_ctx = max(args.n_ctx, args.input_len + args.output_len) if args.n_ctx else None
    model = _load_model(args, max_num_seqs=args.num_prompts, n_ctx=n_ctx)
    llm = LLM(model, n_ctx=n_ctx or model.plan.n_ctx, max_num_seqs=args.num_prompts,
              memory_budget=args.memory_budget, speculative_config=args.speculative_config)
    result = run_benchmark(llm, random_prompts(model.config.vocab_size, args.num_prompts, args.input_len, args.seed),
                           args.output_len)
    result["tensor_parallel_size"] = args.tensor_parallel_size
    result["compute"] = model.decoder.describe()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} generated each, "
              f"tensor parallel {args.tensor_parallel_size}: prefill {result['prefill_tokens_per_s']:.1f} tok/s, "
              f"decode {result['decode_tokens_per_s']:.1f} tok/s, {result['requests_per_s']:.2f} requests/s "
              f"({result['elapsed_s']:.1f} s)")
        if "speculative" in result:
            spec = result["speculative"]
            print(f"speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} guessed tokens "
                  f"accepted, mean acceptance length {spec['mean_acceptance_length']:.2f}")
    return 0


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _inspect(args: argparse.Namespace) -> int:
    source = resolve_model(args.model)
    config, weights, _ = open_model(source)
    settings = resolve_settings(args.dtype, args.quant, device=args.device)
    request = memory_request(args.ctx, args.max_num_seqs, kv_dtype=args.kv_dtype, enable_prefix_caching=False)
    plan = plan_memory(config, weights, settings, request, args.memory_budget, native_kernels() is not None,
                       where=source.name)
    n_ctx = plan.n_ctx
    for key, value in config.describe().items():
        print(f"{key:20} {value}")
    stored = Counter(weights.file_type(name) for name in weights.names())
    print(f"{'stored as':20} {', '.join(f'{n} {t}' for t, n in stored.most_common())}")
    if config.n_expert:
        _inspect_experts(config, weights)
    print(f"{'compute':20} {settings.describe(stored)}")
    print(f"{'n_ctx':20} {n_ctx}" + ("" if args.ctx else " (the largest that fits, up to the model's own)"))
    for label, text in plan.lines():
        print(f"{'memory: ' + label:20} {text}")
    if any(kind in RECURRENT_KINDS for kind in config.layer_kinds):
        _inspect_recurrent(config, n_ctx)
        return 0
    memory = memory_layout(config, n_ctx, INSPECT_N_SEQ_MAX, INSPECT_N_UBATCH)
    if memory.kind != ISWA:
        for dtype in KV_DTYPES:
            size = memory.kv_bytes(config, dtype)
            print(f"kv_bytes ({dtype:4})     {size} ({size / 2**20:.2f} MiB)")
        return 0
    full_pool, sliding_pool = memory.pools
    print(f"{'kv memory':20} iswa: full pool {len(full_pool.layers)} layers x {full_pool.n_cells} cells, "
          f"sliding pool {len(sliding_pool.layers)} layers x {sliding_pool.n_cells} cells")
    print(f"{'sliding pool cells':20} min(n_ctx, window {config.sliding_window} x n_seq_max {INSPECT_N_SEQ_MAX} + "
          f"n_ubatch {INSPECT_N_UBATCH}) = {sliding_pool.n_cells}")
    layout = "two pools, every cell kept" if config.full_head_dim else "one pool"  # rows of two sizes: two pools
    print(f"{'swa_full':20} {layout}, {len(config.kv_layers)} layers x {n_ctx} cells (--swa-full)")
    if config.n_kv_shared:
        _inspect_shared_kv(config, n_ctx)
    for dtype in KV_DTYPES:
        full, sliding = (pool.nbytes(config, dtype) for pool in memory.pools)
        kept = kv_bytes_for(config, n_ctx, dtype)
        print(f"kv_bytes ({dtype:4})     {_bytes(full + sliding)} = full {_bytes(full)} + sliding {_bytes(sliding)}; "
              f"swa_full {_bytes(kept)}")
    return 0


def _inspect_shared_kv(config: ModelConfig, n_ctx: int) -> None:
    """Which layers read another's K/V (Gemma 4), and the bytes that saves (f16, every cell kept)."""
    first = config.n_layer - config.n_kv_shared
    sources = sorted({config.kv_source(i) for i in range(first, config.n_layer)})
    shared = dataclasses.replace(config, n_kv_shared=0)
    saved = kv_bytes_for(shared, n_ctx, "f16") - kv_bytes_for(config, n_ctx, "f16")
    print(f"{'kv sharing':20} layers {first}..{config.n_layer - 1} read the K/V of layers "
          f"{', '.join(map(str, sources))} and hold none: {_bytes(saved)} not allocated (f16, {n_ctx} cells)")


def _inspect_experts(config: ModelConfig, weights) -> None:
    """The experts, and the share of the weights a token reads (its experts' and everything else)."""
    shared = f", a shared expert {config.n_ff_shexp} wide" if config.n_ff_shexp else ""
    dense = config.n_layer - config.n_moe_layers
    leading = f"; {dense} layer{'' if dense == 1 else 's'} with a plain MLP" if dense else ""
    weighting = "renormalised" if config.expert_weights_norm else "as routed (not renormalised)"
    print(f"{'experts':20} {config.n_expert} per layer, {config.n_expert_used} used per token, each "
          f"{config.n_ff_exp} wide{shared}; weights {weighting}{leading}")
    active, total = weights.bytes_per_token()
    print(f"{'bytes per token':20} {_bytes(active)} active of {_bytes(total)} ({active / total:.0%})")


def _inspect_recurrent(config: ModelConfig, n_ctx: int) -> None:
    """A model with recurrent layers: the memory kind; KV bytes for its attention layers only (hybrid; none for a
    model of recurrent layers alone); the recurrent state of one sequence (n_seq_max 1) in both banks, float32
    whatever the KV dtype."""
    memory = memory_layout(config, n_ctx)
    n_attention, state = sum(len(pool.layers) for pool in memory.pools), memory.state_bytes
    recurrent = Counter(kind for kind in config.layer_kinds if kind in RECURRENT_KINDS)
    layers = ", ".join(f"{n} {kind} layer{'' if n == 1 else 's'}" for kind, n in recurrent.items())
    if n_attention:
        print(f"{'kv memory':20} hybrid: KV cache for {n_attention} attention layers x {n_ctx} cells, "
              f"recurrent state for {layers}")
        for dtype in KV_DTYPES:
            size = memory.kv_bytes(config, dtype)
            print(f"kv_bytes ({dtype:4})     {_bytes(size)} for {n_attention} attention layers of {config.n_layer}")
    else:
        print(f"{'kv memory':20} recurrent: no KV cache, recurrent state for {layers}")
    per_layer = {kind: " + ".join("x".join(map(str, shape)) for shape in recurrent_state_shapes(config, kind))
                 for kind in recurrent}
    shapes = ", ".join(f"{n} {kind} layer{'' if n == 1 else 's'} x [{per_layer[kind]}]"
                       for kind, n in recurrent.items())
    print(f"{'recurrent state':20} {_bytes(state * BANKS * INSPECT_N_SEQ_MAX)} for n_seq_max {INSPECT_N_SEQ_MAX} in "
          f"{BANKS} banks (committed, being written), f32: {shapes} per sequence")


# What `kvlm inspect` sizes the sliding pool for: one sequence, micro-batches of 512 (llama.cpp's defaults).
INSPECT_N_SEQ_MAX = 1
INSPECT_N_UBATCH = 512


def _bytes(size: int) -> str:
    return f"{size} ({size / 2**20:.2f} MiB)"
