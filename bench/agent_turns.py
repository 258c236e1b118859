"""An agent's conversation turn after turn, as a server sees it: every turn sends the whole history again. Time to
first token per turn, kvlm without prefix caching, with its defaults, and with its disk tier across a restart after
turn 10, beside llama.cpp (llama-cpp-python's Llama with its RAM state cache, as its server runs it) on the same
file, each engine and setting in child processes of its own, one after another.

    python -m bench.agent_turns [--model qwen3.5-0.8b-shaped] [--model qwen2.5-coder-0.5b-instruct] [--turns 20]

The conversation: a system prompt with two tools and a task, then per turn the assistant's tool call and the tool's
result (about 380 tokens of Newton's Opticks, bench/texts.py), rendered by the file's own chat template and
tokenized once by kvlm for every engine; 20 turns grow to about 9k tokens. Each turn the model writes a reply of
--reply-tokens greedy tokens (16; the time to the first is the turn's time to first token), and the next turn
carries the script's tool call in its place, as a client does that sends back the call it parsed and the template
renders it anew: what an engine computed of the reply is not in the next prompt, which shares exactly the previous
prompt. (With --reply-tokens 1 each prompt extends exactly what the engine computed.) kvlm's runs without caching
measure turns 1, 10 and 20 only (each is a prefill of its whole prompt, whatever came before). The tokens each kvlm
setting answers are compared turn by turn (greedy output identical with and without caching).

"qwen3.5-0.8b-shaped" and "gpt-oss-20b-shaped" are bench/big_model_file.py's files (made once, cached); anything
else is a known model name or a GGUF path.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

N_CTX = 10240
RESTART_AFTER = 10
UNCACHED_TURNS = (1, 10, 20)
RESULT_CHARS = 1700  # of the text per tool result: about 380 tokens
SHAPED = {"qwen3.5-0.8b-shaped": "qwen3.5-0.8b", "gpt-oss-20b-shaped": "gpt-oss-20b"}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file of the project.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "search_notes", "description": "Search the notes for a phrase.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
]
SYSTEM = ("You are a careful research agent. You read the project's files with the tools you are given, one call at "
          "a time, and keep notes of what each file says about light, colours and refraction. When you have read "
          "enough, you write a summary of every experiment with its result, citing the file it came from.")
TASK = "Read the notes in notes/ one part after another and summarise Newton's experiments on the prism."


def conversation(tokenizer, n_turns: int) -> list[list[int]]:
    """Each turn's prompt: the history so far, rendered by the chat template with the generation prompt."""
    from bench.texts import read_text

    text = read_text()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    result_role = "tool" if _renders(tokenizer, messages + [{"role": "assistant", "content": "."},
                                                          {"role": "tool", "content": "."}]) else "user"
    prompts = []
    for turn in range(n_turns):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        call = {"name": "read_file", "arguments": {"path": f"notes/part-{turn + 1:02d}.txt"}}
        start = 20000 + turn * RESULT_CHARS
        messages += [{"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
                     {"role": result_role, "content": text[start : start + RESULT_CHARS]}]
    return prompts


def _renders(tokenizer, messages: list[dict]) -> bool:
    """Whether the chat template takes these messages (Gemma 3's has no tool role: results come as the user's)."""
    import jinja2

    try:
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
    except jinja2.TemplateError:  # (raised by the template itself)
        return False
    return True


# --- the children ----------------------------------------------------------------------------------------------------

def kvlm_child(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    import torch

    from kvlm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    tiers = {"prefix_cache_dir": args.child_tier_dir} if args.child_tier_dir else {}
    llm = LLM(args.child_path, n_ctx=N_CTX, enable_prefix_caching=args.child == "kvlm", **tiers)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in args.child_turns:
        started, first = time.perf_counter(), None
        request_id = engine.add_request(prompts[turn - 1], params)
        while engine.has_unfinished():
            if any(event.new_token_ids for event in engine.step()) and first is None:
                first = time.perf_counter() - started
        output = engine.release(request_id)
        rows.append({"turn": turn, "ttft": first, "n_cached": output.n_cached_tokens, "tokens": output.token_ids})
    return rows


def llama_child(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    lib = llama.import_llama_cpp()
    from llama_cpp import Llama, LlamaRAMCache

    with llama.llama_threads_free(lib):
        model = Llama(args.child_path, n_ctx=N_CTX, n_batch=llama.N_BATCH, n_ubatch=llama.N_UBATCH,
                      n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        model.set_cache(LlamaRAMCache(capacity_bytes=8 << 30))  # (llama.cpp's server: --cache-ram 8192 MiB)
        rows = []
        for turn in args.child_turns:
            started, first = time.perf_counter(), None
            for _ in model.create_completion(prompts[turn - 1], max_tokens=args.reply_tokens, temperature=0.0,
                                             stream=True):
                first = first or time.perf_counter() - started
            rows.append({"turn": turn, "ttft": first})
    return rows


def run_child(setting: str, path: Path, turns: list[int], prompts_file: Path, args: argparse.Namespace,
              tier_dir: Path | None = None) -> list[dict]:
    import kvlm

    command = [sys.executable, "-m", "bench.agent_turns", "--child", setting, "--child-path", str(path),
               "--child-prompts", str(prompts_file), "--threads", str(args.threads),
               "--reply-tokens", str(args.reply_tokens),
               "--child-turns", ",".join(map(str, turns))]
    if tier_dir is not None:
        command += ["--child-tier-dir", str(tier_dir)]
    # Every core this process started with: torch's OpenMP pinned this one's main thread (and so its children).
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                          preexec_fn=lambda: os.sched_setaffinity(0, kvlm.startup.START_CPUS))  # noqa: PLW1509
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{setting} child failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    rows = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"  {setting:18} turns {turns[0]}-{turns[-1]}: " +
          " ".join(f"{row['ttft']:.2f}" for row in rows) + " s", flush=True)
    return rows


# --- the comparison --------------------------------------------------------------------------------------------------

def model_path(spec: str) -> Path:
    if spec in SHAPED:
        from bench.big_model_file import default_path, make_big_model

        return make_big_model(default_path(SHAPED[spec]), shape=SHAPED[spec])
    from bench.common import model_gguf

    return model_gguf(spec)


def compare_on(spec: str, args: argparse.Namespace) -> list[str]:
    from bench.common import markdown_table
    from kvlm.loader.load import open_model
    from kvlm.text.tokenizer import Tokenizer

    path = model_path(spec)
    _, _, metadata = open_model(path)
    prompts = conversation(Tokenizer.from_gguf_metadata(metadata), args.turns)
    extends = all(later[: len(earlier)] == earlier for earlier, later in zip(prompts, prompts[1:]))
    print(f"\n## {spec}: {path.name}; prompts {len(prompts[0])} .. {len(prompts[-1])} tokens, each extending the "
          f"last: {extends}", flush=True)
    all_turns = list(range(1, args.turns + 1))
    restart = min(RESTART_AFTER, args.turns - 1)
    with tempfile.TemporaryDirectory() as scratch:
        prompts_file = Path(scratch) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        uncached = run_child("kvlm-no-cache", path, [t for t in UNCACHED_TURNS if t <= args.turns], prompts_file, args)
        warm = run_child("kvlm", path, all_turns, prompts_file, args)
        tiers = Path(scratch) / "tiers"
        restarted = (run_child("kvlm", path, all_turns[:restart], prompts_file, args, tiers) +
                     run_child("kvlm", path, all_turns[restart:], prompts_file, args, tiers))
        theirs = theirs_restarted = None
        if not args.no_llama:
            theirs = run_child("llama.cpp", path, all_turns, prompts_file, args)
            theirs_restarted = run_child("llama.cpp", path, all_turns[restart:restart + 1], prompts_file, args)
    by_turn = lambda rows: {row["turn"]: row for row in rows or []}  # noqa: E731
    uncached, warm, restarted, theirs = map(by_turn, (uncached, warm, restarted, theirs))
    rows, identical = [], True
    for turn in all_turns:
        shared = len(prompts[turn - 2]) if turn > 1 else 0
        reuse = lambda row: f"{row['n_cached']} ({row['n_cached'] / shared:.0%})" if shared else "-"  # noqa: E731
        seconds = lambda table: f"{table[turn]['ttft']:.2f}" if turn in table else ""  # noqa: E731
        identical &= len({tuple(table[turn]["tokens"]) for table in (uncached, warm, restarted) if turn in table}) == 1
        rows.append([turn, len(prompts[turn - 1]), seconds(uncached), seconds(warm), reuse(warm[turn]), seconds(restarted),
                     reuse(restarted[turn]), seconds(theirs)])
    print(markdown_table(["turn", "prompt tokens", "kvlm no caching s", "kvlm defaults s", "reused",
                          f"kvlm disk tier, restarted after turn {restart} s", "reused", "llama.cpp s"], rows))
    lines = [f"same greedy tokens every turn, every kvlm setting: {identical}"]
    ten = min(10, args.turns)
    if ten in uncached:
        lines.append(f"turn {ten}: no caching / defaults = {uncached[ten]['ttft'] / warm[ten]['ttft']:.1f}x" +
                     (f", llama.cpp / defaults = {theirs[ten]['ttft'] / warm[ten]['ttft']:.1f}x" if theirs else ""))
    first_after = restart + 1
    lines.append(f"turn {first_after}, the first after the restart: disk tier {restarted[first_after]['ttft']:.2f} s "
                 f"= {restarted[first_after]['ttft'] / warm[first_after]['ttft']:.2f}x the warm hit of the "
                 f"uninterrupted run ({warm[first_after]['ttft']:.2f} s)" +
                 (f"; llama.cpp restarted {theirs_restarted[0]['ttft']:.2f} s" if theirs_restarted else ""))
    if first_after + 1 in restarted:  # (the same process's next turn, a hit in its cells: no process-to-process spread)
        lines.append(f"  and {restarted[first_after]['ttft'] / restarted[first_after + 1]['ttft']:.2f}x the restarted "
                     f"process's own next turn, a hit in its cells ({restarted[first_after + 1]['ttft']:.2f} s)")
    least = min((row["n_cached"] / len(prompts[row["turn"] - 2]), row["turn"]) for row in warm.values() if row["turn"] > 1)
    lines.append(f"least share of the shared prefix reused (defaults): {least[0]:.1%} (turn {least[1]})")
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help="qwen3.5-0.8b-shaped, gpt-oss-20b-shaped, a known model name or a GGUF path "
                             "(repeatable; default: qwen3.5-0.8b-shaped and qwen2.5-coder-0.5b-instruct)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--reply-tokens", type=int, default=16,
                        help="greedy tokens each turn generates (the next turn carries the script's reply instead, "
                             "as a client that sends back the tool call it parsed; 1: each prompt extends exactly "
                             "what the engine computed)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-llama", action="store_true", help="run kvlm only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-path", help=argparse.SUPPRESS)
    parser.add_argument("--child-prompts", help=argparse.SUPPRESS)
    parser.add_argument("--child-turns", type=lambda text: [int(t) for t in text.split(",")], help=argparse.SUPPRESS)
    parser.add_argument("--child-tier-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prompts = json.loads(Path(args.child_prompts).read_text())
        rows = llama_child(args, prompts) if args.child == "llama.cpp" else kvlm_child(args, prompts)
        print("RESULT " + json.dumps(rows), flush=True)
        return
    from bench.common import machine_line

    for spec in args.model or ["qwen3.5-0.8b-shaped", "qwen2.5-coder-0.5b-instruct"]:
        compare_on(spec, args)
    print(f"\n{machine_line()}")


if __name__ == "__main__":
    main()
