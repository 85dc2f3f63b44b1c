"""DDTree verification in the decoding loop (`spec_decode(tree_budget=N)`): greedy outputs equal the target's at every budget on
standard and hybrid targets, the cache and the drafter's context after a tree step are exact, sampled outputs are distributed as
the target's own (and a wrong walk is caught), and evaluate, the job and the CLI take a tree budget."""
import ast, inspect, json
import pytest, torch
from transformers import DynamicCache
from dflash.core import TINY_TARGET, HELDOUT_DATA
from dflash.taps import capture, load_target, load_tokenizer
from dflash.model import DFlashDraftModel, drafter_config
from dflash.dflash2 import DFlash2DraftModel
from dflash.sampling import Sampling
from dflash.tree import build_tree, follow, grow_tree, leaf_paths
import dflash.evaluate as E
from dflash.evaluate import (DFlashDrafter, evaluate, evaluate_many, evaluate_cli, greedy_decode, greedy_reference, load_prompts,
                             sample_decode, spec_decode, EvalConfig)
from dflash.verify import tree_verify_cost, verify_tree
from test_evaluate import ALPHA, N, NEW, PROMPT, WARP, WIDE, Oracle, chi2_pvalue, continuations, fresh, small, wide   # noqa: F401 (small: a fixture)


@pytest.fixture(scope='module')
def prompts(tok): return load_prompts(tok, n=2)

@pytest.fixture(scope='module')
def targets(make_target):
    "Random-weight targets of real architectures: two attention-only (Qwen3, Llama) and the Qwen3.5 hybrid."
    return dict(qwen3=make_target('qwen3', seed=0, tie_word_embeddings=True, **WIDE), llama=make_target('llama', layers=3, **WIDE),
                hybrid=make_target('qwen3_5', seed=0, **WIDE))

@pytest.fixture(scope='module')
def embedded():
    "The embedded (trained) Qwen3.5 hybrid target."
    return load_target(TINY_TARGET)


class TreeOracle(Oracle):
    "Trees around the target's greedy answer: slot logits `scale` x (noise + `bump` on the true token), often but not always first."
    def __init__(self, prompt, answer, vocab, bump=3.5, scale=3.0, seed=0):
        super().__init__(prompt, answer, vocab=vocab); self.bump, self.scale, self.seed = bump, scale, seed
    def reset(self): self.g = torch.Generator().manual_seed(self.seed)
    def propose_tree(self, tokens, taps, budget, depth, warp=None):
        truth = torch.tensor(self.seq[len(tokens):len(tokens) + depth], dtype=torch.long)
        x = torch.randn(len(truth), self.vocab, generator=self.g)
        x[torch.arange(len(truth)), truth] += self.bump
        return build_tree(self.scale * x, budget)


class Knowing(DFlashDrafter):
    "A real DFlash drafter, its context fed step by step as in decoding, whose trees come from `oracle` (so paths are accepted)."
    def __init__(self, model, oracle): super().__init__(model); self.oracle = oracle
    def reset(self): super().reset(); self.oracle.reset()
    def propose_tree(self, tokens, taps, budget, depth, warp=None):
        super().propose_tree(tokens, taps, budget, depth, warp)
        return self.oracle.propose_tree(tokens, taps, budget, depth, warp)


# --- greedy: the target's output, token for token

@pytest.mark.parametrize('kind', ['qwen3', 'llama', 'hybrid'])
def test_greedy_tree_decoding_is_the_targets_output(targets, prompts, tok, kind):
    "At budgets 1, 4, 16, 64 the output is the target's greedy output; steps report (accepted, nodes); larger trees accept more."
    m, p = targets[kind], prompts[0]
    ref = greedy_decode(m, p, 32)
    taus = {}
    for budget in (1, 4, 16, 64):
        got, steps = spec_decode(m, TreeOracle(p, ref, len(tok)), p, 32, block_size=16, tree_budget=budget)
        assert got == ref, (kind, budget)
        assert all(a <= min(d, 15) and d <= budget for a, d in steps) and 1 + sum(a + 1 for a, _ in steps) == 32
        taus[budget] = 1 + sum(a for a, _ in steps) / len(steps)
    assert taus[64] > taus[4] > taus[1], taus


def test_greedy_tree_decoding_on_the_embedded_target(embedded, prompts, tok):
    "The trained Qwen3.5 hybrid, EOS included: the oracle's trees at budgets 1, 4, 16, 64, an untrained DFlash drafter's at 16."
    ref = greedy_reference(embedded, prompts[:1], 24)
    for budget in (1, 4, 16, 64):
        got, steps = spec_decode(embedded, TreeOracle(prompts[0], ref['outputs'][0], len(tok)), prompts[0], 24, tok.eos_token_id, 8,
                                 tree_budget=budget)
        assert got == ref['outputs'][0] and all(d <= budget for _, d in steps)
    r = evaluate(embedded, fresh(embedded, tok, num_hidden_layers=1, block_size=8), prompts[:1], 24, reference=ref, strict=True,
                 warmup=False, tree_budget=16)
    assert r['lossless'] and r['tree_budget'] == 16 and r['drafted_per_step'] <= 16


@pytest.mark.parametrize('kind', ['qwen3', 'hybrid'])
def test_real_drafters_grow_their_own_trees(targets, prompts, tok, kind):
    "DFlash (build_tree of its slots) and DFlash2 (each node's children from its selector) decode the target's output through the same loop."
    m = targets[kind]
    d1 = wide(fresh(m, tok, num_hidden_layers=1, block_size=4), seed=4)
    d2 = wide(DFlash2DraftModel.from_dflash(d1, selector_rank=8, selector_top_k=8), seed=14, selector_only=True)
    ref = greedy_reference(m, prompts, 20)
    for d in (d1, d2):
        for budget in (1, 16):
            assert evaluate(m, d, prompts, 20, reference=ref, strict=True, warmup=False, tree_budget=budget)['lossless']


def test_a_chain_verified_as_a_tree_is_the_chain(targets, prompts, tok):
    "A drafter without propose_tree (the oracle) has its chain verified as a one-path tree: the chain's steps exactly; n-gram too."
    for kind in ('qwen3', 'hybrid'):
        m, p = targets[kind], prompts[1]
        ref = greedy_decode(m, p, 30)
        for B in (4, 16):
            chain = spec_decode(m, Oracle(p, ref), p, 30, block_size=B)
            assert spec_decode(m, Oracle(p, ref), p, 30, block_size=B, tree_budget=B) == chain and chain[0] == ref
        wrong = Oracle(p, ref, wrong=True, vocab=len(tok))
        assert spec_decode(m, wrong, p, 30, tree_budget=4) == (ref, [(0, min(4, 29 - i - 1)) for i in range(29)])
        assert spec_decode(m, E.NgramDrafter(), p, 30, tree_budget=8)[0] == ref


# --- the cache and the drafter's context after tree steps

@pytest.mark.parametrize('kind', ['qwen3', 'llama', 'hybrid'])
def test_verify_and_commit_every_path(targets, prompts, tok, kind):
    "Each node gets its own path's logits; whichever path is accepted, the committed cache decodes on as a fresh prefill does."
    m = targets[kind]
    ctx, cont = torch.tensor([prompts[0][:16]]), greedy_decode(m, prompts[0][:16], 5)
    x = torch.randn(4, len(tok), generator=torch.Generator().manual_seed(1)); x[torch.arange(4), torch.tensor(cont[1:])] += 4
    t = build_tree(3 * x, 10)
    assert kind != 'hybrid' or len(leaf_paths(t)) > 1
    for j in range(len(t) + 1):
        goal = t.path(j)
        for hs in ((False,) if kind != 'hybrid' else (True, False)):
            with torch.no_grad():
                cache = DynamicCache(config=m.config)
                m(ctx, cache=cache, use_cache=True)
                v = verify_tree(m, cache, t, cont[0], hs)
                if j == 0:
                    for i in range(len(t) + 1):
                        plain = m(torch.cat([ctx[0], torch.tensor([cont[0]] + t.path(i))])[None]).logits[0, -1]
                        assert torch.allclose(v.logits[i], plain, atol=1e-4), (kind, i)
                pick = lambda i: goal[len(t.path(i))] if len(t.path(i)) < len(goal) else min(set(range(len(t) + 2)) - set(t.children(i)))
                accepted, bonus = follow(t, pick)
                assert [t.tokens[a - 1] for a in accepted] == goal
                v.commit(m, cache, accepted)
                done = [cont[0]] + goal + [bonus]
                assert cache.get_seq_length() == 16 + len(done) - 1
                got = m(torch.tensor([[bonus]]), cache=cache, use_cache=True).logits[0, -1]
                want = m(torch.cat([ctx[0], torch.tensor(done)])[None]).logits[0, -1]
                assert torch.allclose(got, want, atol=1e-4), (kind, j, hs)


@pytest.mark.parametrize('kind', ['qwen3', 'hybrid'])
def test_the_drafters_context_is_the_committed_taps(targets, prompts, tok, kind):
    "After tree steps that accept long paths, the drafter's cache equals one built from a fresh capture of the committed tokens."
    m, p = targets[kind], prompts[0]
    dm = fresh(m, tok, num_hidden_layers=2, block_size=8, target_layer_ids=[1, 3])
    ref = greedy_decode(m, p, 24)
    d = Knowing(dm, TreeOracle(p, ref, len(tok)))
    new, steps = spec_decode(m, d, p, 24, block_size=8, tree_budget=16)
    assert new == ref and max(a for a, _ in steps) >= 2
    n, seq = len(d.cache), p + new
    assert len(p) < n < len(seq)
    with torch.no_grad():
        want = dm.draft(capture(m, torch.tensor([seq[:n]]), layer_ids=[1, 3]), torch.tensor([seq[n]]), n, dm.new_cache())
        got = dm.draft(None, torch.tensor([seq[n]]), n, d.cache)
    assert torch.allclose(got, want, atol=1e-4)


def test_the_loop_asks_the_drafter_not_its_class(targets, tok):
    "DFlashDrafter grows the model's own tree (DFlash: build_tree of its slot logits); the loop branches on no DFlash2 class."
    checks = [ast.unparse(n.args[1]) for n in ast.walk(ast.parse(inspect.getsource(E))) if isinstance(n, ast.Call) and getattr(n.func, 'id', '') == 'isinstance']
    assert checks and not any('DFlash2' in c for c in checks), checks
    m = targets['qwen3']
    dm = fresh(m, tok, num_hidden_layers=1, block_size=8)
    d = DFlashDrafter(dm); d.reset()
    taps = capture(m, torch.arange(10)[None], layer_ids=dm.target_layer_ids)
    t = d.propose_tree(list(range(11)), taps, 12, 5)
    with torch.no_grad(): lg = dm.draft(taps, torch.tensor([10]), 10, dm.new_cache())
    assert t == build_tree(lg[0, :5], 12) and max(t.depths) <= 5
    warp = Sampling(0.7, top_k=2)
    ts = grow_tree(dm.tree_children(taps, torch.tensor([10]), 10, dm.new_cache(), 100, warp)[0], 100, 3)
    assert len(ts) == 2 + 4 + 8                                     # top-k 2: only the tokens a draw can give, every such path


# --- sampled: distributed as the target's own sampling

def sampled_tree(target, drafter, budget, rule=None, n=N, seed=0):
    g, outs, steps = torch.Generator().manual_seed(seed), [], []
    for _ in range(n):
        toks, st = spec_decode(target, drafter, PROMPT, NEW, block_size=4, generator=g, rule=rule, tree_budget=budget, **WARP)
        outs.append(tuple(toks)); steps += st
    return outs, sum(a for a, _ in steps) / len(steps)

def top_child(tree, probs, generator=None):
    "Wrong: go to the drafter's best child wherever there is one, whatever the target draws; draw only at a leaf."
    return follow(tree, lambda i: next(iter(tree.children(i))) if tree.children(i) else int(torch.multinomial(probs(i), 1, generator=generator)))

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['dflash', 'dflash2'])
def test_sampled_tree_decoding_is_lossless_in_distribution(small, kind):
    "The chain's chi-square check (81 continuations, p > 1e-3) on tree walks of budgets 4 and 16; steps do accept nodes."
    target, drafters, exact = small
    for budget in (4, 16):
        outs, acc = sampled_tree(target, drafters[kind], budget)
        assert chi2_pvalue(outs, exact) > ALPHA and 0.2 < acc < 1.5, (kind, budget, chi2_pvalue(outs, exact), acc)

def test_the_distribution_check_fails_a_wrong_walk(small):
    target, drafters, exact = small
    assert chi2_pvalue(sampled_tree(target, drafters['dflash'], 4, top_child, n=200)[0], exact) < ALPHA
    assert chi2_pvalue(sampled_tree(target, drafters['dflash2'], 16, top_child, n=200)[0], exact) < ALPHA

@pytest.mark.parametrize('kind', ['qwen3', 'hybrid'])
def test_the_tree_walk_draws_what_the_target_draws(targets, prompts, tok, kind):
    "One draw per committed token, in order: with the same generator the tree walk commits the target's own sample_decode tokens."
    m, p = targets[kind], prompts[0]
    d = DFlashDrafter(wide(fresh(m, tok, num_hidden_layers=1, block_size=4), seed=4))
    for budget in (1, 8):
        g1, g2 = torch.Generator().manual_seed(budget), torch.Generator().manual_seed(budget)
        for _ in range(3):
            got, _ = spec_decode(m, d, p, 16, block_size=4, temperature=0.8, top_p=0.9, generator=g1, tree_budget=budget)
            assert got == sample_decode(m, p, 16, temperature=0.8, top_p=0.9, generator=g2)

@pytest.mark.slow
def test_sampled_tree_decoding_on_a_hybrid_target_is_lossless_in_distribution(make_target):
    "The chi-square check on the Qwen3.5 hybrid, whose tree rows are rolled back to the accepted path every step."
    target = make_target('qwen3_5', layers=4, hidden=32, vocab=6, initializer_range=0.3)
    d = DFlashDrafter(wide(DFlashDraftModel(drafter_config(target.config, 1, 4, 3)).attach_target(target).eval()))
    outs, acc = sampled_tree(target, d, 4)
    assert chi2_pvalue(outs, continuations(target, PROMPT, NEW, Sampling(**WARP))) > ALPHA and 0.1 < acc < 1.5, acc


# --- evaluate, the job, the CLI, the cost

def test_evaluate_many_takes_a_budget_per_drafter(targets, prompts, tok):
    m = targets['hybrid']
    d = fresh(m, tok, num_hidden_layers=1, block_size=8)
    res = evaluate_many(m, {'chain': d, 'tree': d, 'ngram': 'ngram'}, prompts, 16, eos_token_id=[], strict=True, tree_budget={'tree': 8})
    assert [r['tree_budget'] for r in res.values()] == [0, 8, 0] and all(r['lossless'] for r in res.values())
    assert res['chain']['drafted_per_step'] <= 7
    assert 1 <= res['tree']['drafted_per_step'] <= 8 and abs(res['tree']['tau'] - 1 - sum(res['tree']['accept_hist'])) < 1e-9
    hot = evaluate(m, d, prompts, 16, eos_token_id=[], temperature=0.7, seed=1, tree_budget=8)
    assert hot['lossless'] is None and hot['tree_budget'] == 8 and hot['tau'] == evaluate(m, d, prompts, 16, eos_token_id=[], temperature=0.7,
                                                                                             seed=1, tree_budget=8)['tau']


def test_cli_tree_budget_on_the_embedded_demo(embedded, tok, tmp_path, capsys):
    "`dflash_evaluate --tree-budget 4`: a 'dflash tree 4' row beside the chain's, lossless, in the table and results.json."
    fresh(embedded, tok, num_hidden_layers=1, block_size=8).save_pretrained(tmp_path / 'drafter')
    assert evaluate_cli(['--drafter', str(tmp_path / 'drafter'), '--num-prompts', '2', '--max-new-tokens', '8', '--tree-budget', '4',
                         '--out', str(tmp_path / 'eval')]) == 0
    text = capsys.readouterr().out
    assert 'dflash tree 4' in text and 'Lossless: every one of the 6 speculative outputs' in text
    res = json.loads((tmp_path / 'eval/results.json').read_text())['results'][str(HELDOUT_DATA)]
    assert list(res) == ['dflash', 'dflash tree 4', 'ngram'] and res['dflash tree 4']['tree_budget'] == 4 and res['dflash tree 4']['lossless']
    assert res['dflash tree 4']['drafted_per_step'] <= 4 and res['dflash']['tree_budget'] == 0
    with pytest.raises(ValueError, match='tree_budget=-1'): EvalConfig(tree_budget=-1)
    assert EvalConfig(tree_budget=4).warnings == ['tree_budget=4 has no effect: it is read only with a drafter']


def test_tree_verify_cost(targets, prompts):
    for kind, rows in (('qwen3', {4: 1, 16: 1}), ('hybrid', {4: 1, 16: 4})):
        c = tree_verify_cost(targets[kind], prompts[0], (4, 16), reps=2)
        assert c['decode_s'] > 0 and c['chain_s'] > 0 and all(v > 0 for v in c['tree_s'].values()) and c['rows'] == rows
