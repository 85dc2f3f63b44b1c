"Token-budget batching: budget and cap respected, every sample once, deterministic, balanced splits, stats."
import os, warnings
import numpy as np
import pytest
from dflash.batching import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_TOKEN_BUDGET, batch_stats, load_ratio, padded_tokens,
                             plot_batch_sizes, shuffle_batches, split_batches, token_budget_batches, worker_loads)

BUDGETS = [64, 512, 2048, 8192, 65536]

def random_lengths(seed, n=3000):
    "Realistic chat lengths: log-normal around a few hundred tokens, a long tail, a few very short."
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 0.9, n), 1, 20000).astype(int)

def check_batches(bs, lengths, budget, cap=None):
    flat = [i for b in bs for i in b]
    assert sorted(flat) == list(range(len(lengths))), 'every sample exactly once'
    assert all(len(b) >= 1 for b in bs)
    for b in bs:
        assert padded_tokens(b, lengths) <= budget or (len(b) == 1 and lengths[b[0]] > budget), (b, budget)
        if cap: assert len(b) <= cap
    # batches in ascending length: a batch's longest sample is no longer than the next batch's shortest
    for a, b in zip(bs, bs[1:]): assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)

@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('budget', BUDGETS)
@pytest.mark.parametrize('cap', [None, 1, 7, 256])
def test_random_lengths_properties(seed, budget, cap):
    lengths = random_lengths(seed)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        bs = token_budget_batches(lengths, budget, cap)
        again = token_budget_batches(list(lengths), budget, cap)
    assert again == bs, 'deterministic, list or array'
    check_batches(bs, lengths, budget, cap)
    over = np.flatnonzero(lengths > budget)
    assert len(w) == 2 * len(over), 'one warning per over-budget sample'
    assert sorted(b[0] for b in bs if lengths[b[0]] > budget) == over.tolist()
    assert all(len(b) == 1 for b in bs if lengths[b[0]] > budget)

def test_greedy_fills_batches():
    "A batch is closed only when the next sample would pass the budget or the cap."
    lengths = random_lengths(3)
    for budget, cap in [(2048, None), (8192, 16)]:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            bs = token_budget_batches(lengths, budget, cap)
        for a, b in zip(bs, bs[1:]):
            if lengths[b[0]] > budget: continue
            assert (len(a) + 1) * lengths[b[0]] > budget or len(a) == cap

def test_ties_broken_by_index():
    assert token_budget_batches([2, 2, 2, 2, 2], 4) == [[0, 1], [2, 3], [4]]
    assert token_budget_batches([3, 1, 3, 1], 100) == [[1, 3, 0, 2]]
    assert token_budget_batches([2] * 6, 10) == [[0, 1, 2, 3, 4], [5]], 'a batch may fill the budget exactly'

def test_over_budget_sample_gets_own_batch_with_warning():
    with pytest.warns(UserWarning, match='sample 2 has 50 tokens') as rec:
        bs = token_budget_batches([3, 4, 50, 2], 10)
    assert len(rec) == 1 and '50' in str(rec[0].message)
    assert bs == [[3, 0], [1], [2]]

def test_max_batch_size():
    assert token_budget_batches([1] * 10, 1000, max_batch_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert token_budget_batches([1] * 10, 1000) == [list(range(10))]

def test_bad_inputs_name_the_row():
    with pytest.raises(ValueError, match='sample 1 has length 0'): token_budget_batches([3, 0], 10)
    with pytest.raises(ValueError, match='sample 0 has length -2'): token_budget_batches([-2], 10)
    with pytest.raises(ValueError, match='token_budget'): token_budget_batches([3], 0)
    with pytest.raises(ValueError, match='max_batch_size'): token_budget_batches([3], 10, 0)
    assert token_budget_batches([], 10) == []

def test_shuffle_per_seed_and_epoch():
    bs = token_budget_batches(random_lengths(0), 8192)
    a = shuffle_batches(bs, seed=5, epoch=2)
    assert a == shuffle_batches(bs, 5, 2) and a is not bs and sorted(a) == sorted(bs)
    orders = [shuffle_batches(bs, 5, e) for e in range(6)]
    assert len({str(o) for o in orders}) == 6, 'epochs give different orders'
    assert shuffle_batches(bs, 6, 2) != a
    a[0].append(-1); assert -1 not in sum(bs, []), 'a new list; the input is not touched'

@pytest.mark.parametrize('world_size', [1, 2, 3, 8])
@pytest.mark.parametrize('seed', [0, 1])
def test_split_covers_and_balances(world_size, seed):
    lengths = random_lengths(seed, 20000)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        bs = token_budget_batches(lengths, 8192, 256)
    parts = split_batches(bs, lengths, world_size)
    assert len(parts) == world_size
    pos = {id(b): j for j, b in enumerate(bs)}
    got = [pos[id(b)] for p in parts for b in p]
    assert sorted(got) == list(range(len(bs))), 'every batch exactly once'
    assert all([pos[id(b)] for b in p] == sorted(pos[id(b)] for b in p) for p in parts), 'stable order'
    loads = worker_loads(parts, lengths)
    assert sum(loads) == batch_stats(bs, lengths)['padded_tokens']
    assert max(loads) - min(loads) <= max(padded_tokens(b, lengths) for b in bs), 'greedy bound'
    assert load_ratio(parts, lengths) < 1.03, loads
    assert split_batches(bs, lengths, world_size) == parts, 'deterministic'

def test_split_hand_example_and_edges():
    lens = [9, 8, 7, 6, 2]
    bs = [[i] for i in range(5)]
    parts = split_batches(bs, lens, 2)
    assert parts == [[[0], [3], [4]], [[1], [2]]] and worker_loads(parts, lens) == [17, 15]
    assert load_ratio(parts, lens) == 17 / 15
    few = split_batches(bs[:2], lens, 4)
    assert few == [[[0]], [[1]], [], []] and load_ratio(few, lens) == float('inf')
    with pytest.raises(ValueError, match='world_size'): split_batches(bs, lens, 0)

def test_stats_by_hand():
    # [1,3]: lengths 1,1 -> 2 real, 2 padded; [0,2]: 5,2 -> 7 real, 10 padded; [4]: 3 -> 3 real, 3 padded
    s = batch_stats([[1, 3], [0, 2], [4]], np.array([5, 1, 2, 1, 3]))
    assert s == dict(num_batches=3, batch_size_min=1, batch_size_mean=pytest.approx(5 / 3), batch_size_max=2,
                     real_tokens=12, padded_tokens=15, padding_efficiency=pytest.approx(0.8))
    assert all(type(s[k]) is int for k in ['num_batches', 'batch_size_min', 'batch_size_max', 'real_tokens', 'padded_tokens'])
    assert type(s['padding_efficiency']) is float and type(s['batch_size_mean']) is float
    assert batch_stats([], []) == dict(num_batches=0, batch_size_min=0, batch_size_mean=0.0, batch_size_max=0,
                                       real_tokens=0, padded_tokens=0, padding_efficiency=1.0)

def test_plot_batch_sizes(tmp_path):
    from matplotlib.figure import Figure
    bs = token_budget_batches(np.minimum(random_lengths(0), 8192), 8192, 256)
    fig = plot_batch_sizes(bs, title='t')
    assert isinstance(fig, Figure) and fig.axes[0].get_title() == 't'
    assert sum(p.get_height() for p in fig.axes[0].patches) == len(bs), 'one count per batch'
    fig.savefig(tmp_path / 'h.png'); assert (tmp_path / 'h.png').stat().st_size > 1000

@pytest.fixture(scope='module')
def real_lengths():
    os.environ['HF_HUB_OFFLINE'] = '1'
    from transformers import AutoTokenizer
    from dflash.tiny_target import TARGET_DIR, corpus_texts
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    return np.array([len(tok(t)['input_ids']) for t in corpus_texts('train')])

def test_default_budget_efficiency_on_sample_data(real_lengths):
    bs = token_budget_batches(real_lengths, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE)
    check_batches(bs, real_lengths, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE)
    s = batch_stats(bs, real_lengths)
    assert s['padding_efficiency'] >= 0.97, s
    assert s['real_tokens'] == int(real_lengths.sum())
