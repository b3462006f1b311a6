"""A model cut into tensor-parallel shares computes the whole model's logits.

The ranks run here as threads of one process, their collectives a barrier (``ThreadRanks``):
the shares, hooks and configs are the ones the rank processes use (their gloo group is
tested in tests/engine/test_tp_engine.py)."""

import json
import threading

import pytest
import torch

from slipstream.worker.distributed.sharding import check_shardable, shard_model, shard_of
from slipstream.worker.layers.preparation import prepare_cpu_model
from slipstream.worker.model import loader
from support import tiny_model_dir

CPU = torch.device("cpu")


class ThreadRanks:
    """``world`` ranks as threads: each collective waits for every rank's tensor."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world

    def rank(self, rank: int) -> "ThreadRank":
        return ThreadRank(self, rank)


class ThreadRank:
    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self.ranks, self.rank, self.world = ranks, rank, ranks.world

    def _exchange(self, tensor):
        self.ranks.slots[self.rank] = tensor
        self.ranks.barrier.wait()
        everyone = list(self.ranks.slots)
        self.ranks.barrier.wait()
        return everyone

    def all_reduce(self, tensor):
        parts = self._exchange(tensor.float())
        return torch.stack(parts).sum(0)

    def gather_to_first(self, tensor):
        parts = self._exchange(tensor)
        return parts if self.rank == 0 else None


def sharded_logits(path, world, ids, lean=True, weights=None):
    """Rank 0's logits of ``world`` shares of the model at ``path`` (each prepared in
    ``weights`` when given), and the shares."""
    ranks, logits, errors = ThreadRanks(world), [None] * world, []
    # loaded one by one: transformers' loading is not thread-safe
    models = [loader.load_model(path, torch.float32, CPU, lean=lean) for _ in range(world)]

    def run(rank):
        try:
            model = models[rank]
            shard_model(model, ranks.rank(rank))
            if weights is not None:
                prepare_cpu_model(model, weights, "auto")
            with torch.no_grad():
                logits[rank] = model(input_ids=ids, use_cache=False).logits
        except Exception as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return logits[0], models


def whole_logits(path, ids, lean=True, weights=None):
    model = loader.load_model(path, torch.float32, CPU, lean=lean)
    if weights is not None:
        prepare_cpu_model(model, weights, "auto")
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(0, 49152, (1, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lean", [True, False], ids=["model-llama", "transformers"])
def test_shares_compute_the_whole_models_logits(arch, world, lean):
    """llama: 4 heads in 2 KV groups (3 ranks: uneven; 4: KV heads replicated); mistral: one
    KV head for all ranks; qwen2: q/k/v biases."""
    path = tiny_model_dir(arch)
    got, _ = sharded_logits(path, world, IDS, lean)
    want = whole_logits(path, IDS, lean)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_each_share_holds_its_heads_and_says_so_in_its_config():
    _, models = sharded_logits(tiny_model_dir("llama"), 2, IDS)
    for rank, model in enumerate(models):
        shard = shard_of(model)
        assert shard is not None and shard.rank == rank and shard.vocab_size == 49152
        assert model.config.num_attention_heads == 2 and model.config.num_key_value_heads == 1
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.weight.shape == (2 * 16, 64) and attn.o_proj.weight.shape == (64, 32)
        assert model.lm_head.weight.shape == (24576, 64)


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory):
    """A tied-embedding Llama whose vocabulary (1001) divides over neither 2 nor 3 ranks,
    its padding token the last id."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("odd-vocab")
    config = LlamaConfig(
        vocab_size=1001,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=1000,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_a_vocabulary_that_does_not_divide_is_padded_and_cut_back(odd_vocab_model, world):
    ids = torch.tensor([[0, 5, 999, 1000, 500, 333]])
    got, models = sharded_logits(odd_vocab_model, world, ids, lean=False)
    assert got.shape[-1] == 1001
    want = whole_logits(odd_vocab_model, ids, lean=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    last = models[-1]
    assert last.lm_head.weight is last.model.embed_tokens.weight  # still one table
    # the padding token is the last rank's, at its local row
    assert last.model.embed_tokens.padding_idx == 1000 - shard_of(last).vocab.rows.start
    assert models[0].model.embed_tokens.padding_idx is None


@pytest.mark.parametrize("weights, atol", [("float32", 1e-5), ("bfloat16", 0.05), ("int8", 0.1)])
def test_every_cpu_format_runs_on_the_shares(weights, atol):
    """Prepared after the cut: the packed bf16 / int8 products run on the rank's shapes (int8
    finds its outlier channels on a calibration forward whose collectives every rank runs)."""
    path = tiny_model_dir("llama")
    got, _ = sharded_logits(path, 2, IDS, weights=weights)
    want = whole_logits(path, IDS, weights=weights)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_an_architecture_that_is_not_split_is_refused_by_name():
    model = loader.load_model(tiny_model_dir("gpt2"), torch.float32, CPU)
    with pytest.raises(ValueError, match="a 'gpt2' model cannot be split over ranks"):
        check_shardable(model, 2)


def test_more_ranks_than_the_heads_allow_are_refused(tmp_path):
    path = tiny_model_dir("mistral")  # 4 query heads, one KV head
    model = loader.load_model(path, torch.float32, CPU, lean=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=8: 8 ranks would share KV head 0"):
        check_shardable(model, 8)
    assert json.loads((path / "config.json").read_text())["num_key_value_heads"] == 1
