"""Our checkpoints in z-lab's reference drafter class (PyPI `dflash==0.1.0`, unpacked by the Makefile into the venv's
`zlab/`, loaded by path since its import name is ours): the same logits for full and sliding-window layouts, on contexts
longer than the window. The reference honours `sliding_window` on sdpa by building its own mask (a sliding layer causal
inside the block by default), so the windowed semantics are checked against its code, not against ours."""
import importlib.util, json, sys
from pathlib import Path
import pytest, torch
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
