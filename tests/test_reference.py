"""Our checkpoints in z-lab's reference drafter classes (PyPI `dflash==0.1.0`, unpacked by the Makefile into the venv's
`zlab/`, loaded by path since its import name is ours): the same logits for full and sliding-window layouts, on contexts
longer than the window, with `is_causal` absent or set; DFlash2 checkpoints (ours, and one in the published layout) give
the same logits and the same selected path; the sampling warp is the same. The reference honours `sliding_window` on sdpa by building its own mask (a sliding layer causal
inside the block by default), so the windowed semantics are checked against its code, not against ours."""
import importlib.util, json, sys
from pathlib import Path
import pytest, torch
from conftest import write_published_dflash2
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter
from dflash.taps import capture

REF = Path(sys.prefix) / 'zlab' / 'dflash' / 'model.py'
LAYOUTS = {'full': (['full_attention'] * 3, None),
           'published': (['sliding_attention'] * 2 + ['full_attention'], 7),   # the Qwen3.6-27B drafter's layout, small W
           'all-sliding': (['sliding_attention'] * 3, 5)}


@pytest.fixture(scope='module')
def zlab():
    assert REF.exists(), f'{REF} is missing: `make setup` unpacks the reference class there'
    spec = importlib.util.spec_from_file_location('zlab_dflash_model', REF)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope='module')
def target(make_target):
    return make_target('qwen3', layers=8, hidden=64)


def _drafter(target, tok, layout, seed=0):
    types, w = LAYOUTS[layout]
    torch.manual_seed(seed)
    d = DFlashDraftModel(drafter_config(target.config, 3, 4, tok.mask_token_id, layer_types=types, sliding_window=w))
    with torch.no_grad():                                   # larger weights than the init, so that attention matters
        for p in d.parameters():
            if p.dim() == 2: p.normal_(0, 0.15)
    return d.attach_target(target).eval()


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_reference_class_loads_our_checkpoint_and_drafts_the_same(zlab, target, tok, tmp_path, layout):
    ours = _drafter(target, tok, layout)
    save_drafter(ours, tmp_path)
    c = json.loads((tmp_path / 'config.json').read_text())
    types, w = LAYOUTS[layout]
    assert c['layer_types'] == types and c['sliding_window'] == w and c['dflash_config'].get('swa_window_size') == w
    ref = zlab.DFlashDraftModel.from_pretrained(tmp_path, attn_implementation='sdpa').eval()
    assert [l.self_attn.sliding_window for l in ref.layers] == ours.config.windows
    assert [l.self_attn.is_causal for l in ref.layers] == [t == 'sliding_attention' for t in types]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tok), (1, 40), generator=g)
    taps = capture(target, ids, layer_ids=ours.target_layer_ids)
    cache, fed, head = ours.new_cache(), 0, target.get_output_embeddings()
    for S in (3, 12, 25, 39):                                # contexts shorter and longer than the window
        got = ours.draft(taps[:, fed:S], ids[0, S], S, cache); fed = S
        noise = target.get_input_embeddings()(ours.noise_ids(ids[:, S]))
        with torch.no_grad():
            h = ref(position_ids=torch.arange(S + 4)[None], noise_embedding=noise, target_hidden=taps[:, :S])
            want = head(h[:, 1:])
        assert torch.allclose(got, want, atol=1e-4), (layout, S, (got - want).abs().max())
    if layout != 'full':                                     # the window is visible: the same weights, all full, draft otherwise
        full = _drafter(target, tok, 'full'); full.load_state_dict(ours.state_dict())
        assert not torch.allclose(full.draft(taps[:, :39], ids[0, 39], 39), got, atol=1e-3)


@pytest.mark.parametrize('layout', ['published', 'all-sliding'])
def test_sliding_drafter_decodes_losslessly(target, tok, layout):
    "Speculative decoding with a windowed drafter (contexts well past the window) gives the target's own greedy output."
    from dflash.evaluate import DFlashDrafter, greedy_decode, spec_decode
    d = _drafter(target, tok, layout)
    prompt = torch.randint(4, len(tok), (20,), generator=torch.Generator().manual_seed(2)).tolist()
    got, steps = spec_decode(target, DFlashDrafter(d), prompt, max_new_tokens=40, block_size=4)
    assert got == greedy_decode(target, prompt, 40) and 1 + sum(a + 1 for a, _ in steps) == len(got) == 40


# --- is_causal, DFlash2, sampling ---------------------------------------------------------------------

CAUSAL = {'mixed, is_causal false': (['sliding_attention', 'sliding_attention', 'full_attention'], 7, False),
          'full, is_causal true': (['full_attention'] * 3, None, True)}


@pytest.mark.parametrize('layout', list(CAUSAL))
def test_reference_class_reads_is_causal_as_we_write_it(zlab, target, tok, tmp_path, layout):
    "A top-level `is_causal` sets every layer, in the reference class as in ours (training rule and drafting alike)."
    types, w, flag = CAUSAL[layout]
    torch.manual_seed(0)
    ours = DFlashDraftModel(drafter_config(target.config, 3, 4, tok.mask_token_id, layer_types=types, sliding_window=w, is_causal=flag))
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 2: p.normal_(0, 0.15)
    ours.attach_target(target).eval()
    save_drafter(ours, tmp_path)
    c = json.loads((tmp_path / 'config.json').read_text())
    assert c['is_causal'] is flag and c['dflash_config']['causal'] is flag
    ref = zlab.DFlashDraftModel.from_pretrained(tmp_path, attn_implementation='sdpa').eval()
    assert [l.self_attn.is_causal for l in ref.layers] == ours.config.causal_layers == [flag] * 3
    ids = torch.randint(4, len(tok), (1, 40), generator=torch.Generator().manual_seed(1))
    taps = capture(target, ids, layer_ids=ours.target_layer_ids)
    cache, fed, head = ours.new_cache(), 0, target.get_output_embeddings()
    for S in (3, 12, 25, 39):
        got = ours.draft(taps[:, fed:S], ids[0, S], S, cache); fed = S
        with torch.no_grad():
            h = ref(position_ids=torch.arange(S + 4)[None], noise_embedding=target.get_input_embeddings()(ours.noise_ids(ids[:, S])),
                    target_hidden=taps[:, :S])
        assert torch.allclose(got, head(h[:, 1:]), atol=1e-4), (layout, S)


D2 = {'mixed': (['sliding_attention', 'sliding_attention', 'full_attention'], 9, None, {}),      # W >= B: see test_window_inside_the_block
      'mixed, is_causal false': (['sliding_attention', 'sliding_attention', 'full_attention'], 9, False, {}),
      'all sliding, is_causal false, logit transforms': (['sliding_attention'] * 3, 9, False,
          dict(output_multiplier=0.5, final_logit_softcapping=4.0, input_embedding_scale=1.5))}


def _dflash2(target, tok, types, w, flag, extra, block=8, seed=0):
    "A DFlash2 drafter with random weights everywhere (convolutions and codebooks included), so that every part matters."
    from dflash.dflash2 import DFlash2DraftModel, dflash2_config
    torch.manual_seed(seed)
    d = DFlash2DraftModel(dflash2_config(target.config, 3, block, tok.mask_token_id, layer_types=types, sliding_window=w, is_causal=flag,
                                         selector_rank=8, selector_top_k=4))
    d.config.dflash_config.update(extra)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if 'base_kernel' in n: p.add_(torch.randn_like(p) * 0.3)
            elif 'codebook' in n or 'hidden_projection' in n: p.normal_(0, 1.0)
            elif p.dim() == 2: p.normal_(0, 0.15)
    return d.attach_target(target).eval()


def _ref_draft(ref, target, noise_ids, taps, S, scale=1.0):
    "The reference class's logits and greedy path for the block at S (its `dflash_generate`, one step, without a cache)."
    head = target.get_output_embeddings()
    with torch.no_grad():
        h = ref(position_ids=torch.arange(S + noise_ids.shape[1])[None], noise_embedding=target.get_input_embeddings()(noise_ids) * scale,
                target_hidden=taps[:, :S])[:, 1:]
        return ref.compute_logits(h, head), ref.propose(h, noise_ids[:, 0], head, 0.0)[0]


@pytest.mark.parametrize('layout', list(D2))
def test_reference_dflash2_loads_our_checkpoint_and_drafts_the_same(zlab, target, tok, tmp_path, layout):
    "Our DFlash2 checkpoint in the released `DFlash2DraftModel`: the same logits and the same selected path, greedy, at several contexts."
    types, w, flag, extra = D2[layout]
    ours = _dflash2(target, tok, types, w, flag, extra)
    save_drafter(ours, tmp_path)
    ref = zlab.DFlash2DraftModel.from_pretrained(tmp_path, attn_implementation='sdpa').eval()
    assert torch.equal(ref.candidate_selector.successor_codebook.weight, ours.candidate_selector.successor_codebook)
    assert torch.equal(ref.layers[1].mlp_conv.base_kernel, ours.layers[1].mlp_conv.base_kernel)
    assert [l.self_attn.is_causal for l in ref.layers] == ours.config.causal_layers
    ids = torch.randint(4, len(tok), (1, 40), generator=torch.Generator().manual_seed(1))
    taps = capture(target, ids, layer_ids=ours.target_layer_ids)
    cache, fed, moved = ours.new_cache(), 0, False
    for S in (3, 12, 25, 31):                                # contexts shorter and longer than the window
        path, cand, _ = ours.propose(taps[:, fed:S], ids[0, S], S, cache); fed = S
        got = ours.draft(None, ids[0, S], S, cache)
        want, ref_path = _ref_draft(ref, target, ours.noise_ids(ids[:, S]), taps, S, extra.get('input_embedding_scale', 1.0))
        assert torch.allclose(got, want, atol=1e-4), (layout, S, (got - want).abs().max())
        assert torch.equal(path, ref_path), (layout, S)
        moved |= not torch.equal(path, got.argmax(-1))
    assert moved                                              # the selector re-ranked somewhere: the path is not the head's argmax


def test_published_dflash2_checkpoint_loads_and_drafts_the_same(zlab, target, tok, tmp_path):
    "A DFlash2 checkpoint as published (hand-written: bare codebook names, is_causal false, all sliding, block 8) in ours and the reference."
    from dflash.dflash2 import DFlash2DraftModel
    tensors, taps_ = write_published_dflash2(tmp_path, tok), [1, 3, 5]
    ours = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).attach_target(target).eval()
    sd = ours.state_dict()
    assert set(sd) == set(tensors) and all(torch.equal(sd[k], tensors[k].float()) for k in tensors)
    assert ours.block_size == 8 and ours.config.causal_layers == [False] * 3 and ours.config.windows == [9] * 3
    assert ours.config.is_causal is False and ours.config.dflash_config['causal'] is False and ours.candidate_selector.top_k == 4
    ref = zlab.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation='sdpa').eval()
    ids = torch.randint(4, len(tok), (1, 40), generator=torch.Generator().manual_seed(1))
    taps = capture(target, ids, layer_ids=taps_)
    cache, fed = ours.new_cache(), 0
    for S in (3, 12, 25, 31):
        path, _, _ = ours.propose(taps[:, fed:S], ids[0, S], S, cache); fed = S
        want, ref_path = _ref_draft(ref, target, ours.noise_ids(ids[:, S]), taps, S)
        assert torch.allclose(ours.draft(None, ids[0, S], S, cache), want, atol=1e-4) and torch.equal(path, ref_path), S


@pytest.mark.parametrize('T,top_p,top_k', [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.6, 1.0, 20), (1.3, 0.8, 5)])
def test_sampling_probs_match_the_reference(zlab, T, top_p, top_k):
    "Our `sampling_probs` (temperature, then top-k, then top-p) is the reference's `_sampling_probs`."
    from dflash.sampling import sampling_probs
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.allclose(sampling_probs(logits, T, top_p, top_k), zlab._sampling_probs(logits, T, top_p, top_k), atol=1e-6)


@pytest.mark.parametrize('causal', [True, False])
def test_window_inside_the_block(zlab, causal):
    """Our sliding mask and the reference's, for a block of B at anchor n: equal when W >= B (every published drafter: W 2048, B <= 16).
    With W < B the reference also windows the block's own slots (|o - o'| < W); ours windows the context only (SpecForge's rule)."""
    from dflash.blocks import block_mask
    n, B = 12, 8
    for W in (8, 9, 30, 5):
        ours = block_mask(torch.tensor([[n]]), n, B, W, causal)[0]
        ref = zlab._attention_mask(torch.zeros(1, 1, B, 1), torch.zeros(1, 1, n + B, 1), is_causal=causal, sliding_window=W)[0, 0]
        o = torch.arange(B)
        far = (o[:, None] - o[None, :]).abs() >= W
        assert torch.equal(ours[:, :n], ref[:, :n]) and torch.equal(ours[:, n:] & ~far, ref[:, n:])
        assert torch.equal(ours, ref) == (W >= B)
