"Tests of dflash.dflash2: the DFlash2 drafter's convolutions, selector, loss, counts, exact start from DFlash, decoding and checkpoint."
import json
import pytest, torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from dflash.taps import capture
from dflash.model import DFlashDraftModel, drafter_config, feature_scale_of
from dflash.loss import slot_weights
from dflash.dflash2 import BlockConv, DFlash2DraftModel, DFLASH2, dflash2_config
from dflash.designs import drafter_class
from dflash.publish import save_drafter
from dflash.validate import accepted_lengths

B, K = 4, 1024       # block size, selector candidates: half the vocabulary, so that random labels are often among them

@pytest.fixture(scope='module')
def setup(make_target, tok):
    "A random hybrid target, a DFlash drafter on it, a DFlash2 with random weights everywhere, and a batch of taps."
    target = make_target('qwen3_5', layers=4, hidden=64)
    torch.manual_seed(0)
    d1 = DFlashDraftModel(drafter_config(target.config, 2, B, tok.mask_token_id, [1, 2])).attach_target(target).eval()
    d2 = perturbed(DFlash2DraftModel(dflash2_config(target.config, 2, B, tok.mask_token_id, [1, 2], selector_rank=8, selector_top_k=K)))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tok), (2, 20), generator=g)
    lm = torch.zeros(2, 20, dtype=torch.long); lm[0, 4:] = 1; lm[1, 6:15] = 1
    return target, d1, d2.attach_target(target).eval(), capture(target, ids, layer_ids=[1, 2]), ids, lm

def perturbed(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'base_kernel' in n: p.add_(torch.randn_like(p) * 0.3)
            elif 'codebook' in n or 'hidden_projection' in n: p.normal_(0, 1.0)
            elif p.dim() == 2: p.normal_(0, 0.15)
    return model

def test_config_keys_and_refusals(setup):
    target, d1, d2, *_ = setup
    c = d2.config
    assert c.architectures == ['DFlash2DraftModel'] and c.dflash_config['selector_top_k'] == K and c.dflash_config['conv_kernel_size'] == 2
    assert {k: dflash2_config(target.config).dflash_config[k] for k in DFLASH2} == DFLASH2 and drafter_class(c) is DFlash2DraftModel
    assert drafter_class(d1.config) is DFlashDraftModel
    with pytest.raises(ValueError, match='does not divide'): dflash2_config(target.config, conv_group_size=48)
    with pytest.raises(ValueError, match='selector_top_k'): dflash2_config(target.config, selector_top_k=0)
    with pytest.raises(ValueError, match='this class loads DFlash2DraftModel'): DFlash2DraftModel(d1.config)
    with pytest.raises(ValueError, match='this class loads DFlashDraftModel'): DFlashDraftModel(c)

def test_convolution_formula_and_block_locality():
    torch.manual_seed(0)
    conv = BlockConv(8, 2, 2, 3)
    with torch.no_grad(): conv.base_kernel.normal_(); conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 9, 8)
    y, dyn = conv.prepare(x)
    d = conv.kernel_projection(x).view(1, 9, 2, 2, 4)
    want = torch.stack([sum((conv.base_kernel[0, o] + d[0, t, 0, o].repeat_interleave(2)) * x[0, t - o] for o in range(2) if t % 3 - o >= 0)
                        for t in range(9)])
    assert torch.allclose(y[0], want, atol=1e-5) and torch.equal(dyn, d[:, :, 1])
    x2 = x.clone(); x2[:, 2] += 1                                     # the last slot of block 0: block 1 does not see it
    assert torch.equal(conv.prepare(x2)[0][:, 3:], y[:, 3:]) and not torch.allclose(conv.prepare(x2)[0][:, 2], y[:, 2])
    with torch.no_grad(): conv.base_kernel.zero_()[:, 0] = 1; conv.kernel_projection.weight.zero_()
    y, dyn = conv.prepare(x)
    assert torch.equal(y, x) and torch.equal(conv.finish(x, dyn), x)  # the identity start

def test_from_dflash_is_an_exact_copy(setup):
    "The same logits bit for bit (training and drafting) and the same greedy drafts as the DFlash drafter it starts from."
    from dflash.evaluate import DFlashDrafter, greedy_decode, spec_decode
    target, d1, _, hs, ids, lm = setup
    d1.set_feature_scale(*feature_scale_of(hs, lm))
    d2 = DFlash2DraftModel.from_dflash(d1, selector_rank=8, selector_top_k=K)
    assert torch.equal(d2.feature_scale, d1.feature_scale) and torch.equal(d2.candidate_selector.successor_codebook, torch.zeros(d2.config.vocab_size, 8))
    with torch.no_grad(): o1, o2 = d1(hs, ids, lm, return_logits=True), d2(hs, ids, lm, return_logits=True)
    assert torch.equal(o1.logits, o2.logits) and torch.equal(o1.hits, o2.hits) and torch.equal(o1.correct, o2.unary_correct)
    cache1, cache2, fed = d1.new_cache(), d2.new_cache(), 0
    for a in o1.anchors[0].tolist():
        lg = d1.draft(hs[:1, fed:a], ids[0, a], a, cache1)
        path, _, _ = d2.propose(hs[:1, fed:a], ids[0, a], a, cache2); fed = a
        assert torch.equal(path, lg.argmax(-1)) and torch.equal(d2.draft(None, ids[0, a], a, cache2), lg)
    prompt = ids[0, :8].tolist()
    r1, r2 = spec_decode(target, DFlashDrafter(d1), prompt, 24, block_size=B), spec_decode(target, DFlashDrafter(d2), prompt, 24, block_size=B)
    assert r1 == r2 and r1[0] == greedy_decode(target, prompt, 24)
    d1.feature_scale = None

def test_drafting_equals_the_training_forward(setup):
    _, _, d2, hs, ids, lm = setup
    anchors = torch.tensor([[4, 6, 7, 13, 16], [6, 8, 9, 10, 13]])
    with torch.no_grad(): ref = d2(hs, ids, lm, anchors=anchors, return_logits=True)
    for r in range(2):
        cache, fed = d2.new_cache(), 0
        for j, a in enumerate(anchors[r].tolist()):
            assert torch.allclose(d2.draft(hs[r:r + 1, fed:a], ids[r, a], a, cache)[0], ref.logits[r, j], atol=1e-4); fed = a
    with torch.no_grad(): alone = d2(hs, ids, lm, anchors=anchors[:, 3:4], return_logits=True).logits
    assert torch.allclose(alone[:, 0], ref.logits[:, 3], atol=1e-5)     # blocks never meet, in the convolutions either

def test_selector_loss_recall_and_hits(setup):
    "The selector's term against a hand-walked selector, teacher-forced; candidate recall counts; hits = the selector's choice."
    _, _, d2, hs, ids, lm = setup
    anchors = torch.tensor([[5, 9, 14, 16]])
    o = d2(hs[:1], ids[:1], lm[:1], anchors=anchors, return_logits=True)
    sel, num, den, has, hit = d2.candidate_selector, 0., 0., torch.zeros(B - 1), torch.zeros(B - 1)
    cache, fed = d2.new_cache(), 0
    with torch.no_grad():
        for j, a in enumerate(anchors[0].tolist()):
            h = d2.draft_states(hs[:1, fed:a], ids[0, a], a, cache)[0]; fed = a
            unary, cand = d2.logits(h).topk(K)
            for k in range(B - 1):
                y = o.labels[0, j, k].item()
                if y == -100: continue
                s = unary[k] + (sel.predecessor_codebook[ids[0, a + k]] * sel.hidden_projection(h[k])) @ sel.successor_codebook[cand[k]].T
                den += slot_weights(B)[k]
                if y in cand[k].tolist():
                    num += slot_weights(B)[k] * F.cross_entropy(s[None], torch.tensor([cand[k].tolist().index(y)])); has[k] += 1
                hit[k] += cand[k, s.argmax()] == y
    assert has.sum() > 0 and torch.allclose(o.selector_loss, num / den, atol=1e-5)
    assert torch.equal(o.candidate_hits, has) and torch.equal(o.correct, hit) and torch.equal(o.hits.float().sum((0, 1)), hit)
    assert (o.candidate_hits <= o.count).all() and (o.correct <= o.candidate_hits).all()
    o.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in d2.named_parameters()), \
        [n for n, p in d2.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    d2.zero_grad(set_to_none=True)

@pytest.mark.parametrize('loss', ['decay', 'dpace', 'tree@4', 'treegrad@4'])
def test_selector_alpha_adds_the_selector_term(setup, loss):
    _, _, d2, hs, ids, lm = setup
    with torch.no_grad(): o0, o1, o2 = (d2(hs, ids, lm, loss=loss, selector_alpha=a) for a in (0.0, 1.0, 2.0))
    assert o1.selector_loss > 0 and torch.allclose(o1.loss - o0.loss, o1.selector_loss, atol=1e-5)
    assert torch.allclose(o2.loss - o0.loss, 2 * o1.selector_loss, atol=1e-5)
    assert o0.weight == 2 if loss != 'decay' else torch.allclose(o0.weight, slot_weights(B).expand_as(o0.labels)[o0.labels != -100].sum())

def self_drafted(d, hs, S=40, seed=0):
    """Token rows whose blocks at anchors 2, 2 + (B-1), ... are the drafter's own greedy path with one token changed at a random
    slot (or none), for the taps `hs`: rows on which it accepts a known number of tokens. Returns (ids, anchors, accepted)."""
    g, V = torch.Generator().manual_seed(seed), d.config.vocab_size
    ids = torch.randint(4, V, (hs.shape[0], S), generator=g)
    anchors, accepted = list(range(2, S - B + 1, B - 1)), []
    for r in range(hs.shape[0]):
        for a in anchors:                                             # the path at a reads taps < a and token a only
            path = d.propose(hs[r:r + 1, :a], ids[r, a], a, d.new_cache())[0][0]
            miss = int(torch.randint(0, B, (1,), generator=g))
            if miss < B - 1: path[miss] = (path[miss] + 1) % V
            ids[r, a + 1:a + B] = path; accepted.append(1 + miss)
    return ids, torch.tensor([anchors] * hs.shape[0]), torch.tensor(accepted).view(hs.shape[0], -1)

def test_hits_count_what_greedy_drafting_accepts(setup):
    "1 + the leading hits of each block = 1 + the leading slots of the selector's greedy path that match the labels."
    _, _, d2, *_ = setup
    hs = torch.randn(2, 40, 128, generator=torch.Generator().manual_seed(3))
    ids, anchors, accepted = self_drafted(d2, hs)
    with torch.no_grad(): o = d2(hs, ids, torch.ones_like(ids), anchors=anchors)
    assert torch.equal(accepted_lengths(o.labels, o.hits), accepted) and set(accepted.flatten().tolist()) == set(range(1, B + 1))

class InMemory(__import__('dflash.extracted', fromlist=['ExtractedDataset']).ExtractedDataset):
    "Rows of (taps, ids, loss mask) held in memory, read as an extraction is."
    def __init__(self, hs, ids, lm):
        import numpy as np
        self.rows, self.lengths = [dict(hidden_states=h, input_ids=i, loss_mask=m) for h, i, m in zip(hs, ids, lm)], np.array([ids.shape[1]] * len(ids))
    def __len__(self): return len(self.rows)
    def __getitem__(self, i): return self.rows[i]

def test_heldout_acceptance_counts_the_selectors_path(setup):
    "`dflash.validate.heldout_acceptance` of a DFlash2 drafter: the selector's greedy walk at every loss position."
    from dflash.validate import heldout_acceptance
    _, _, d2, *_ = setup
    hs = torch.randn(2, 40, 128, generator=torch.Generator().manual_seed(3))
    ids, _, _ = self_drafted(d2, hs)
    lm = torch.ones_like(ids); lm[:, 0] = 0; lm[1, :5] = 0                 # (a block needs a context to draft from)
    got = heldout_acceptance(d2, InMemory(hs, ids, lm))
    counts = []
    for r in range(2):
        for a in range(39):
            if not (lm[r, a] and lm[r, a + 1]): continue
            path = d2.propose(hs[r:r + 1, :a], ids[r, a], a, d2.new_cache())[0][0].tolist()
            c = 1
            while c < B and a + c < 40 and path[c - 1] == ids[r, a + c]: c += 1
            counts.append(c)
    assert abs(got['val_tau'] - sum(counts) / len(counts)) < 1e-9 and got['val_blocks'] == len(counts) and got['val_tau'] > 1.3

def test_training_vocabulary(setup):
    from dflash.model import _block_states
    from dflash.loss import _head_ce
    _, _, d2, hs, ids, lm = setup
    anchors = torch.tensor([[4, 9, 13], [6, 9, 12]])
    full = d2(hs, ids, lm, anchors=anchors)
    assert torch.allclose(d2(hs, ids, lm, anchors=anchors, vocab=torch.arange(d2.config.vocab_size)).loss, full.loss, atol=1e-5)
    top = torch.arange(4, 30)
    with torch.no_grad():
        h, labels, *_ = _block_states(d2, hs, ids, lm, anchors)
        _, _, (_, tid) = _head_ce(d2, h[labels != -100], labels[labels != -100], vocab=top, topk=K)
    assert torch.isin(tid, torch.cat([top, labels[labels != -100]])).all()
    sub = d2(hs, ids, lm, anchors=anchors, vocab=top)
    assert (sub.candidate_hits >= full.candidate_hits).all() and sub.loss.requires_grad

def test_sampled_proposal(setup):
    _, _, d2, hs, ids, _ = setup
    def draw(seed, T=0.8):
        return d2.propose(hs[:1, :9], ids[0, 9], 9, d2.new_cache(), temperature=T, generator=torch.Generator().manual_seed(seed))
    path, cand, q = draw(0)
    assert q.shape == (1, B - 1, K) and torch.allclose(q.sum(-1), torch.ones(1, B - 1))
    assert (cand == path[..., None]).any(-1).all() and all(torch.equal(a, b) for a, b in zip(draw(0), (path, cand, q)))
    assert len({tuple(draw(s, 1e3)[0][0].tolist()) for s in range(5)}) > 1          # (these random scores are sharp: a high T)

def test_checkpoint_names_and_loading(setup, tmp_path):
    target, _, d2, hs, ids, lm = setup
    save_drafter(d2, tmp_path)
    with safe_open(tmp_path / 'model.safetensors', 'pt') as f: keys = set(f.keys())
    assert keys == set(d2.state_dict()) and 'candidate_selector.successor_codebook' in keys and not any(k.endswith('codebook.weight') for k in keys)
    j = json.loads((tmp_path / 'config.json').read_text())
    assert j['architectures'] == ['DFlash2DraftModel'] and {k: j['dflash_config'][k] for k in DFLASH2} == {**DFLASH2, 'selector_rank': 8, 'selector_top_k': K}
    anchors = torch.tensor([[4, 9], [6, 9]])
    with torch.no_grad(): want = d2(hs, ids, lm, anchors=anchors, return_logits=True).logits
    back = drafter_class(tmp_path).from_pretrained(tmp_path).attach_target(target).eval()
    with torch.no_grad(): assert torch.equal(back(hs, ids, lm, anchors=anchors, return_logits=True).logits, want)
    sd = load_file(tmp_path / 'model.safetensors')
    save_file({k + '.weight' * ('codebook' in k): v for k, v in sd.items()}, tmp_path / 'model.safetensors', metadata={'format': 'pt'})
    again = DFlash2DraftModel.from_pretrained(tmp_path)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in back.state_dict().items())
