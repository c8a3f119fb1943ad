"""HF tensor <-> megatron TP shard maps: exact round trips, the megatron QKV layout built by hand,
vocab padding, pipeline-stage coverage, and piecewise (sliced) reads."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.hf_weights import (
    ALL,
    exported_maps,
    hf_from_shards,
    hf_tensor_shapes,
    layers_of_stage,
    shard_from_hf,
    tensor_maps,
)


def make_arch(
    *,
    heads: int = 4,
    groups: int = 2,
    head_dim: int = 4,
    hidden: int = 16,
    ffn: int = 24,
    layers: int = 4,
    vocab: int = 50,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    tied: bool = False,
    score_head: bool = False,
    num_labels: int = 1,
    family: str = "llama",
) -> Architecture:
    return Architecture(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=tied and not score_head,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=None,
        score_head=score_head,
        num_labels=num_labels,
    )


ARCHS = {
    "llama-gqa-h4g2": make_arch(),
    "qwen2-bias-h8g2-tied": make_arch(heads=8, groups=2, qkv_bias=True, tied=True, family="qwen2"),
    "qwen3-qknorm-h8g4": make_arch(heads=8, groups=4, head_dim=8, qk_norm=True, family="qwen3"),
    "llama-mha-h4g4-tied": make_arch(heads=4, groups=4, tied=True),
    "critic-score-h4g2": make_arch(score_head=True, num_labels=2, qkv_bias=True),
}


class MemorySource:
    """An in-memory TensorSource that records every (name, rows, cols) read."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.reads: list[tuple[str, slice, slice]] = []

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: slice = ALL, cols: slice = ALL) -> torch.Tensor:
        self.reads.append((name, rows, cols))
        t = self.tensors[name]
        out = t[rows] if t.dim() == 1 else t[rows, cols]
        return out.clone()


def random_tensors(arch: Architecture, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in hf_tensor_shapes(arch).items()}


def padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def valid_tps(arch: Architecture) -> list[int]:
    return [
        tp
        for tp in (1, 2, 4)
        if arch.num_query_groups % tp == 0
        and arch.num_attention_heads % tp == 0
        and arch.ffn_hidden_size % tp == 0
        and arch.hidden_size % tp == 0
    ]


# ------------------------------------------------------------- shapes and layers


def test_hf_tensor_shapes_hand_derived():
    arch = make_arch(heads=4, groups=2, head_dim=4, hidden=16, ffn=24, layers=2, vocab=50, qkv_bias=True, qk_norm=True)
    shapes = hf_tensor_shapes(arch)
    expected = {"model.embed_tokens.weight": (50, 16), "model.norm.weight": (16,), "lm_head.weight": (50, 16)}
    for i in range(2):
        p = f"model.layers.{i}."
        expected.update(
            {
                p + "input_layernorm.weight": (16,),
                p + "self_attn.q_proj.weight": (16, 16),
                p + "self_attn.k_proj.weight": (8, 16),
                p + "self_attn.v_proj.weight": (8, 16),
                p + "self_attn.q_proj.bias": (16,),
                p + "self_attn.k_proj.bias": (8,),
                p + "self_attn.v_proj.bias": (8,),
                p + "self_attn.q_norm.weight": (4,),
                p + "self_attn.k_norm.weight": (4,),
                p + "self_attn.o_proj.weight": (16, 16),
                p + "post_attention_layernorm.weight": (16,),
                p + "mlp.gate_proj.weight": (24, 16),
                p + "mlp.up_proj.weight": (24, 16),
                p + "mlp.down_proj.weight": (16, 24),
            }
        )
    assert shapes == expected


def test_hf_tensor_shapes_tied_and_score_head():
    tied = hf_tensor_shapes(make_arch(tied=True))
    assert "lm_head.weight" not in tied and "score.weight" not in tied
    critic = hf_tensor_shapes(make_arch(score_head=True, num_labels=3))
    assert critic["score.weight"] == (3, 16)
    assert "lm_head.weight" not in critic


def test_head_dim_not_hidden_over_heads():
    # Qwen3-like: head_dim * heads != hidden.
    arch = make_arch(heads=4, groups=2, head_dim=8, hidden=16)
    shapes = hf_tensor_shapes(arch)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 16)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 32)


@pytest.mark.parametrize("layers,pp", [(4, 1), (4, 2), (4, 4), (6, 3), (6, 2)])
def test_layers_of_stage(layers, pp):
    arch = make_arch(layers=layers)
    per = layers // pp
    stages = [list(layers_of_stage(arch, pp, r)) for r in range(pp)]
    for r, got in enumerate(stages):
        assert got == [r * per + i for i in range(per)]
    assert sorted(itertools.chain.from_iterable(stages)) == list(range(layers))


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_maps_cover_checkpoint_exactly_once(name, pp):
    arch = ARCHS[name]
    expected = hf_tensor_shapes(arch)
    counts: Counter[str] = Counter()
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(pp):
        maps = tensor_maps(arch, pp, rank)
        mcore_names = [m.mcore for m in maps]
        assert len(set(mcore_names)) == len(mcore_names)
        # local layer numbering restarts at 0 on every stage
        local = {int(n.split(".")[2]) for n in mcore_names if n.startswith("decoder.layers.")}
        assert local == set(range(arch.num_layers // pp))
        for m in maps:
            assert len(m.hf) == len(m.hf_shapes)
            for hf_name, shape in zip(m.hf, m.hf_shapes, strict=True):
                counts[hf_name] += 1
                shapes[hf_name] = shape
        # the layer tensors on this stage are exactly its layers
        hf_layers = {int(h.split(".")[2]) for m in maps for h in m.hf if h.startswith("model.layers.")}
        assert hf_layers == set(layers_of_stage(arch, pp, rank))
    assert shapes == expected
    tied_copy = arch.tie_word_embeddings and pp > 1
    for hf_name in expected:
        want = 2 if (tied_copy and hf_name == "model.embed_tokens.weight") else 1
        assert counts[hf_name] == want, hf_name
    if tied_copy:
        last = tensor_maps(arch, pp, pp - 1)
        out = [m for m in last if m.mcore == "output_layer.weight"]
        assert len(out) == 1 and out[0].hf == ("model.embed_tokens.weight",) and out[0].kind == "vocab"
        # exported once only
        exported = Counter(h for r in range(pp) for m in exported_maps(arch, pp, r) for h in m.hf)
        assert exported == Counter({k: 1 for k in expected})


def test_first_and_last_stage_contents():
    arch = make_arch()
    first, last = tensor_maps(arch, 2, 0), tensor_maps(arch, 2, 1)
    assert first[0].mcore == "embedding.word_embeddings.weight"
    assert "decoder.final_layernorm.weight" not in {m.mcore for m in first}
    assert "output_layer.weight" not in {m.mcore for m in first}
    assert "embedding.word_embeddings.weight" not in {m.mcore for m in last}
    kinds = {m.mcore: m.kind for m in last}
    assert kinds["decoder.final_layernorm.weight"] == "replicated"
    assert kinds["output_layer.weight"] == "vocab"
    critic = {m.mcore: m.kind for m in tensor_maps(ARCHS["critic-score-h4g2"], 1, 0)}
    assert critic["output_layer.weight"] == "replicated"
    # tied, single stage: no separate output layer
    assert "output_layer.weight" not in {m.mcore for m in tensor_maps(make_arch(tied=True), 1, 0)}


# ---------------------------------------------------------------- round trip


def round_trip_cases():
    for name, arch in ARCHS.items():
        for tp in valid_tps(arch):
            for pp in (1, 2):
                yield pytest.param(name, tp, pp, id=f"{name}-tp{tp}-pp{pp}")


@pytest.mark.parametrize("name,tp,pp", list(round_trip_cases()))
def test_round_trip_bit_exact(name, tp, pp):
    arch = ARCHS[name]
    originals = random_tensors(arch, seed=tp * 10 + pp)
    source = MemorySource(originals)
    padded_vocab = padded(arch.vocab_size, 8 * tp)
    rebuilt: dict[str, torch.Tensor] = {}
    for rank in range(pp):
        for tmap in tensor_maps(arch, pp, rank):
            shards = [shard_from_hf(tmap, source, arch, tp, r, padded_vocab) for r in range(tp)]
            for name_, tensor in hf_from_shards(tmap, shards, arch).items():
                if name_ in rebuilt:  # the tied copy on the last stage must equal the first
                    assert torch.equal(rebuilt[name_], tensor)
                rebuilt[name_] = tensor
    assert set(rebuilt) == set(originals)
    for key, original in originals.items():
        assert rebuilt[key].shape == original.shape, key
        assert rebuilt[key].dtype == original.dtype, key
        assert torch.equal(rebuilt[key], original), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_low_precision(dtype):
    arch = ARCHS["qwen2-bias-h8g2-tied"]
    originals = random_tensors(arch, seed=3, dtype=dtype)
    source = MemorySource(originals)
    tp, padded_vocab = 2, padded(arch.vocab_size, 16)
    for tmap in tensor_maps(arch, 1, 0):
        shards = [shard_from_hf(tmap, source, arch, tp, r, padded_vocab) for r in range(tp)]
        assert all(s.dtype == dtype for s in shards)
        for key, t in hf_from_shards(tmap, shards, arch).items():
            assert torch.equal(t, originals[key]), key


# -------------------------------------------------------- hand-built layouts


def expected_qkv_shard(q, k, v, heads, groups, head_dim, tp, rank):
    """megatron's fused QKV rows for TP rank ``rank``: for each local query group g,
    the q rows of g's heads, then g's k rows, then g's v rows (explicit loops)."""
    heads_per_group = heads // groups
    local_groups = groups // tp
    rows = []
    for local_g in range(local_groups):
        g = rank * local_groups + local_g
        for h in range(g * heads_per_group, (g + 1) * heads_per_group):
            for d in range(head_dim):
                rows.append(q[h * head_dim + d])
        for d in range(head_dim):
            rows.append(k[g * head_dim + d])
        for d in range(head_dim):
            rows.append(v[g * head_dim + d])
    return torch.stack(rows)


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (8, 4, 4), (8, 4, 2), (4, 4, 4)])
def test_qkv_layout_by_hand(heads, groups, tp):
    head_dim, hidden = 3, 5
    arch = make_arch(heads=heads, groups=groups, head_dim=head_dim, hidden=hidden, qkv_bias=True, layers=1)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(heads * head_dim, hidden, generator=g)
    k = torch.randn(groups * head_dim, hidden, generator=g)
    v = torch.randn(groups * head_dim, hidden, generator=g)
    qb, kb, vb = q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    source = MemorySource(
        {
            names[0] + ".weight": q,
            names[1] + ".weight": k,
            names[2] + ".weight": v,
            names[0] + ".bias": qb,
            names[1] + ".bias": kb,
            names[2] + ".bias": vb,
        }
    )
    maps = {m.mcore: m for m in tensor_maps(arch, 1, 0)}
    wmap = maps["decoder.layers.0.self_attention.linear_qkv.weight"]
    bmap = maps["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert wmap.kind == bmap.kind == "qkv"
    rows_per_rank = (heads + 2 * groups) * head_dim // tp
    for rank in range(tp):
        w = shard_from_hf(wmap, source, arch, tp, rank, padded_vocab=64)
        b = shard_from_hf(bmap, source, arch, tp, rank, padded_vocab=64)
        assert w.shape == (rows_per_rank, hidden)
        assert b.shape == (rows_per_rank,)
        assert torch.equal(w, expected_qkv_shard(q, k, v, heads, groups, head_dim, tp, rank))
        assert torch.equal(b, expected_qkv_shard(qb, kb, vb, heads, groups, head_dim, tp, rank))


def test_qkv_layout_tiny_literal():
    # heads=2, groups=1, head_dim=1, hidden=1: q=[[0],[1]], k=[[10]], v=[[20]] -> [0, 1, 10, 20]
    arch = make_arch(heads=2, groups=1, head_dim=1, hidden=1, layers=1)
    p = "model.layers.0.self_attn."
    source = MemorySource(
        {
            p + "q_proj.weight": torch.tensor([[0.0], [1.0]]),
            p + "k_proj.weight": torch.tensor([[10.0]]),
            p + "v_proj.weight": torch.tensor([[20.0]]),
        }
    )
    tmap = next(m for m in tensor_maps(arch, 1, 0) if m.kind == "qkv")
    assert shard_from_hf(tmap, source, arch, 1, 0, 8).flatten().tolist() == [0.0, 1.0, 10.0, 20.0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_row_and_replicated_by_hand(tp):
    arch = ARCHS["llama-gqa-h4g2"]
    originals = random_tensors(arch, seed=11)
    source = MemorySource(originals)
    maps = {m.mcore: m for m in tensor_maps(arch, 1, 0)}
    gate, up = originals["model.layers.1.mlp.gate_proj.weight"], originals["model.layers.1.mlp.up_proj.weight"]
    down = originals["model.layers.1.mlp.down_proj.weight"]
    o = originals["model.layers.1.self_attn.o_proj.weight"]
    norm = originals["model.layers.1.input_layernorm.weight"]
    f, h = arch.ffn_hidden_size // tp, arch.hidden_size
    q_in = arch.num_attention_heads * arch.head_dim // tp
    for r in range(tp):
        fc1 = shard_from_hf(maps["decoder.layers.1.mlp.linear_fc1.weight"], source, arch, tp, r, 64)
        want = torch.stack([gate[r * f + i] for i in range(f)] + [up[r * f + i] for i in range(f)])
        assert torch.equal(fc1, want)
        fc2 = shard_from_hf(maps["decoder.layers.1.mlp.linear_fc2.weight"], source, arch, tp, r, 64)
        assert fc2.shape == (h, f)
        assert torch.equal(fc2, torch.stack([down[:, r * f + i] for i in range(f)], dim=1))
        proj = shard_from_hf(maps["decoder.layers.1.self_attention.linear_proj.weight"], source, arch, tp, r, 64)
        assert torch.equal(proj, torch.stack([o[:, r * q_in + i] for i in range(q_in)], dim=1))
        ln = shard_from_hf(maps["decoder.layers.1.input_layernorm.weight"], source, arch, tp, r, 64)
        assert torch.equal(ln, norm)


@pytest.mark.parametrize("tp,padded_vocab", [(1, 50), (1, 64), (2, 64), (4, 64), (4, 128), (2, 52)])
def test_vocab_padding(tp, padded_vocab):
    arch = ARCHS["llama-gqa-h4g2"]  # vocab 50
    originals = random_tensors(arch, seed=5)
    source = MemorySource(originals)
    for mcore, hf_name in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ):
        tmap = next(m for m in tensor_maps(arch, 1, 0) if m.mcore == mcore)
        assert tmap.kind == "vocab"
        full = originals[hf_name]
        per = padded_vocab // tp
        shards = [shard_from_hf(tmap, source, arch, tp, r, padded_vocab) for r in range(tp)]
        for r, shard in enumerate(shards):
            assert shard.shape == (per, arch.hidden_size)
            for i in range(per):
                row = r * per + i
                if row < arch.vocab_size:
                    assert torch.equal(shard[i], full[row])
                else:
                    assert torch.count_nonzero(shard[i]) == 0
        assert torch.equal(hf_from_shards(tmap, shards, arch)[hf_name], full)


def test_score_head_replicated_on_every_rank():
    arch = ARCHS["critic-score-h4g2"]
    originals = random_tensors(arch, seed=9)
    source = MemorySource(originals)
    tmap = next(m for m in tensor_maps(arch, 1, 0) if m.mcore == "output_layer.weight")
    for r in range(2):
        assert torch.equal(shard_from_hf(tmap, source, arch, 2, r, 64), originals["score.weight"])


# ---------------------------------------------------------------- sliced reads


def _covers_all(s: slice, n: int) -> bool:
    return range(n)[s] == range(n)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_split_tensors_are_read_in_slices(tp):
    arch = ARCHS["qwen3-qknorm-h8g4"]
    originals = random_tensors(arch, seed=1)
    padded_vocab = padded(arch.vocab_size, 8 * tp)
    for tmap in tensor_maps(arch, 1, 0):
        for r in range(tp):
            source = MemorySource(originals)
            shard_from_hf(tmap, source, arch, tp, r, padded_vocab)
            assert source.reads, tmap.mcore
            for hf_name, rows, cols in source.reads:
                assert hf_name in tmap.hf
                shape = originals[hf_name].shape
                n_rows = len(range(shape[0])[rows])
                n_cols = 1 if len(shape) == 1 else len(range(shape[1])[cols])
                if tmap.kind == "replicated":
                    continue
                # no TP-split tensor is ever read whole
                assert not (_covers_all(rows, shape[0]) and (len(shape) == 1 or _covers_all(cols, shape[1]))), (
                    tmap.mcore,
                    hf_name,
                    rows,
                    cols,
                )
                total = shape[0] * (1 if len(shape) == 1 else shape[1])
                read = n_rows * n_cols
                if tmap.kind == "vocab":
                    assert read <= shape[1] * (padded_vocab // tp)
                else:
                    assert read * tp == total, (tmap.mcore, hf_name)


def test_tp1_reads_each_tensor_once():
    arch = ARCHS["llama-gqa-h4g2"]
    originals = random_tensors(arch, seed=2)
    source = MemorySource(originals)
    for tmap in tensor_maps(arch, 1, 0):
        shard_from_hf(tmap, source, arch, 1, 0, arch.vocab_size)
    assert Counter(name for name, _, _ in source.reads) == Counter({k: 1 for k in originals})
