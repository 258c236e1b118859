"""Prefix reuse on every memory kind, on random-weight models transformers builds: Llama (unified KV), Gemma 3
(iSWA, window 8), Mamba2 (recurrent states alone), LFM2 and Qwen3.5 (hybrid: K/V cells and states), each with
kvlm's native kernels and with torch's ops alone. A conversation's next turn reuses what the engine computed for
the previous one up to its last block boundary (K/V blocks, and for recurrent states the copy kept there:
kvlm.engine.state_checkpoints) and answers exactly as without caching."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, example, given, settings, strategies as st

from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gemma3_factory import gguf_of as gemma3_gguf, random_gemma3
from helpers.gguf_factory import write_gguf
from helpers.models import load_on, token_ids
from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2
from kvlm import LLM, Batch, Context, SamplingParams
from kvlm.core.family import RECURRENT_KINDS
from kvlm.memory.seq_state import decode_state, encode_state

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(folder):
    spec = SPECS["llama-llama3"]
    model = random_model(spec)
    return write_gguf(folder / "model.gguf", family_gguf_metadata(model, spec), family_gguf_tensors(model, spec),
                      arch=spec.arch, quant=T.Q4_0)


FILES = {
    "llama": _llama,
    "gemma3": lambda folder: gemma3_gguf(random_gemma3(), folder),
    "mamba2": lambda folder: mamba2_gguf(random_mamba2(), folder, T.Q8_0),
    "lfm2": lambda folder: lfm2_gguf(random_lfm2(), folder, T.Q8_0),
    "qwen35": lambda folder: write_qwen35_gguf(random_qwen35(num_hidden_layers=4), folder / "model.gguf", T.Q8_0),
}
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module", params=[(name, ops) for name in FILES for ops in ("native", "torch")], ids="-".join)
def model(request, tmp_path_factory):
    name, ops = request.param
    return load_on(FILES[name](tmp_path_factory.mktemp(name)), ops == "native")


@pytest.fixture
def recurrent_model(model):
    if not set(model.config.layer_kinds) & set(RECURRENT_KINDS):
        pytest.skip("no recurrent states: its K/V blocks are lent as they are")
    return model


def without_caching(model, prompt: list[int]) -> list[int]:
    llm = LLM(model, n_ctx=256, max_num_seqs=2, enable_prefix_caching=False)
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids


def test_the_next_turn_reuses_the_last_and_answers_as_without_caching(model):
    """Turn 2 is turn 1's prompt, its answer and 30 tokens more: what the engine computed for turn 1 (the prompt and
    all but the answer's last token: 169 tokens) is reused to its last block boundary (160 tokens, 94% of the 170
    shared). A third request sharing only turn 1's prompt reuses it to the prompt's last boundary."""
    llm = LLM(model, n_ctx=256, max_num_seqs=2)
    first = token_ids(1000, 150, seed=1)
    answer = llm.generate([first], GREEDY, use_tqdm=False)[0]
    assert answer.token_ids == without_caching(model, first)
    second = first + answer.token_ids + token_ids(1000, 30, seed=2)
    again = llm.generate([second], GREEDY, use_tqdm=False)[0]
    shared = len(first) + len(answer.token_ids)
    assert again.n_cached_tokens == (shared - 1) // BLOCK * BLOCK == 160
    assert again.n_cached_tokens >= 0.85 * shared
    assert again.token_ids == without_caching(model, second)
    branch = first + token_ids(1000, 12, seed=3)
    other = llm.generate([branch], GREEDY, use_tqdm=False)[0]
    assert other.n_cached_tokens == len(first) // BLOCK * BLOCK == 144
    assert other.token_ids == without_caching(model, branch)


def test_a_restored_state_equals_the_state_computed_from_scratch(recurrent_model):
    model = recurrent_model
    """The copy kept at the end of a request (100 prompt tokens and 19 of the answer computed: boundary 112) holds
    the states a fresh context of the same KV dtype computes from those 112 tokens in one batch."""
    llm = LLM(model, n_ctx=256, max_num_seqs=1)
    prompt = token_ids(1000, 100, seed=4)
    history = prompt + llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    kept = llm.engine.checkpoints.deepest(history, len(history))
    assert kept is not None and kept.n_tokens == 112
    ctx = Context(model, n_ctx=256, n_seq_max=1, kv_dtype=llm.engine.context.kv_dtype)  # (the engine's: f16)
    ctx.decode(Batch.for_sequence(history[: kept.n_tokens], seq_id=0))
    _, span, scratch = ctx.memory.checkpoint(0)
    assert span == [0, kept.n_tokens - 1] and len(scratch) == len(kept.parts)
    for ours, reference in zip(kept.parts, scratch):
        assert torch.allclose(ours, reference, rtol=0, atol=1e-5)


def test_state_copies_stay_within_their_capacity_and_the_memory_plan_counts_them(recurrent_model):
    model = recurrent_model
    """One request at a time: room for its latest copy and one more; the plan's K/V bytes include both."""
    llm = LLM(model, n_ctx=256, max_num_seqs=1)
    checkpoints = llm.engine.checkpoints
    assert checkpoints.capacity == 2 and llm.engine.plan.state_copies == 2
    assert "2 state copies for prefix reuse" in dict(llm.engine.plan.lines())["kv cache"]
    without = LLM(model, n_ctx=256, max_num_seqs=1, enable_prefix_caching=False).engine.plan
    for seed in range(5):
        llm.generate([token_ids(1000, 40 + 7 * seed, seed=10 + seed)], GREEDY, use_tqdm=False)
        assert checkpoints.n_states <= 2
    assert checkpoints.n_states == 2
    assert llm.engine.plan.kv - without.kv == checkpoints.n_bytes


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Qwen3.5 (K/V cells and delta-rule states) with the native kernels."""
    return load_on(FILES["qwen35"](tmp_path_factory.mktemp("qwen35-hybrid")), True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stems=st.lists(st.integers(0, 2), min_size=3, max_size=6),
       lengths=st.lists(st.integers(1, 40), min_size=6, max_size=6),
       max_num_seqs=st.integers(1, 3))
@example(stems=[0, 0, 0], lengths=[40, 1, 1, 1, 1, 1], max_num_seqs=1)  # a prompt ending at a block boundary
def test_requests_sharing_and_evicting_prefixes_answer_as_each_alone(hybrid, stems, lengths, max_num_seqs):
    """Requests extending three conversation stems, several at a time in 160 cells with 2 x max_num_seqs state
    copies and a RAM tier, then again, then each one's next turn: prefix blocks, copies and tier entries are lent,
    loaded, evicted and preempted under each other, and every answer is the answer of its request alone without
    caching. The same prompt twice in a row: the second starts at least from the copy at the prompt's last block
    boundary before its end."""
    stem_tokens = [token_ids(1000, 40 + 24 * stem, seed=50 + stem) for stem in range(3)]
    prompts = [stem_tokens[stem] + token_ids(1000, lengths[i], seed=60 + i) for i, stem in enumerate(stems)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(hybrid, n_ctx=160, max_num_seqs=max_num_seqs, max_num_batched_tokens=48, prefix_cache_ram="1MiB")
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts[::-1], params, use_tqdm=False)[::-1]  # now with the cache full of them
    turns = [prompt + a.token_ids + token_ids(1000, 4, seed=70 + i) for i, (prompt, a) in enumerate(zip(prompts, first))]
    third = llm.generate(turns, params, use_tqdm=False)
    checkpoints, ram = llm.engine.checkpoints, llm.engine.tiers.tier("ram")
    assert checkpoints.n_states <= checkpoints.capacity and ram.n_bytes <= ram.capacity
    alone = LLM(hybrid, n_ctx=160, max_num_seqs=1, enable_prefix_caching=False)
    for prompt, turn, a, b, c in zip(prompts, turns, first, second, third):
        expected = alone.generate([prompt], params, use_tqdm=False)[0].token_ids
        assert a.token_ids == expected and b.token_ids == expected
        assert c.token_ids == alone.generate([turn], params, use_tqdm=False)[0].token_ids
    llm.generate([prompts[0]], params, use_tqdm=False)
    repeated = llm.generate([prompts[0]], params, use_tqdm=False)[0]  # from the copy short of the prompt's end
    assert repeated.n_cached_tokens >= (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert repeated.token_ids == first[0].token_ids


# The tiers beyond the cells (kvlm.engine.prefix_tiers): finished sequences' states in RAM and on disk.

def conversation(llm: LLM, first: list[int]) -> tuple[list[int], list[int]]:
    """Turn 1 (first) through `llm`, and turn 2: turn 1, its answer and 30 tokens more."""
    answer = llm.generate([first], GREEDY, use_tqdm=False)[0].token_ids
    return answer, first + answer + token_ids(1000, 30, seed=2)


def test_a_restarted_engine_reuses_the_conversation_from_its_disk_tier(model, tmp_path):
    """Turn 1 in one engine, turn 2 in a new one over the same directory: the 169 positions the first computed
    (all but the answer's last token: 99% of the 170 shared) are loaded, and the answer is the one without caching.
    A memory of K/V cells alone also takes part of an entry: turn 1's prompt again reuses all but its last token."""
    first = token_ids(1000, 150, seed=1)
    answer, second = conversation(LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_dir=tmp_path), first)
    restarted = LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_dir=tmp_path)
    again = restarted.generate([second], GREEDY, use_tqdm=False)[0]
    shared = len(first) + len(answer)
    assert again.n_cached_tokens == shared - 1 >= 0.95 * shared
    assert again.token_ids == without_caching(model, second)
    disk = restarted.engine.tiers.tier("disk")
    assert (disk.stats.hits, disk.stats.hit_tokens) == (1, shared - 1)
    if restarted.engine.context.memory.kind == "unified":
        fresh = LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_dir=tmp_path)
        repeated = fresh.generate([first], GREEDY, use_tqdm=False)[0]
        assert repeated.n_cached_tokens == len(first) - 1 and repeated.token_ids == answer


def test_after_a_restart_a_prompt_carrying_another_reply_reuses_the_previous_prompt(model, tmp_path):
    """The client sends turn 1's prompt back with a reply of its own, not the tokens the engine computed (a tool
    call re-rendered): a new engine over the same directory reuses turn 1's prompt. K/V cells alone (unified): all
    of it, the part of the entry it shares; recurrent states: to its last block boundary, where the state was saved
    too. iSWA: nothing, as the window before the prompt's end left the sliding pool while the answer went on (the
    limit of a sliding window, which the cells' own prefix cache does not have in the same process)."""
    first = token_ids(1000, 150, seed=1)
    LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_dir=tmp_path).generate([first], GREEDY, use_tqdm=False)
    second = first + token_ids(1000, 40, seed=8)
    restarted = LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_dir=tmp_path)
    again = restarted.generate([second], GREEDY, use_tqdm=False)[0]
    kind = restarted.engine.context.memory.kind
    assert again.n_cached_tokens == {"unified": len(first), "iswa": 0}.get(kind, (len(first) - 1) // BLOCK * BLOCK)
    assert again.token_ids == without_caching(model, second)


def test_the_ram_tier_gives_back_what_the_cells_let_go(model):
    llm = LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_ram="8MiB")
    first = token_ids(1000, 150, seed=1)
    answer, second = conversation(llm, first)
    for pool_cache in (llm.engine.prefix_cache, llm.engine.checkpoints):
        if pool_cache is not None:
            pool_cache.clear()  # (as if other requests had evicted them)
    again = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert again.n_cached_tokens == len(first) + len(answer) - 1
    assert again.token_ids == without_caching(model, second)
    assert llm.engine.tiers.tier("ram").stats.hits == 1


def entry_files(folder) -> list:
    return sorted(folder.rglob("*.kvprefix"))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage", "another fingerprint"])
def test_a_damaged_or_foreign_entry_is_skipped_deleted_and_logged_once(hybrid, tmp_path, damage, caplog):
    """Every entry turn 1 left (the whole sequence, and the state at its prompt's last block boundary) damaged."""
    first = token_ids(1000, 100, seed=5)
    llm = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path)
    _, second = conversation(llm, first)
    llm.engine.tiers.flush()
    paths = entry_files(tmp_path)
    assert len(paths) == 2
    for path in paths:
        path.write_bytes(damaged(path.read_bytes(), damage))
    caplog.set_level("WARNING", logger="kvlm")
    caplog.clear()
    restarted = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path)
    again = restarted.generate([second], GREEDY, use_tqdm=False)[0]
    assert again.n_cached_tokens == 0 and again.token_ids == without_caching(hybrid, second)
    assert restarted.engine.tiers.tier("disk").stats.hits == 0
    for path in paths:
        assert not path.exists()
        assert len([r for r in caplog.records if path.name in r.getMessage()]) == 1


def damaged(data: bytes, damage: str) -> bytes:
    data = bytearray(data)
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "garbage":
        data = bytearray(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0)).tolist())
    else:  # a sound entry of other settings (its header's fingerprint another)
        header, positions, parts = decode_state(bytes(data), {})
        header.pop("parts")
        data = encode_state({**header, "fingerprint": "0" * 32}, positions, parts)
    return bytes(data)


def test_each_tier_stays_within_its_bound(hybrid, tmp_path):
    """Room for about one and a half requests' entries (the whole sequence, and the state at the prompt's last
    block boundary), five requests: the least recently used go, on disk and in RAM, the last request's stay."""
    probe = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path / "probe", prefix_cache_ram="1MiB")
    probe.generate([token_ids(1000, 100, seed=20)], GREEDY, use_tqdm=False)
    ram_size, disk_size = (tier.n_bytes for tier in probe.engine.tiers.tiers)
    llm = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path / "bounded",
              prefix_cache_ram=int(1.5 * ram_size), prefix_cache_disk=int(1.5 * disk_size))
    ram, disk = llm.engine.tiers.tiers
    for seed in range(5):
        prompt = token_ids(1000, 100, seed=20 + seed)
        answer = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        llm.engine.tiers.flush()
        assert ram.n_bytes <= ram.capacity and disk.n_bytes <= disk.capacity
        assert sum(p.stat().st_size for p in entry_files(tmp_path / "bounded")) == disk.n_bytes
        for tier in (ram, disk):
            assert len(tier.entries) <= 3
            assert [list(e.tokens) for e in tier.entries.values()][-2:] == [prompt + answer[:-1], prompt[:96]]


def test_an_unwritable_directory_or_a_full_disk_leaves_no_disk_tier_and_fails_no_request(hybrid, tmp_path, caplog,
                                                                                       monkeypatch):
    prompt = token_ids(1000, 60, seed=7)
    expected = without_caching(hybrid, prompt)
    (tmp_path / "a-file").write_text("")
    caplog.set_level("WARNING", logger="kvlm")
    llm = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path / "a-file" / "tiers")
    assert llm.engine.tiers.tier("disk") is None and "no disk tier" in caplog.text
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == expected
    llm = LLM(hybrid, n_ctx=256, max_num_seqs=1, prefix_cache_dir=tmp_path / "full", prefix_cache_ram="1MiB")

    def no_space(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvlm.engine.prefix_tiers.os.replace", no_space)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == expected
    llm.engine.tiers.flush()
    assert [t.name for t in llm.engine.tiers.tiers] == ["ram"] and "No space left on device" in caplog.text
    assert len(llm.engine.tiers.tier("ram").entries) == 2  # (the whole sequence, the prompt's last boundary)
