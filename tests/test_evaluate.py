"Speculative decoding: lossless on standard and hybrid targets, tau of oracle/wrong drafters, n-gram lookup, cache rollback."
import json, warnings
import pytest
import torch
from transformers import DynamicCache
from dflash.core import TINY_TARGET, HELDOUT_DATA
from dflash.taps import load_target, load_tokenizer
from dflash.model import DFlashDraftModel, drafter_config
from dflash.cache import crop, croppable, recurrent_mixers, restore, rollback, snapshot
from dflash.evaluate import (DFlashDrafter, NgramDrafter, evaluate, evaluate_many, greedy_decode, greedy_reference, load_prompts,
                             load_drafter, ngram_propose, spec_decode, evaluate_job, EvalConfig)

@pytest.fixture(scope='module')
def prompts(tok): return load_prompts(tok, n=3)

# Random models with a wider init than the default 0.02, whose tied embeddings make a model repeat its input
# token: these give varied greedy outputs with clear margins.
WIDE = dict(initializer_range=0.1)

@pytest.fixture(scope='module')
def qwen3(make_target): return lambda seed=0: make_target('qwen3', seed=seed, tie_word_embeddings=True, **WIDE)

@pytest.fixture(scope='module')
def hybrid(make_target): return lambda seed=0: make_target('qwen3_5', seed=seed, **WIDE)

@pytest.fixture(scope='module', params=['qwen3', 'llama', 'hybrid'])
def model(request, make_target, qwen3, hybrid):
    return dict(qwen3=qwen3, hybrid=hybrid, llama=lambda: make_target('llama', layers=3, **WIDE))[request.param]()

def fresh(target, tok, **kw):
    "An untrained DFlash drafter for `target`, attached to it."
    return DFlashDraftModel(drafter_config(target.config, mask_token_id=tok.mask_token_id, **kw)).attach_target(target).eval()

class Oracle:
    "Proposes the target's own greedy continuation (or, with `wrong`, a different token at every slot)."
    layer_ids = None
    def __init__(self, prompt, answer, wrong=False, vocab=None): self.seq, self.wrong, self.vocab = list(prompt) + list(answer), wrong, vocab
    def reset(self): pass
    def propose(self, tokens, taps, k):
        d = self.seq[len(tokens):len(tokens) + k]
        return [(t + 1) % self.vocab for t in d] if self.wrong else d

# --- prompts

def test_prompts_stop_at_first_assistant_turn(tok, prompts, tmp_path):
    f = tmp_path / 'p.jsonl'
    f.write_text(json.dumps({'conversations': [{'from': 'human', 'value': 'a'}, {'from': 'gpt', 'value': 'b'}, {'from': 'human', 'value': 'c'}]}) + '\n')
    assert tok.decode(load_prompts(tok, f)[0]) == '<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n'
    f.write_text(json.dumps({'messages': [{'role': 'assistant', 'content': 'b'}]}) + '\n')
    with pytest.raises(ValueError, match='row 1: no turns'): load_prompts(tok, f)
    assert len(prompts) == 3
    for p in prompts:
        text = tok.decode(p)
        assert text.startswith('<|im_start|>') and text.endswith('<|im_start|>assistant\n') and text.count('<|im_start|>assistant') == 1

# --- n-gram drafter

def test_ngram_match_proposes_continuation():
    assert ngram_propose([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]
    assert ngram_propose([1, 2, 3, 4, 9, 2, 3], 1) == [4]
    assert ngram_propose([1, 2, 3, 4, 9, 2, 3], 10) == [4, 9, 2, 3], 'runs to the end of the tokens at most'

def test_ngram_prefers_longest_then_most_recent():
    assert ngram_propose([7, 1, 2, 3, 8, 5, 3, 6, 1, 2, 3], 2) == [8, 5], '3-gram [1,2,3] beats the more recent 1-gram [3]'
    assert ngram_propose([5, 3, 7, 5, 3, 8, 5, 3], 1) == [8], 'most recent occurrence'
    assert ngram_propose(list(range(10)) + [0, 1, 2, 3, 4], 3, max_n=2) == [5, 6, 7]

def test_ngram_no_match():
    assert ngram_propose([1, 2, 3, 4], 5) == []
    assert ngram_propose([4, 1, 4], 5, min_n=2) == [] and ngram_propose([4, 1, 4], 5) == [1, 4]
    assert ngram_propose([3], 4) == [] and ngram_propose([], 4) == []
    assert NgramDrafter().propose([1, 2, 1], None, 3) == [2, 1]

# --- cache rollback

@pytest.mark.parametrize('refeed', ['target', 'mixers'])
@pytest.mark.parametrize('accepted', [0, 2, 5])
def test_rollback_equals_fresh_prefill(model, accepted, refeed):
    "After verifying a block of 8 and keeping accepted+1, decoding on gives the logits of a fresh prefill."
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(accepted)).tolist()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([ids[:20]]), cache=cache, use_cache=True)
        snap = snapshot(cache)
        o = model(torch.tensor([ids[20:28]]), cache=cache, use_cache=True, output_hidden_states=refeed == 'mixers')
        rollback(model, cache, snap, ids[20:21 + accepted], o.hidden_states)
        assert cache.get_seq_length() == 21 + accepted
        for t in range(21 + accepted, 24 + accepted):                      # decode on, one token at a time
            got = model(torch.tensor([[ids[t]]]), cache=cache, use_cache=True).logits[0, -1]
            want = model(torch.tensor([ids[:t + 1]])).logits[0, -1]
            assert torch.allclose(got, want, atol=1e-4), (t, (got - want).abs().max())

def test_recurrent_mixers_found(qwen3, hybrid):
    m = hybrid()
    cache = DynamicCache(config=m.config)
    with torch.no_grad(): m(torch.arange(5)[None], cache=cache, use_cache=True)
    mixers = recurrent_mixers(m, cache)
    assert sorted(mixers) == [0, 1, 2] and mixers[0][1] is m.model.layers[0].linear_attn
    c2 = DynamicCache(config=qwen3().config)
    assert recurrent_mixers(qwen3(), c2) == {}

def test_crop_and_snapshot_kinds(qwen3, hybrid):
    std, hyb = qwen3(), hybrid()
    with torch.no_grad():
        cs, ch = DynamicCache(config=std.config), DynamicCache(config=hyb.config)
        std(torch.arange(10)[None], cache=cs, use_cache=True); hyb(torch.arange(10)[None], cache=ch, use_cache=True)
    assert croppable(cs) and not croppable(ch)
    assert crop(cs, 6).get_seq_length() == 6
    with pytest.raises(ValueError, match='cannot crop it to 8'): crop(cs, 8)
    snap = snapshot(ch)
    rec = ch.layers[0].recurrent_states[0].clone()
    with torch.no_grad(): hyb(torch.arange(10, 14)[None], cache=ch, use_cache=True)
    assert not torch.equal(ch.layers[0].recurrent_states[0], rec) and ch.get_seq_length() == 14
    restore(ch, snap)
    assert torch.equal(ch.layers[0].recurrent_states[0], rec) and ch.get_seq_length() == 10
    restore(ch, snap)                                                       # a snapshot can be used again
    assert torch.equal(ch.layers[0].recurrent_states[0], rec)
    with pytest.raises(ValueError, match='recurrent'): rollback(hyb, ch, 10, [1])

# --- lossless decoding

def test_greedy_matches_generate(model, prompts):
    g = model.generate(torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy_decode(model, prompts[0], 16) == g[0, len(prompts[0]):].tolist()

def test_oracle_accepts_every_slot(model, prompts):
    p = prompts[1]
    ref = greedy_decode(model, p, 40)
    for B in (4, 16):
        got, steps = spec_decode(model, Oracle(p, ref), p, 40, block_size=B)
        assert got == ref
        assert [a for a, _ in steps[:-1]] == [B - 1] * (len(steps) - 1), 'tau = B but for the last step'
        assert 1 + sum(a + 1 for a, _ in steps) == 40 and steps[-1][0] == (39 % B or B) - 1

def test_wrong_drafter_commits_one_token_per_step(model, prompts):
    p = prompts[1]
    ref = greedy_decode(model, p, 30)
    got, steps = spec_decode(model, Oracle(p, ref, wrong=True, vocab=model.config.vocab_size), p, 30)
    assert got == ref and len(steps) == 29 and all(a == 0 for a, _ in steps)
    assert [n for _, n in steps] == [min(15, 29 - i - 1) for i in range(29)]

def test_ngram_and_dflash_lossless(model, tok, prompts):
    dm = fresh(model, tok, num_hidden_layers=1, block_size=8)
    prompts = prompts[:2]
    ref = greedy_reference(model, prompts, 24, eos_token_id=[])
    for d in ['ngram', dm]:
        r = evaluate(model, d, prompts, 24, eos_token_id=[], reference=ref, strict=True)
        assert r['lossless'] and r['new_tokens'] == 2 * 24 and 1 <= r['tau'] <= r['block_size']
        assert abs(r['tau'] - 1 - sum(r['accept_hist'])) < 1e-9 and len(r['accept_hist']) == r['block_size'] - 1
        assert r['tokens_per_s'] > 0 and r['baseline_tokens_per_s'] > 0 and len(r['per_prompt']) == 2

def test_evaluate_many_shares_the_reference(tok, prompts, hybrid):
    m = hybrid()
    ref = greedy_decode(m, prompts[0], 20, [])
    res = evaluate_many(m, {'oracle': Oracle(prompts[0], ref), 'wrong': Oracle(prompts[0], ref, True, len(tok)), 'ngram': 'ngram'},
                        prompts[:1], 20, block_size=8, eos_token_id=[], strict=True)
    assert list(res) == ['oracle', 'wrong', 'ngram'] and all(r['lossless'] for r in res.values())
    assert res['oracle']['tau'] == 19 / 3 and res['wrong']['tau'] == 1 and res['wrong']['accept_hist'] == [0] * 7
    assert res['oracle']['accept_hist'] == [1, 1] + [2 / 3] * 5, 'blocks of 8, 8, then the last 3 tokens'
    assert len({r['baseline_tokens_per_s'] for r in res.values()}) == 1
    with pytest.raises(ValueError, match='max_new_tokens=20'):
        evaluate(m, 'ngram', prompts[:1], 24, eos_token_id=[], reference=greedy_reference(m, prompts[:1], 20, eos_token_id=[]))

def test_eos_ends_the_answer(tok, prompts, hybrid):
    m = hybrid()
    ref = greedy_decode(m, prompts[0], 30)
    eos = ref[5]
    want = ref[:ref.index(eos) + 1]
    assert greedy_decode(m, prompts[0], 30, eos) == want
    for d in [Oracle(prompts[0], ref), NgramDrafter(), Oracle(prompts[0], ref, wrong=True, vocab=len(tok))]:
        assert spec_decode(m, d, prompts[0], 30, eos)[0] == want

@pytest.mark.parametrize('layer_ids', [[0, 2], [1, 3]], ids=['middle', 'last-layer'])
def test_dflash_context_is_the_committed_taps(tok, prompts, hybrid, layer_ids):
    "The drafter's cache after decoding equals one built from a fresh capture (raw layer outputs, the last layer included)."
    from dflash.taps import capture
    m = hybrid()
    dm = fresh(m, tok, num_hidden_layers=2, block_size=4, target_layer_ids=layer_ids)
    d = DFlashDrafter(dm)
    p = prompts[0]
    new, steps = spec_decode(m, d, p, 20, block_size=4)
    n = len(d.cache)
    seq = p + new
    assert len(p) <= n < len(seq)
    taps = capture(m, torch.tensor([seq[:n]]), layer_ids=layer_ids)
    with torch.no_grad():
        want = dm.draft(taps, torch.tensor([seq[n]]), n, dm.new_cache())
        got = dm.draft(None, torch.tensor([seq[n]]), n, d.cache)
    assert torch.allclose(got, want, atol=1e-4)

def test_mismatch_is_flagged(tok, prompts, hybrid):
    m, other = hybrid(), hybrid(seed=1)
    bad = greedy_reference(other, prompts[:1], 12)
    with pytest.warns(UserWarning, match='prompt 0'):
        r = evaluate(m, 'ngram', prompts[:1], 12, reference=bad, warmup=False)
    assert not r['lossless'] and r['per_prompt'][0]['first_mismatch'] is not None
    with pytest.raises(AssertionError, match='prompt 0'): evaluate(m, 'ngram', prompts[:1], 12, reference=bad, warmup=False, strict=True)

def test_trained_tiny_target_lossless(prompts):
    m, tok = load_target(TINY_TARGET), load_tokenizer(TINY_TARGET)
    dm = fresh(m, tok, num_hidden_layers=1)
    ref = greedy_reference(m, prompts[:2], 32)
    assert ref['eos_token_id'] == [tok.eos_token_id]
    for d in ['ngram', dm]:
        r = evaluate(m, d, prompts[:2], 32, reference=ref, strict=True)
        assert r['lossless'] and r['new_tokens'] == sum(map(len, ref['outputs']))

def test_job_tau_per_file_and_drafter(tok, hybrid, save_target, tmp_path, capsys):
    "The job: a row per file and drafter, a sentence on losslessness, results.json; a drafter checkpoint loads onto the target."
    m = hybrid()
    save_target(m, tmp_path / 'target')
    fresh(m, tok, num_hidden_layers=1, block_size=8).save_pretrained(tmp_path / 'drafter')
    (tmp_path / 'asks.json').write_text(json.dumps([{'messages': [{'role': 'user', 'content': 'Convert 3 km to m.'}]}]))
    res = evaluate_job(target=str(tmp_path / 'target'), drafter=str(tmp_path / 'drafter'), eval_data=f"{HELDOUT_DATA},{tmp_path / 'asks.json'}",
                       num_prompts=2, max_new_tokens=10, out=str(tmp_path / 'eval'))
    text = capsys.readouterr().out
    assert [len(r) for r in res.values()] == [2, 2] and 'asks.json' in text and 'dflash' in text and 'ngram' in text
    assert 'Lossless: every one of the 6 speculative outputs' in text
    saved = json.loads((tmp_path / 'eval/results.json').read_text())
    assert saved['results'][str(tmp_path / 'asks.json')]['dflash']['block_size'] == 8
    assert saved['results'][str(tmp_path / 'asks.json')]['ngram']['block_size'] == 16      # n-gram drafts its own 15, as in training's final loop
    assert load_drafter(tmp_path / 'drafter', m).block_size == 8

# --- sampled decoding: lossless in distribution

from collections import Counter
from transformers import AutoModelForCausalLM, Qwen3Config
from dflash.evaluate import TauProbe, sample_decode
from dflash.sampling import Sampling, sampling_probs, speculative_sample, _draw

ALPHA = 1e-3          # the false-alarm rate of each distribution check
N = 1000              # speculative decodes per check

def continuations(target, prompt, n, warp):
    "{continuation: probability} of every n-token continuation of `prompt` under the target's own sampling, enumerated."
    seqs, probs = [()], torch.ones(1, dtype=torch.float64)
    for _ in range(n):
        with torch.no_grad(): p = warp(target(torch.tensor([list(prompt) + list(s) for s in seqs])).logits[:, -1]).double()
        nz = p.nonzero()
        seqs, probs = [seqs[r] + (t,) for r, t in nz.tolist()], probs[nz[:, 0]] * p[nz[:, 0], nz[:, 1]]
    return dict(zip(seqs, probs.tolist()))

def chi2_pvalue(samples, dist, min_expected=5):
    "Pearson's chi-square p-value of `samples` against `dist` (cells expecting < 5 pooled); 0 if a sample is outside its support."
    n, counts = len(samples), Counter(samples)
    if set(counts) - set(dist): return 0.0
    cells, rest = [], [0, 0.0]
    for k, pk in dist.items():
        o, e = counts.get(k, 0), n * pk
        if e >= min_expected: cells.append((o, e))
        else: rest[0] += o; rest[1] += e
    if rest[1] > 0: cells.append(tuple(rest))
    x2 = sum((o - e) ** 2 / e for o, e in cells)
    return torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2, dtype=torch.float64), torch.tensor(x2 / 2, dtype=torch.float64)).item()

PROMPT, NEW, WARP = [1, 4, 5, 1, 4], 4, dict(temperature=1.0, top_k=3)   # 3^4 = 81 continuations; blocks of 4 draft 2 tokens a step

def wide(drafter, seed=4, selector_only=False):
    "Wide random weights (seed 4: drafters whose tokens are accepted 17% (DFlash) and 45% (DFlash2) of the time here)."
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if n.startswith('candidate_selector.'): p.normal_(0, 1.0)
            elif p.dim() == 2 and not selector_only: p.normal_(0, 0.3)
    return drafter

@pytest.fixture(scope='module')
def small():
    "A random dense target of 6 tokens, its drafters, and the exact distribution of its 4-token continuations of PROMPT."
    from dflash.dflash2 import DFlash2DraftModel
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=True)).eval()
    d1 = wide(DFlashDraftModel(drafter_config(target.config, 1, 4, 3)).attach_target(target).eval())
    d2 = wide(DFlash2DraftModel.from_dflash(d1, selector_rank=4, selector_top_k=3), seed=14, selector_only=True)
    return target, dict(dflash=DFlashDrafter(d1), dflash2=DFlashDrafter(d2), ngram=NgramDrafter()), continuations(target, PROMPT, NEW, Sampling(**WARP))

def sampled(target, drafter, rule=None, n=N, seed=0):
    g, outs, acc, drafted = torch.Generator().manual_seed(seed), [], 0, 0
    for _ in range(n):
        toks, steps = spec_decode(target, drafter, PROMPT, NEW, block_size=4, generator=g, rule=rule, **WARP)
        outs.append(tuple(toks)); acc += sum(a for a, _ in steps); drafted += sum(d for _, d in steps)
    return outs, acc / max(drafted, 1)

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['dflash', 'dflash2', 'ngram'])
def test_sampled_decoding_is_lossless_in_distribution(small, kind):
    """Speculative sampling (DFlash: q from the warp of its logits; DFlash2: the selector's rows; n-gram: point masses) draws the target's
    own distribution: chi-square against the enumerated 81 continuations, p > 1e-3 (fixed seeds: the test is deterministic)."""
    target, drafters, exact = small
    outs, rate = sampled(target, drafters[kind])
    assert chi2_pvalue(outs, exact) > ALPHA and 0.1 < rate < 0.9, (kind, chi2_pvalue(outs, exact), rate)

@pytest.mark.slow
def test_the_distribution_check_fails_wrong_rules(small):
    "The same check, with the same drafter and draws, rejects a rule that always accepts and one whose residual is p, not max(p - q, 0)."
    target, drafters, exact = small
    def always_accept(draft, q, p, generator=None): return len(draft), _draw(p[len(draft)], generator)
    def residual_p(draft, q, p, generator=None):
        accepted, _ = speculative_sample(draft, q, p, generator)
        return accepted, _draw(p[accepted], generator)
    assert chi2_pvalue(sampled(target, drafters['dflash'], always_accept, n=200)[0], exact) < ALPHA  # p = 0: outputs off the target's support
    assert chi2_pvalue(sampled(target, drafters['dflash'], residual_p)[0], exact) < ALPHA      # p = 3e-5 (this drafter accepts 17%)
    assert chi2_pvalue(sampled(target, drafters['dflash2'], residual_p)[0], exact) < ALPHA     # p = 1e-26 (45%: q overlaps p more)
    g = torch.Generator().manual_seed(0)                               # and the target's own sampler passes it
    assert chi2_pvalue([tuple(sample_decode(target, PROMPT, NEW, generator=g, **WARP)) for _ in range(N)], exact) > ALPHA

@pytest.mark.slow
def test_sampled_decoding_on_a_hybrid_target_is_lossless_in_distribution(make_target):
    "The same check on the Qwen3.5 hybrid, whose recurrent states are rolled back after every rejection."
    target = make_target('qwen3_5', layers=4, hidden=32, vocab=6, initializer_range=0.3)
    d = wide(DFlashDraftModel(drafter_config(target.config, 1, 4, 3)).attach_target(target).eval())
    outs, rate = sampled(target, DFlashDrafter(d))
    assert chi2_pvalue(outs, continuations(target, PROMPT, NEW, Sampling(**WARP))) > ALPHA and 0.1 < rate < 0.9

def test_sampling_arguments_leave_greedy_decoding_as_it_was(tok, prompts, hybrid):
    m = hybrid()
    d = fresh(m, tok, num_hidden_layers=1, block_size=4)
    want = spec_decode(m, DFlashDrafter(d), prompts[0], 20, block_size=4)
    assert spec_decode(m, DFlashDrafter(d), prompts[0], 20, None, 4, 0.0, 0.5, 3, torch.Generator().manual_seed(0)) == want
    assert want[0] == greedy_decode(m, prompts[0], 20)

def test_sampled_evaluate_and_probe(tok, prompts, hybrid):
    from dflash.dflash2 import DFlash2DraftModel
    m = hybrid()
    d2 = DFlash2DraftModel.from_dflash(fresh(m, tok, num_hidden_layers=1, block_size=4), selector_rank=8, selector_top_k=4)
    ref = greedy_reference(m, prompts[:2], 16)
    r = evaluate(m, d2, prompts[:2], 16, reference=ref, temperature=0.7, top_p=0.9, top_k=50, seed=3)
    assert r['lossless'] is None and (r['temperature'], r['top_p'], r['top_k']) == (0.7, 0.9, 50) and 1 <= r['tau'] <= 4
    assert all(p['lossless'] is None and p['new_tokens'] == 16 for p in r['per_prompt'])
    assert evaluate(m, d2, prompts[:2], 16, reference=ref, temperature=0.7, top_p=0.9, top_k=50, seed=3)['tau'] == r['tau']
    assert evaluate(m, d2, prompts[:2], 16, reference=ref)['lossless'] is True
    with pytest.raises(ValueError, match='top_p'): TauProbe(str(TINY_TARGET), str(HELDOUT_DATA), temperature=0.5, top_p=1.5)

def test_sampling_probs():
    lg = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    assert torch.allclose(sampling_probs(lg, 2.0), torch.softmax(lg / 2, -1))
    p = sampling_probs(lg, 1.0, top_p=0.9, top_k=3)
    full = torch.softmax(lg[0, :3], -1)                              # top-k 3, then the smallest head of mass >= 0.9
    keep = (full.cumsum(0) - full < 0.9)
    assert torch.allclose(p[0, :3], (full * keep) / (full * keep).sum()) and p[0, 3] == 0
