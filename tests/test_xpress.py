"""dflash.xpress against speculators 0.9.0's XPress refiner: the fixture tools/xpress_fixture.py recorded from their
`XPressRefinerHead` (tests/fixtures/xpress_reference.*) loads into our `XPressHead` under its names renamed to ours (vLLM 0.34's)
and gives the same block features, bias and one greedy pass."""
import json
from pathlib import Path
import torch
from safetensors.torch import load_file
from dflash.xpress import XPressHead, SPECULATORS, from_speculators

FIX = Path(__file__).resolve().parent / 'fixtures' / 'xpress_reference'


def ours():
    meta, t = json.loads(FIX.with_suffix('.json').read_text()), load_file(str(FIX.with_suffix('.safetensors')))
    c = meta['config']
    assert c['draft_vocab_size'] == c['verifier_vocab_size']                 # vLLM 0.34 serves the whole vocabulary only
    head = XPressHead(c['hidden_size'], c['verifier_vocab_size'], c['block_size'], c['rank'], c['mlp_ratio'] * c['rank'])
    sd = from_speculators({'refiner_head.' + k: t[k] for k in meta['keys']})
    head.load_state_dict({k.removeprefix('xpress_head.'): v for k, v in sd.items()})   # strict: every tensor of theirs, renamed
    return head.eval(), t, meta


def test_the_refiner_equals_speculators():
    head, t, meta = ours()
    assert meta['module_sha256'] and t['mix_l'].abs().sum() > 0       # the mixer mixes in the recorded weights
    with torch.no_grad():
        hs = head.states(t['in.hidden_states'])
        bias = head.bias(hs, t['in.prev'])
        drafted = torch.cat([t['in.anchor'][:, None], (t['in.base'] + bias)[:, 1:].argmax(-1)], 1)   # a pass over their prev
    assert torch.allclose(hs, t['out.hidden_cache'], atol=1e-6)
    assert torch.allclose(bias, t['out.block_bias'], atol=1e-5), (bias - t['out.block_bias']).abs().max()
    assert torch.equal(drafted, t['out.one_pass']) and (drafted[:, 1:] != t['in.base'][:, 1:].argmax(-1)).any()   # the bias moved some


def test_their_names_become_vllms():
    head, t, _ = ours()
    sd = head.state_dict()
    for theirs, mine in SPECULATORS.items(): assert torch.equal(sd[mine], t[theirs])
    assert set(sd) == {'w1.weight', 'down_h.weight', 'down_g.weight', 'in_proj.weight', 'mlp_gate.weight', 'mlp_up.weight',
                       'mlp_down.weight', 'w2.weight', 'mix.L'}                  # what vLLM 0.34's loader maps (xpress.ipynb)
