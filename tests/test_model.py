"Tests of dflash.model and dflash.loss: the DFlash drafter's semantics, its loss, decoding cache and checkpoint format."
import json, math
import pytest, torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3_5Config
from dflash.tiny_target import target_config
from dflash.taps import capture, default_layer_ids, load_target_io
from dflash.model import DFlashConfig, DFlashDraftModel, DraftCache, drafter_config
from dflash.blocks import block_mask, pad_anchors, sample_anchors
from dflash.loss import block_labels, slot_weights
from dflash.publish import save_drafter

B = 4  # block size of the test drafters

def qwen3_target(vocab):
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=512)

_SETUPS = {}

def make_setup(kind, tok):
    "A random-weight target (dense Qwen3 or the Qwen3.5 hybrid), a 2-layer drafter on it, and a batch of taps."
    if kind not in _SETUPS: _SETUPS[kind] = _build(kind, tok)
    return _SETUPS[kind]

@pytest.fixture(scope='module')
def setup(tok): return make_setup('qwen3_5', tok)      # the repo's target architecture

@pytest.fixture(scope='module', params=['qwen3', 'qwen3_5'])
def both(request, tok): return make_setup(request.param, tok)   # for what depends on the target's architecture

def _build(kind, tok):
    torch.manual_seed(0)
    tc = qwen3_target(len(tok)) if kind == 'qwen3' else target_config(tok, hidden=64, layers=4)
    target = AutoModelForCausalLM.from_config(tc).eval()
    cfg = drafter_config(tc, num_hidden_layers=2, block_size=B, mask_token_id=tok.mask_token_id, target_layer_ids=[1, 2])
    drafter = DFlashDraftModel(cfg).attach_target(target).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tok), (2, 20), generator=g)
    lm = torch.zeros(2, 20, dtype=torch.long); lm[0, 4:] = 1; lm[1, 6:15] = 1
    hs = capture(target, ids, layer_ids=cfg.target_layer_ids)
    return target, drafter, hs, ids, lm

def logits(drafter, hs, ids, lm, anchors, **kw):
    with torch.no_grad(): return drafter(hs, ids, lm, anchors=anchors, return_logits=True, **kw).logits

ANCHORS = torch.tensor([[5, 11], [7, 12]])

# --- tapped layers -----------------------------------------------------------------------------------

def test_layer_id_rule():
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28, 1) == [14]
    assert drafter_config(Qwen3Config(num_hidden_layers=64)).target_layer_ids == [1, 16, 31, 46, 61]

def test_taps_are_decoder_layer_outputs(both):
    "Layer id k is HF's hidden_states[k + 1] for every layer but the last, whose raw output is before the final norm."
    target, drafter, *_ = both
    x = torch.arange(4, 14)[None]
    with torch.no_grad(): hs = target(x, output_hidden_states=True).hidden_states
    t = capture(target, x, layer_ids=[0, 2, 3])
    assert torch.equal(t[..., :64], hs[1]) and torch.equal(t[..., 64:128], hs[3])
    assert torch.equal(target.model.norm(t[..., 128:]), hs[4]) and not torch.allclose(t[..., 128:], hs[4])

# --- config ------------------------------------------------------------------------------------------

def test_drafter_config_from_targets(tok):
    c = drafter_config(target_config(tok), mask_token_id=tok.mask_token_id)   # the embedded default's shape
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads, c.vocab_size) == (256, 4, 64, 2, 2048)
    assert (c.intermediate_size, c.num_hidden_layers, c.block_size, c.num_target_layers) == (768, 5, 16, 8)
    assert c.rope_parameters == {'rope_theta': 10000.0, 'rope_type': 'default'}      # full-width RoPE
    nested = Qwen3_5Config(text_config=target_config(tok, hidden=128, layers=12).to_dict())
    n = drafter_config(nested, num_hidden_layers=3, mask_token_id=3)
    assert (n.hidden_size, n.num_target_layers, n.target_layer_ids) == (128, 12, [1, 5, 9])
    q = drafter_config(Qwen3Config(rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}, rms_norm_eps=1e-5), mask_token_id=7)
    assert q.rope_parameters['rope_theta'] == 1e6 and q.rms_norm_eps == 1e-5 and q.intermediate_size == 22016
    with pytest.raises(ValueError, match='out of range'): drafter_config(qwen3_target(100), target_layer_ids=[1, 4])

# --- anchors and labels ------------------------------------------------------------------------------

def test_anchors_only_inside_the_loss():
    g = torch.Generator().manual_seed(0)
    lm = (torch.rand(6, 50, generator=g) < 0.7).long()
    a, v = sample_anchors(lm, num_anchors=10, generator=g)
    for r in range(6):
        ok = (lm[r, :-1] & lm[r, 1:]).nonzero()[:, 0].tolist()
        got = a[r][v[r]].tolist()
        assert len(got) == min(10, len(ok)) and got == sorted(set(got)) and set(got) <= set(ok)
    a, v = sample_anchors(lm, num_anchors=512)
    assert a[0][v[0]].tolist() == (lm[0, :-1] & lm[0, 1:]).nonzero()[:, 0].tolist()   # all of them when fewer
    a, v = sample_anchors(torch.tensor([[1, 0, 1, 0, 1]]))
    assert not v.any()

def test_anchor_sampling_is_seeded():
    lm = torch.ones(2, 300)
    one = sample_anchors(lm, 16, torch.Generator().manual_seed(3))[0]
    assert torch.equal(one, sample_anchors(lm, 16, torch.Generator().manual_seed(3))[0])

def test_labels_slot_k_is_token_a_plus_k():
    ids = torch.arange(200, 212)[None]
    lm = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]])
    anchors, valid = pad_anchors([[1, 3, 9, 10]])
    lab = block_labels(ids, lm, anchors, valid, 4)
    assert lab[0].tolist() == [[202, 203, 204], [204, -100, 206], [210, 211, -100], [211, -100, -100]]

def test_loss_uses_labels_a_plus_k(setup):
    _, drafter, hs, ids, lm = setup
    with torch.no_grad(): out = drafter(hs, ids, lm, anchors=ANCHORS, return_logits=True)
    wk = slot_weights(B)
    def weighted_ce(shift):
        num = den = 0.
        for r in range(2):
            for j, a in enumerate(ANCHORS[r].tolist()):
                for k in range(1, B):
                    p = a + k + shift
                    if p < 20 and lm[r, a + k]:
                        num += wk[k - 1] * F.cross_entropy(out.logits[r, j, k - 1][None].float(), ids[r, p][None])
                        den += wk[k - 1]
        return num / den
    assert torch.allclose(out.loss, weighted_ce(0), atol=1e-5)
    assert not torch.allclose(out.loss, weighted_ce(1), atol=1e-5)
    assert out.count.tolist() == [(out.labels[..., k] != -100).sum().item() for k in range(B - 1)]

def test_slot_weights():
    w = slot_weights(16)
    assert len(w) == 15 and torch.allclose(w, torch.exp(-torch.arange(15.) / 7))

def test_accuracy_counts_argmax_hits(setup):
    _, drafter, hs, ids, lm = setup
    with torch.no_grad(): out = drafter(hs, ids, lm, anchors=ANCHORS, return_logits=True)
    keep = out.labels != -100
    hit = (out.logits.argmax(-1) == out.labels) & keep
    assert out.correct.tolist() == hit.sum((0, 1)).float().tolist()
    assert torch.allclose(out.acc, hit.sum((0, 1)) / keep.sum((0, 1)).clamp_min(1))

# --- no leaks ----------------------------------------------------------------------------------------

def test_block_mask_semantics():
    m = block_mask(torch.tensor([[2, 5]]), 8, 3)[0]
    assert m[:3, :8].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]] * 3     # context strictly before the anchor
    assert m[3:, :8].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]] * 3
    assert m[:3, 8:11].all() and m[3:, 11:].all()                   # own block, both directions
    assert not m[:3, 11:].any() and not m[3:, 8:11].any()            # never another block

def test_tokens_after_the_anchor_do_not_leak(setup):
    _, drafter, hs, ids, lm = setup
    base = logits(drafter, hs, ids, lm, ANCHORS)
    for r, a in [(0, 5), (1, 7)]:
        ids2 = ids.clone(); ids2[r, a + 1:] = 9                      # its own targets and every later block's tokens
        new = logits(drafter, hs, ids2, lm, ANCHORS)
        assert torch.equal(new[r, 0], base[r, 0])
        assert not torch.allclose(new[r, 1], base[r, 1])             # the later block did change
    ids3 = ids.clone(); ids3[0, 5] = 9                               # the anchor token itself is an input
    assert not torch.allclose(logits(drafter, hs, ids3, lm, ANCHORS)[0, 0], base[0, 0])

def test_context_at_or_after_the_anchor_does_not_leak(setup):
    _, drafter, hs, ids, lm = setup
    base = logits(drafter, hs, ids, lm, ANCHORS)
    hs2 = hs.clone(); hs2[0, 5:] = 3.
    assert torch.equal(logits(drafter, hs2, ids, lm, ANCHORS)[0, 0], base[0, 0])
    hs3 = hs.clone(); hs3[0, 4] = 3.                                 # position a-1 is context
    assert not torch.allclose(logits(drafter, hs3, ids, lm, ANCHORS)[0, 0], base[0, 0])

def test_blocks_are_independent_of_each_other(setup):
    _, drafter, hs, ids, lm = setup
    both = logits(drafter, hs, ids, lm, ANCHORS)
    alone = logits(drafter, hs, ids, lm, ANCHORS[:, :1])
    assert torch.allclose(both[:, :1], alone, atol=1e-5)
    padded = logits(drafter, hs, ids, lm, torch.tensor([[5, 0], [7, 0]]), anchor_valid=torch.tensor([[1, 0], [1, 0]]))
    assert torch.allclose(padded[:, :1], alone, atol=1e-5)

# --- gradients and the frozen target parts ----------------------------------------------------------

def test_gradient_reaches_drafter_not_target(both):
    target, drafter, hs, ids, lm = both
    drafter.train()
    out = drafter(hs, ids, lm, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in drafter.named_parameters()), \
        [n for n, p in drafter.named_parameters() if p.grad is None]
    assert all(p.grad is None for p in target.parameters())
    drafter.zero_grad(set_to_none=True); drafter.eval()

def test_target_parts_are_not_drafter_state(both):
    target, drafter, *_ = both
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert all(p is not emb and p is not head for p in drafter.parameters())
    assert not any('embed' in k or 'lm_head' in k for k in drafter.state_dict())
    assert not any('embed' in n or 'lm_head' in n for n, _ in drafter.named_modules())

def test_head_chunking_and_checkpointing_change_nothing(setup):
    _, drafter, hs, ids, lm = setup
    def run(**kw):
        drafter.zero_grad(set_to_none=True)
        out = drafter(hs, ids, lm, anchors=ANCHORS, **kw); out.loss.backward()
        return out.loss.detach(), drafter.fc.weight.grad.clone()
    l1, g1 = run()
    l2, g2 = run(chunk=3)
    drafter.train(); drafter.activation_checkpointing_enable()
    l3, g3 = run()
    drafter.activation_checkpointing_disable(); drafter.eval(); drafter.zero_grad(set_to_none=True)
    assert torch.allclose(l1, l2, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)
    assert torch.allclose(l1, l3, atol=1e-6) and torch.allclose(g1, g3, atol=1e-6)

def test_no_labels_gives_a_zero_loss_with_gradient(setup):
    _, drafter, hs, ids, lm = setup
    out = drafter(hs, ids, torch.zeros_like(lm))
    assert out.loss.item() == 0 and out.count.sum() == 0
    out.loss.backward()
    assert drafter.fc.weight.grad is not None
    drafter.zero_grad(set_to_none=True)

# --- decoding ----------------------------------------------------------------------------------------

def test_cached_drafting_equals_the_training_forward(both):
    _, drafter, hs, ids, lm = both
    anchors = torch.tensor([[4, 6, 7, 13, 16], [6, 8, 9, 10, 13]])
    ref = logits(drafter, hs, ids, lm, anchors)
    for r in range(2):
        cache, fed = drafter.new_cache(), 0
        for j, a in enumerate(anchors[r].tolist()):
            out = drafter.draft(hs[r:r + 1, fed:a], ids[r, a], a, cache); fed = a
            assert out.shape == (1, B - 1, ref.shape[-1])
            assert torch.allclose(out[0], ref[r, j], atol=1e-4)
    # crop back (a rejected draft) and regrow; a batch of two drafts at once
    cache.crop(9)
    assert len(cache) == 9
    assert torch.allclose(drafter.draft(hs[1:, 9:13], ids[1, 13], 13, cache)[0], ref[1, 4], atol=1e-4)
    two = drafter.draft(hs[:, :7], ids[:, 7], 7, DraftCache())
    assert torch.allclose(two[0], logits(drafter, hs, ids, lm, torch.tensor([[7], [7]]))[0, 0], atol=1e-4)

def test_draft_refuses_a_context_gap(setup):
    _, drafter, hs, ids, _ = setup
    cache = drafter.new_cache()
    drafter.draft(hs[:1, :5], ids[0, 5], 5, cache)
    with pytest.raises(ValueError, match='cache holds 5 and 1 new'): drafter.draft(hs[:1, 5:6], ids[0, 7], 7, cache)
    assert len(cache) == 5                                           # a refused call leaves the cache as it was

# --- checkpoint --------------------------------------------------------------------------------------

EXPECTED_LAYER_KEYS = ['self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj.weight',
                       'self_attn.o_proj.weight', 'self_attn.q_norm.weight', 'self_attn.k_norm.weight',
                       'mlp.gate_proj.weight', 'mlp.up_proj.weight', 'mlp.down_proj.weight',
                       'input_layernorm.weight', 'post_attention_layernorm.weight']

def expected_keys(n_layers):
    return {f'layers.{i}.{k}' for i in range(n_layers) for k in EXPECTED_LAYER_KEYS} | {'fc.weight', 'hidden_norm.weight', 'norm.weight'}

def test_checkpoint_format_and_round_trip(both, tmp_path, tok):
    target, drafter, hs, ids, lm = both
    save_drafter(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'model.safetensors']
    with safe_open(tmp_path / 'model.safetensors', 'pt') as f: assert set(f.keys()) == expected_keys(2)
    j = json.loads((tmp_path / 'config.json').read_text())
    for k in ['hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
              'head_dim', 'rms_norm_eps', 'max_position_embeddings', 'vocab_size']:
        assert j[k] == getattr(drafter.config, k), k
    assert j['model_type'] == 'qwen3' and j['architectures'] == ['DFlashDraftModel'] and j['tie_word_embeddings'] is False
    assert j['rope_parameters']['rope_theta'] > 0 and j['layer_types'] == ['full_attention'] * 2
    assert j['vocab_size'] == target.config.vocab_size and j['block_size'] == B and j['num_target_layers'] == 4
    assert j['dflash_config'] == {'mask_token_id': tok.mask_token_id, 'target_layer_ids': [1, 2]}
    back = DFlashDraftModel.from_pretrained(tmp_path).attach_target(target).eval()
    assert torch.equal(logits(back, hs, ids, lm, ANCHORS), logits(drafter, hs, ids, lm, ANCHORS))

def published(tmp_path, style):
    "A drafter checkpoint as others publish it: hand-written config.json and safetensors of the named tensors."
    H, I, heads, kvh, d, V, n = 64, 96, 4, 2, 16, 300, 3
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kvh, "head_dim": d,
           "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "hidden_act": "silu",
           "attention_bias": False, "dtype": "bfloat16", "layer_types": ["full_attention"] * n}
    if style == 'transformers4':   # z-lab's Qwen3-4B/8B drafters: legacy rope keys, tied flag, auto_map, block_size on top
        cfg.update({"rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": True, "block_size": 16,
                    "num_target_layers": 36, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                    "use_sliding_window": False, "sliding_window": None,
                    "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 9, 17, 25, 33]}})
    else:                          # newer ones: rope_parameters, block_size inside dflash_config, no num_target_layers
        cfg.update({"rope_parameters": {"rope_type": "default", "rope_theta": 10000000}, "tie_word_embeddings": False,
                    "use_sliding_window": True, "sliding_window": 4096,
                    "dflash_config": {"block_size": 8, "mask_token_id": 298, "target_layer_ids": [1, 7, 14, 20]}})
    taps = len(cfg['dflash_config']['target_layer_ids'])
    shapes = {'fc.weight': (H, taps * H), 'hidden_norm.weight': (H,), 'norm.weight': (H,)}
    for i in range(n):
        shapes.update({f'layers.{i}.self_attn.q_proj.weight': (heads * d, H), f'layers.{i}.self_attn.k_proj.weight': (kvh * d, H),
                       f'layers.{i}.self_attn.v_proj.weight': (kvh * d, H), f'layers.{i}.self_attn.o_proj.weight': (H, heads * d),
                       f'layers.{i}.self_attn.q_norm.weight': (d,), f'layers.{i}.self_attn.k_norm.weight': (d,),
                       f'layers.{i}.mlp.gate_proj.weight': (I, H), f'layers.{i}.mlp.up_proj.weight': (I, H),
                       f'layers.{i}.mlp.down_proj.weight': (H, I), f'layers.{i}.input_layernorm.weight': (H,),
                       f'layers.{i}.post_attention_layernorm.weight': (H,)})
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    save_file(tensors, tmp_path / 'model.safetensors', metadata={'format': 'pt'})
    return cfg, tensors

@pytest.mark.parametrize('style', ['transformers4', 'transformers5'])
def test_loads_published_checkpoints(tmp_path, style):
    cfg, tensors = published(tmp_path, style)
    m = DFlashDraftModel.from_pretrained(tmp_path)
    sd = m.state_dict()
    assert set(sd) == set(tensors) and all(torch.equal(sd[k], tensors[k]) for k in tensors)
    dc = cfg['dflash_config']
    assert m.target_layer_ids == dc['target_layer_ids'] and m.mask_token_id == dc['mask_token_id']
    assert m.block_size == (16 if style == 'transformers4' else 8)
    theta = cfg.get('rope_theta') or cfg['rope_parameters']['rope_theta']
    assert m.config.rope_parameters['rope_theta'] == theta
    # it drafts, with any embeddings/head of the right shape
    emb = torch.nn.Embedding(300, 64).requires_grad_(False); head = torch.nn.Linear(64, 300, bias=False).requires_grad_(False)
    m = m.float().attach_target(embed_tokens=emb, lm_head=head)
    out = m.draft(torch.randn(1, 5, len(dc['target_layer_ids']) * 64), 7, 5, m.new_cache())
    assert out.shape == (1, m.block_size - 1, 300) and torch.isfinite(out).all()

def test_load_target_io_reads_only_embeddings_and_head(both, tmp_path):
    target, drafter, hs, ids, lm = both
    target.save_pretrained(tmp_path)
    emb, head = load_target_io(tmp_path)
    assert torch.equal(emb.weight, target.get_input_embeddings().weight)
    assert torch.equal(head.weight, target.get_output_embeddings().weight)
    assert not emb.weight.requires_grad and not head.weight.requires_grad
    other = DFlashDraftModel(drafter.config)
    other.load_state_dict(drafter.state_dict())
    other.attach_target(embed_tokens=emb, lm_head=head).eval()
    assert torch.equal(logits(other, hs, ids, lm, ANCHORS), logits(drafter, hs, ids, lm, ANCHORS))

def test_refuses_other_drafter_architectures():
    cfg = drafter_config(qwen3_target(100), num_hidden_layers=1, mask_token_id=3, architectures=['DFlash2DraftModel'])
    with pytest.raises(ValueError, match='DFlash2DraftModel'): DFlashDraftModel(cfg)

# --- D-PACE -------------------------------------------------------------------------------------------

def dpace_direct(ce, labels, alpha=0.5):
    "D-PACE weights term by term: q~_i = (1-alpha) exp(-CE_i) + alpha, w_j = sum_{m>=j} prod_{i<=m} q~_i, a slot without a label ending the chain."
    out = torch.zeros(ce.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in ce.shape[:-1]]).tolist():
        idx = tuple(idx) if isinstance(idx, list) else (idx,)
        qt = [((1 - alpha) * math.exp(-c) + alpha) if y != -100 else 0. for c, y in zip(ce[idx].tolist(), labels[idx].tolist())]
        out[idx] = torch.tensor([sum(math.prod(qt[:m + 1]) for m in range(j, len(qt))) for j in range(len(qt))])
    return out

def test_dpace_weights_against_a_direct_implementation():
    from dflash.loss import dpace_weights, _loss_weights
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(3, 4, 5, generator=g) * 3
    labels = torch.randint(5, 50, (3, 4, 5), generator=g)
    labels[0, 1, 3:] = -100; labels[1, 2, 1] = -100; labels[2] = -100; labels[1, 3] = -100     # ends, a hole, empty blocks, an empty row
    for alpha in (0.0, 0.5, 1.0):
        want = dpace_direct(ce, labels, alpha)
        assert torch.allclose(dpace_weights(ce, labels != -100, alpha).double(), want, atol=1e-6)
        w, norm = _loss_weights(labels, ce[labels != -100], 'dpace', alpha=alpha)
        per_seq = torch.tensor([4., 3., 1.])                                   # blocks with a label per sequence (the last: none)
        assert torch.allclose(w.double(), (want / per_seq[:, None, None])[labels != -100], atol=1e-6) and norm == 2
    assert torch.allclose(dpace_weights(ce, labels != -100, 1.0)[0, 0], torch.tensor([5., 4., 3., 2., 1.]))   # alpha 1: the slots left
    with pytest.raises(ValueError, match='dpace_alpha'): dpace_weights(ce, labels != -100, 1.5)

def test_dpace_loss_of_the_forward(setup):
    _, drafter, hs, ids, lm = setup
    anchors = torch.tensor([[5, 11, 17], [7, 12, 0]]); valid = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = drafter(hs, ids, lm, anchors=anchors, anchor_valid=valid, return_logits=True, loss='dpace', dpace_alpha=0.3)
    keep = out.labels != -100
    ce = torch.zeros(keep.shape).masked_scatter(keep, F.cross_entropy(out.logits[keep].float(), out.labels[keep], reduction='none'))
    w = dpace_direct(ce.detach(), out.labels, 0.3)
    per_seq = keep.any(-1).sum(-1)
    want = sum((w[r] * ce[r].double()).sum() / per_seq[r] for r in range(2)) / 2
    assert torch.allclose(out.loss.double(), want, atol=1e-5) and out.weight == 2 and per_seq.tolist() == [3, 2]
    out.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    drafter.zero_grad(set_to_none=True)
    decay = drafter(hs, ids, lm, anchors=anchors, anchor_valid=valid)
    assert not torch.allclose(decay.loss, out.loss) and torch.allclose(decay.weight, slot_weights(B).expand_as(keep)[keep].sum())
    with pytest.raises(ValueError, match="'decay', 'dpace', 'tree@N' or 'treegrad@N'"): drafter(hs, ids, lm, loss='pace')

def test_logit_transforms_and_embedding_scale(setup):
    "`output_multiplier`, `final_logit_softcapping` and `input_embedding_scale` (from dflash_config, else the top level) in the loss and its gradient."
    target, drafter, hs, ids, lm = setup
    cfg = DFlashConfig(**drafter.config.to_dict())
    cfg.dflash_config.update(output_multiplier=0.5, input_embedding_scale=2.0); cfg.final_logit_softcapping = 3.0
    d = DFlashDraftModel(cfg).attach_target(target); d.load_state_dict(drafter.state_dict())
    assert d.logit_transform == (0.5, 3.0)
    h = torch.randn(3, 64)
    z = target.get_output_embeddings()(h)
    assert torch.allclose(d.logits(h), torch.tanh(0.5 * z / 3.0) * 3.0, atol=1e-6)
    assert torch.allclose(d.embed(torch.tensor([5])), 2.0 * drafter.embed(torch.tensor([5])))
    out = d(hs, ids, lm, anchors=ANCHORS, return_logits=True)
    keep = out.labels != -100
    wk = slot_weights(B).expand_as(out.labels)[keep]
    want = (wk * F.cross_entropy(out.logits[keep], out.labels[keep], reduction='none')).sum() / wk.sum()
    assert torch.allclose(out.loss, want, atol=1e-5) and out.logits.abs().max() <= 3.0
    d.zero_grad(); out.loss.backward(retain_graph=True); g1 = d.fc.weight.grad.clone()
    d.zero_grad(); want.backward(); g2 = d.fc.weight.grad.clone()                           # autograd through the returned logits
    assert torch.allclose(g1, g2, atol=1e-6) and g1.abs().sum() > 0

# --- is_causal ----------------------------------------------------------------------------------------

MIXED = ['sliding_attention', 'full_attention']

@pytest.mark.parametrize('flag', [None, True, False])
def test_is_causal_sets_every_layer_in_training_and_drafting(setup, tmp_path, flag):
    target, drafter, hs, ids, lm = setup
    cfg = drafter_config(target.config, 2, B, drafter.mask_token_id, [1, 2], layer_types=MIXED, sliding_window=6, is_causal=flag)
    assert cfg.causal_layers == ([True, False] if flag is None else [flag] * 2)
    d = DFlashDraftModel(cfg).attach_target(target).eval(); d.load_state_dict(drafter.state_dict())
    anchors = torch.tensor([[4, 9, 13, 16], [6, 8, 10, 13]])
    ref = logits(d, hs, ids, lm, anchors)
    for r in range(2):
        cache, fed = d.new_cache(), 0
        for j, a in enumerate(anchors[r].tolist()):
            assert torch.allclose(d.draft(hs[r:r + 1, fed:a], ids[r, a], a, cache)[0], ref[r, j], atol=1e-4); fed = a
    save_drafter(d, tmp_path)
    j = json.loads((tmp_path / 'config.json').read_text())
    assert j.get('is_causal', 'absent') == ('absent' if flag is None else flag)
    assert j['dflash_config'].get('causal', 'absent') == ('absent' if flag is None else flag)   # vLLM's flag: mixed layers, none
    back = DFlashDraftModel.from_pretrained(tmp_path).attach_target(target).eval()
    assert back.config.causal_layers == cfg.causal_layers and torch.equal(logits(back, hs, ids, lm, anchors), ref)
    if flag is not None:                                              # not the per-layer rule: some layer changed
        rule = DFlashDraftModel(drafter_config(target.config, 2, B, drafter.mask_token_id, [1, 2], layer_types=MIXED, sliding_window=6))
        rule.load_state_dict(drafter.state_dict())
        assert not torch.allclose(logits(rule.attach_target(target).eval(), hs, ids, lm, anchors), ref, atol=1e-4)

def test_causal_flag_for_servers():
    sl = drafter_config(qwen3_target(100), 2, layer_types=['sliding_attention'] * 2, sliding_window=8)
    assert sl.dflash_config['causal'] is True and sl.causal_layers == [True, True] and 'is_causal' not in sl.to_dict()
    assert drafter_config(qwen3_target(100), 2, is_causal=True).dflash_config['causal'] is True
    with pytest.warns(UserWarning, match='without a top-level is_causal'):    # a checkpoint whose flags disagree: the reference's rule, said
        c = DFlashConfig(**{**sl.to_dict(), 'dflash_config': {**sl.dflash_config, 'causal': False}})
    assert c.causal_layers == [True, True] and c.dflash_config['causal'] is True


@pytest.mark.parametrize('kind', ['granite', 'gemma2'])
def test_a_distribution_term_reads_the_targets_own_logits(kind):
    """A target whose logits are its head's transformed (Granite divides by `logits_scaling`, Gemma2 soft-caps): with the target's
    transform (`teacher_transform`, what the trainer passes), the KL term is against the target's real logits, position for position."""
    from transformers import GraniteConfig, Gemma2Config
    from dflash.taps import logit_transform
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256)
    cfg = GraniteConfig(**common, logits_scaling=4.0) if kind == 'granite' else Gemma2Config(**common, final_logit_softcapping=0.05)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    d = DFlashDraftModel(drafter_config(cfg, 1, 4, 96, [0, 1])).attach_target(target)
    ids = torch.randint(0, 96, (1, 24)); lm = torch.ones_like(ids)
    with torch.no_grad():
        o = target(ids, output_hidden_states=True)
        hs = torch.cat([o.hidden_states[1], o.hidden_states[2]], -1)        # the taps: layers 0 and 1's outputs
        anchors = torch.tensor([[3, 9, 15]])
        out = d(hs, ids, lm, anchors=anchors, terms='kl', final_hidden=o.hidden_states[-1], teacher_transform=logit_transform(cfg),
                return_logits=True)
        plain = d(hs, ids, lm, anchors=anchors, terms='kl', final_hidden=o.hidden_states[-1], return_logits=True)
    keep = out.labels != -100
    r, a, k = keep.nonzero().T
    want = F.kl_div(out.logits[keep].float().log_softmax(-1), o.logits[r, anchors[r, a] + k].float().softmax(-1), reduction='none').sum(-1)
    w = slot_weights(4).expand_as(keep)[keep]
    assert torch.allclose(out.loss, (w * want).sum() / w.sum(), atol=1e-5)
    assert not torch.allclose(plain.loss, out.loss, atol=1e-4), "the drafter's own transform is not the target's here"
