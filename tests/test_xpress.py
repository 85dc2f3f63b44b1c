"""dflash.xpress against speculators 0.9.0's XPress refiner: the fixture tools/xpress_fixture.py recorded from their
`XPressRefinerHead` (tests/fixtures/xpress_reference.*) loads into our `XPressHead` under its own names and gives the same block
features, bias and one greedy pass; and its tensors take vLLM 0.34's names."""
import json
from pathlib import Path
import torch
from safetensors.torch import load_file
from dflash.xpress import XPressHead, vllm_names

FIX = Path(__file__).resolve().parent / 'fixtures' / 'xpress_reference'


def ours():
    meta, t = json.loads(FIX.with_suffix('.json').read_text()), load_file(str(FIX.with_suffix('.safetensors')))
    c = meta['config']
    head = XPressHead(c['hidden_size'], c['verifier_vocab_size'], c['block_size'], c['rank'], c['mlp_ratio'], c['draft_vocab_size'])
    head.load_state_dict({k: t[k] for k in meta['keys']})            # strict: their names are ours, tensor for tensor
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


def test_vllm_takes_the_refiner_under_its_names():
    head, t, _ = ours()
    sd = vllm_names(head)
    assert torch.equal(sd['xpress_head.w1.weight'], t['token_embed.weight'])
    assert torch.equal(sd['xpress_head.w2.weight'], t['readout.weight'])
    assert torch.equal(sd['xpress_head.mix.L'], t['mix_l'])                      # raw: vLLM masks and folds it as it loads
