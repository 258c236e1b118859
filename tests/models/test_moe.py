"""Every mixture-of-experts family kvlm reads, against transformers, from a Hugging Face folder and from a GGUF
file written as llama.cpp's converter writes it (moe_factory): tiny random models that transformers makes.

Routing decides which weights a token meets, so a routing variant read wrongly (renormalised or not, the number of
experts, the shared expert's gate, Granite's multipliers) moves logits far past the tolerance: each is broken on
purpose below and must fail."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType

from helpers.models import (
    ModelZoo, assert_greedy_generate_equals_transformers, decode_ok, full_sequence_logits, max_diff,
    prefill_then_decode_logits, reference_logits, token_ids,
)
from helpers.moe_factory import SPECS, random_moe, save_moe_folder, write_moe_gguf
from kvlm import Batch, Context, load_model
from kvlm.kernels import native_kernels
from kvlm.model.moe import BlockExperts, DenseExperts

TOLERANCE = 1e-4
N_GREEDY = 12
SOURCES = ("hf", "gguf")

pytestmark = pytest.mark.usefixtures("one_thread")


def save(model, name: str, source: str, folder, quant=GGMLQuantizationType.F32):
    """The saved folder, or a GGUF file converted from it."""
    hf = save_moe_folder(model, folder / "hf")
    return hf if source == "hf" else write_moe_gguf(model, SPECS[name], hf, folder / "model.gguf", quant)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory, lambda name: random_moe(SPECS[name]), save)


@pytest.fixture(scope="module", params=list(SPECS))
def name(request) -> str:
    return request.param


@pytest.fixture(params=SOURCES)
def source(request) -> str:
    return request.param


def test_experts_are_read_alike_from_both_sources(zoo, name, reference):
    hf = reference.config
    configs = [zoo.ours(name, source).config for source in SOURCES]
    n_expert = getattr(hf, "num_experts", None) or hf.num_local_experts
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    for c in configs:
        assert (c.architecture, c.n_expert, c.n_expert_used) == (SPECS[name].arch, n_expert, hf.num_experts_per_tok)
        assert c.n_ff_exp == (getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
        assert c.moe_layers == tuple(i not in dense for i in range(hf.num_hidden_layers))
        assert c.expert_weights_norm == getattr(hf, "norm_topk_prob", True)
    assert as_float32(configs[0]) == as_float32(configs[1])


def as_float32(config):
    """The config with its scalars rounded to float32, as GGUF stores them, and without its name."""
    scalars = {f: torch.tensor(getattr(config, f), dtype=torch.float32).item() for f in
               ("rms_norm_eps", "query_scale", "embedding_multiplier", "residual_multiplier", "logit_scale")}
    return replace(config, name="", **scalars)


def test_logits_match_transformers(ours, reference):
    ids = token_ids(ours.config.vocab_size, 48, seed=3)
    expected = reference_logits(reference, ids)
    assert max_diff(full_sequence_logits(ours, ids), expected) <= TOLERANCE
    assert max_diff(prefill_then_decode_logits(ours, ids, 36), expected[35:]) <= TOLERANCE


def test_greedy_llm_generate_equals_transformers_generate(zoo, name, source, reference):
    prompts = [token_ids(reference.config.vocab_size, n, seed=n + 1) for n in (5, 40, 17)]
    assert_greedy_generate_equals_transformers(zoo.path(name, source), reference, prompts, N_GREEDY, n_ctx=128)


def new_context(model, **kwargs) -> Context:
    return Context(model, **{"n_ctx": 128, "n_batch": 128, "n_ubatch": 16, "n_seq_max": 4, **kwargs})


def test_context_shift_and_rollback(zoo, name):
    """Three sequences in micro-batches of 16; one shifted by seq_add, one rolled back by seq_rm and continued
    otherwise: each equals a context that computed only what it kept."""
    model = zoo.ours(name, "gguf")
    prompts = [token_ids(model.config.vocab_size, n, seed=50 + n) for n in (30, 9, 21)]
    ctx = new_context(model)
    decode_ok(ctx, Batch(tokens=[t for p in prompts for t in p], seq_ids=[s for s, p in enumerate(prompts) for _ in p],
                         logits=[True] * sum(map(len, prompts))))
    ctx.memory.seq_add(0, -1, -1, 6)  # sequence 0 now at positions 6..35
    decode_ok(ctx, Batch.for_sequence([7, 8, 9], seq_id=1))
    ctx.memory.seq_rm(1, len(prompts[1]), -1)  # rolled back to its prompt
    decode_ok(ctx, Batch(tokens=[42, 43], seq_ids=[0, 1], logits=[True, True]))
    shifted, rolled = ctx.get_logits_ith(0).clone(), ctx.get_logits_ith(1).clone()
    fresh = new_context(model)
    decode_ok(fresh, Batch.for_sequence(prompts[0] + [42], start_pos=6))
    assert max_diff(shifted, fresh.get_logits_ith(-1)) <= TOLERANCE
    fresh = new_context(model)
    decode_ok(fresh, Batch.for_sequence(prompts[1] + [43]))
    assert max_diff(rolled, fresh.get_logits_ith(-1)) <= TOLERANCE


@pytest.mark.parametrize("quant", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("name, layout", [("mixtral", "per-expert"), ("qwen3moe", "fused")])
def test_experts_stored_per_expert_or_fused_read_as_stacked(zoo, tmp_path, name, layout, quant):
    """Older Mixtral files (a tensor per expert) and fused gate/up tensors give the stacked file's weights and
    logits."""
    reference = zoo.reference(name)
    hf = save_moe_folder(reference, tmp_path / "hf")
    stacked = load_model(str(write_moe_gguf(reference, SPECS[name], hf, tmp_path / "a.gguf", quant)), "float32",
                         progress=False)
    other = load_model(str(write_moe_gguf(reference, SPECS[name], hf, tmp_path / "b.gguf", quant, layout)), "float32",
                       progress=False)
    ids = token_ids(stacked.config.vocab_size, 20, seed=4)
    assert torch.equal(full_sequence_logits(other, ids), full_sequence_logits(stacked, ids))
    if quant == GGMLQuantizationType.F32:
        assert max_diff(full_sequence_logits(other, ids), reference_logits(reference, ids)) <= TOLERANCE


# --- each routing variant broken on purpose ---

def _moe_layers(model):
    return [layer.moe for layer in model.decoder.layers if layer.moe is not None]


BREAKAGES = {
    "renormalisation flipped": ("qwen3moe", lambda m: [setattr(moe, "normalize", not moe.normalize) for moe in _moe_layers(m)]),
    "one expert fewer": ("olmoe", lambda m: [setattr(moe, "n_used", moe.n_used - 1) for moe in _moe_layers(m)]),
    "shared expert ungated": ("qwen2moe", lambda m: [setattr(moe, "shared_gate", None) for moe in _moe_layers(m)]),
    "shared expert dropped": ("granitemoeshared",
                              lambda m: [setattr(moe, "shared_gate_up", None) for moe in _moe_layers(m)]),
    "no residual multiplier": ("granitemoe", lambda m: setattr(m.decoder, "config",
                                                               replace(m.decoder.config, residual_multiplier=1.0))),
    "router's experts in reverse": ("mixtral", lambda m: [setattr(moe, "router", lambda x, r=moe.router: r(x).flip(-1))
                                                          for moe in _moe_layers(m)]),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_routing_variant_broken_on_purpose_fails(zoo, breakage):
    name, damage = BREAKAGES[breakage]
    model = load_model(str(zoo.path(name, "hf")), "float32", progress=False)
    ids = token_ids(model.config.vocab_size, 24, seed=9)
    assert max_diff(full_sequence_logits(model, ids), reference_logits(zoo.reference(name), ids)) <= TOLERANCE
    damage(model)
    assert max_diff(full_sequence_logits(model, ids), reference_logits(zoo.reference(name), ids)) > 100 * TOLERANCE


# --- the default (fast) setting: experts in their file's blocks, one native call per layer ---

@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "granitemoeshared"])
def test_quantized_experts_run_natively_close_to_the_dense_reference(zoo, name):
    """A Q8_0 file in the default setting against the float32 reference on the same file's values: 8-bit
    activations (as llama.cpp's) move a typical token's logits by a few percent of their scale, and now and then
    a token's router then picks another expert (as in llama.cpp), which moves that token's more; experts read
    wrongly would move every token's by their whole size."""
    path = zoo.path(name, "gguf", GGMLQuantizationType.Q8_0)
    fast, exact = load_model(str(path), progress=False), load_model(str(path), "float32", progress=False)
    kinds = {type(moe.experts) for moe in _moe_layers(fast)}
    assert kinds == ({BlockExperts} if native_kernels() is not None else {DenseExperts})
    ids = token_ids(fast.config.vocab_size, 40, seed=11)
    approximate, expected = full_sequence_logits(fast, ids), full_sequence_logits(exact, ids)
    per_token = (approximate - expected).abs().amax(dim=-1)
    assert per_token.median().item() <= 0.1 * expected.abs().max().item()
    assert (approximate.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


def test_default_setting_rows_do_not_depend_on_their_batch(zoo):
    """Three sequences decoded together give each the same logits, bit for bit, as decoded alone (the experts call
    never mixes rows; where the native kernels are not built, the batch-invariant float32 mode)."""
    path = zoo.path("qwen3moe", "gguf", GGMLQuantizationType.Q8_0)
    model = load_model(str(path), progress=False) if native_kernels() is not None else \
        load_model(str(path), "float32", batch_invariant=True, progress=False)
    prompts = [token_ids(model.config.vocab_size, n, seed=n) for n in (6, 11, 3)]
    alone = []
    for ids in prompts:
        ctx = new_context(model)
        decode_ok(ctx, Batch.for_sequence(ids))
        decode_ok(ctx, Batch.for_sequence([5]))
        alone.append(ctx.get_logits_ith(-1).clone())
    ctx = new_context(model)
    for s, ids in enumerate(prompts):
        decode_ok(ctx, Batch.for_sequence(ids, seq_id=s))
    decode_ok(ctx, Batch(tokens=[5, 5, 5], seq_ids=[0, 1, 2], logits=[True] * 3))
    for s in range(3):
        assert torch.equal(ctx.get_logits_ith(s), alone[s]), s


# --- what kvlm does not implement is refused before any weight is read ---

def test_other_mixtures_of_experts_are_refused_by_name(tmp_path):
    """DeepSeek (MLA), ERNIE, AFMoE and Phi-MoE folders: the architecture named, and what is supported."""
    import json

    from kvlm.core.errors import UnsupportedModelError
    from kvlm.loader.hf_folder import config_from_hf

    for architecture, model_type in [("DeepseekV2ForCausalLM", "deepseek_v2"), ("Ernie4_5_MoeForCausalLM",
                                     "ernie4_5_moe"), ("AfmoeForCausalLM", "afmoe"), ("PhimoeForCausalLM", "phimoe")]:
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type}))
        with pytest.raises(UnsupportedModelError, match=f"architecture '{architecture}'.*qwen3_moe"):
            config_from_hf(folder)  # the config alone: no weight is read


@pytest.mark.parametrize("key, value", [("expert_gating_func", 2), ("expert_weights_scale", 2.5),
                                        ("expert_group_count", 8)])
def test_routing_a_file_asks_for_and_kvlm_lacks_is_refused(zoo, tmp_path, key, value):
    """Sigmoid gating, scaled expert weights, group-limited routing: refused with the key and value named."""
    from helpers.gguf_factory import write_gguf
    from kvlm.core.errors import UnsupportedModelError
    from helpers.moe_factory import moe_gguf_metadata, moe_gguf_tensors

    reference, spec = zoo.reference("qwen3moe"), SPECS["qwen3moe"]
    hf = save_moe_folder(reference, tmp_path / "hf")
    metadata = {**moe_gguf_metadata(spec, reference.config), f"qwen3moe.{key}": value}
    path = write_gguf(tmp_path / "m.gguf", metadata, moe_gguf_tensors(hf, spec, reference.config), arch="qwen3moe")
    with pytest.raises(UnsupportedModelError, match=f"qwen3moe.{key}={value}"):
        load_model(str(path), progress=False)


# --- what a user is told before loading ---

def test_inspect_shows_the_experts_and_the_share_of_the_file_a_token_reads(zoo, capsys):
    """Qwen3-MoE with a plain MLP in layer 1, Q8_0: experts per layer, used, width, weighting, the dense layer; the
    bytes a token reads are every tensor's but the embedding's, and 2 of 6 experts' of each layer of experts."""
    import kvlm.cli.commands
    from kvlm.loader.gguf_reader import GGUFFile

    path = zoo.path("qwen3moe-dense-layer", "gguf", GGMLQuantizationType.Q8_0)
    assert kvlm.cli.commands.main(["inspect", str(path), "--ctx", "128"]) == 0
    rows = {line[:20].strip(): line[20:].strip() for line in capsys.readouterr().out.splitlines()}
    assert rows["experts"] == ("6 per layer, 2 used per token, each 32 wide; weights as routed (not renormalised); "
                               "1 layer with a plain MLP")
    tensors = GGUFFile(path).tensors
    total = sum(t.nbytes for t in tensors.values())
    experts = sum(t.nbytes for name, t in tensors.items() if name.endswith("_exps.weight"))
    active = total - tensors["token_embd.weight"].nbytes - experts + experts * 2 // 6
    assert rows["bytes per token"].startswith(f"{active} (") and f"active of {total} (" in rows["bytes per token"]


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_memory_plan_counts_experts_as_they_are_held(zoo, dtype):
    """In their blocks (the default) or dense (float32): the plan's weights are what the decoder then holds."""
    model = load_model(str(zoo.path("qwen2moe", "gguf", GGMLQuantizationType.Q8_0)), dtype, progress=False)
    assert model.plan.weights == pytest.approx(model.decoder.nbytes, rel=0.01)
