"""dflash.xpress against speculators 0.9.0's XPress refiner: the fixture tools/xpress_fixture.py recorded from their
`XPressRefinerHead` (tests/fixtures/xpress_reference.*) loads into our `XPressHead` under its names renamed to ours (vLLM 0.34's)
and gives the same block features, bias and one greedy pass. Then the whole drafter: tools/xpress_model_fixture.py recorded their
`XPressDraftModel` (tests/fixtures/xpress_model_reference.*); ours, holding its checkpoint, gives the same backbone and refined logits,
Jacobi rounds and loss (up to its denominator, see below)."""
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


# ---- the whole drafter: tools/xpress_model_fixture.py recorded speculators 0.9.0's `XPressDraftModel` (tests/fixtures/xpress_model_reference.*)
from torch import nn
from transformers import Qwen3Config
from dflash.model import _block_states
from dflash.loss import slot_weights
from dflash.xpress import XPressDraftModel, xpress_config, jacobi, XPRESS, _refine_inputs

MODEL = Path(__file__).resolve().parent / 'fixtures' / 'xpress_model_reference'


def model_fixture(perturb=None):
    """Our `XPressDraftModel` on their tiny config, holding their checkpoint (backbone names as they are, `refiner_head.*` through
    `from_speculators`; strict: every tensor of ours from theirs and back), their verifier's embeddings and head attached.
    `perturb`: `(name, index)` of ours, an element moved by 0.05 after loading."""
    meta, t = json.loads(MODEL.with_suffix('.json').read_text()), load_file(str(MODEL.with_suffix('.safetensors')))
    c = meta['config']
    tc = Qwen3Config(vocab_size=c['vocab_size'], hidden_size=c['hidden_size'], intermediate_size=c['intermediate_size'],
                     num_hidden_layers=c['verifier_layers'], num_attention_heads=c['num_attention_heads'],
                     num_key_value_heads=c['num_key_value_heads'], head_dim=c['head_dim'], rms_norm_eps=c['rms_norm_eps'],
                     rope_theta=c['rope_theta'], max_position_embeddings=c['max_position_embeddings'], tie_word_embeddings=False)
    assert c['target_layer_ids'] == [i - 1 for i in c['aux_hidden_state_layer_ids']]     # vLLM's mapping of their taps
    cfg = xpress_config(tc, c['draft_layers'], c['block_size'], c['mask_token_id'], c['target_layer_ids'], xpress_rank=c['xpress_rank'],
                        xpress_mlp_hidden=c['xpress_rank'] * c['xpress_mlp_ratio'])
    model = XPressDraftModel(cfg).eval()
    model.load_state_dict(from_speculators({k: t[k] for k in meta['keys']}), strict=True)
    if perturb is not None:
        with torch.no_grad(): model.get_parameter(perturb[0])[perturb[1]] += 0.05
    emb = nn.Embedding.from_pretrained(t['verifier.embed_tokens.weight'])
    head = nn.Linear(c['hidden_size'], c['vocab_size'], bias=False); head.weight.data.copy_(t['verifier.lm_head.weight'])
    return model.attach_target(embed_tokens=emb, lm_head=head), t, meta


def states(model, t):
    "Our backbone's final states of every slot [1, A, B, H] at their anchors, and its logits."
    with torch.no_grad():
        h = _block_states(model, t['in.hidden_states'], t['in.input_ids'], t['in.loss_mask'], t['in.anchors'][None], attn_impl='sdpa')[0]
        return h, model.logits(h).float()


def forward(model, t, terms='ce'):
    return model(t['in.hidden_states'], t['in.input_ids'], t['in.loss_mask'], anchors=t['in.anchors'][None], terms=terms,
                 final_hidden=t['in.final_hidden'], return_logits=True, attn_impl='sdpa')


def test_the_fixture_is_theirs_and_informative():
    _, t, meta = model_fixture()
    ids, a = t['in.input_ids'][0], t['in.anchors']
    assert meta['sha256']['models/xpress/core.py'] and meta['sha256']['models/xpress/model_definitions.py']
    assert torch.equal(ids[a - 1], ids[a])              # x_(p-1) = x_p: their token before slot 0 is ours (the anchor)
    assert t['refiner_head.mix_l'].abs().sum() > 0       # the mixer mixes
    base, tf, r = t['out.base_logits'], t['out.refined_logits'], t['out.round_tokens']
    assert (tf[:, 1:].argmax(-1) != base[:, 1:].argmax(-1)).any()                      # the bias moves argmaxes
    assert (r[0, :, 1:] != r[1, :, 1:]).any()                                          # a second round changes tokens
    assert MODEL.with_suffix('.safetensors').stat().st_size < 1 << 20


def test_the_drafter_equals_speculators():
    """The backbone's logits of every slot and the teacher-forced refined logits of the drafted slots (the token before slot k the
    true x_(p+k-1); before slot 0 theirs is x_(p-1), ours the anchor: equal here, see the tool) agree with theirs, and so their argmax."""
    model, t, _ = model_fixture()
    h, base = states(model, t)
    assert torch.allclose(base[0], t['out.base_logits'], atol=1e-4), (base[0] - t['out.base_logits']).abs().max()
    with torch.no_grad(): out = forward(model, t)
    ref = t['out.refined_logits'][:, 1:]
    assert torch.allclose(out.logits[0], ref, atol=1e-4), (out.logits[0] - ref).abs().max()
    assert torch.equal(out.logits[0].argmax(-1), ref.argmax(-1))


def test_the_jacobi_rounds_equal_speculators():
    """Their consistency rounds are the Jacobi passes from the backbone's argmax: pass j's argmax of slots 1..B-1 (and the first pass's
    logits) equals their round j's, both from our training states and from our serving path (`draft_states` over the context before
    each anchor, the anchor as the token before slot 0), which no training code of theirs runs."""
    model, t, _ = model_fixture()
    h, base = states(model, t)
    hs, anchor, r = model.xpress_head.states(h[0]), t['in.input_ids'][0, t['in.anchors']], t['out.round_tokens']
    with torch.no_grad():
        blk, z = jacobi(model.xpress_head, hs, base[0], anchor, anchor, 1, refined=True)
        assert torch.allclose(z[:, 1:], t['out.round1_logits'][:, 1:], atol=1e-4)
        for j in range(len(r)):
            assert torch.equal(jacobi(model.xpress_head, hs, base[0], anchor, anchor, j + 1)[:, 1:], r[j, :, 1:]), j
        for i, p in enumerate(t['in.anchors'].tolist()):
            hs1, base1, a1 = _refine_inputs(model, t['in.hidden_states'][:, :p], t['in.input_ids'][:, p], p)
            assert torch.allclose(base1[0], base[0, i], atol=1e-4)
            for j in range(len(r)): assert torch.equal(jacobi(model.xpress_head, hs1, base1, a1, a1, j + 1)[0, 1:], r[j, i, 1:]), (i, j)


def test_the_loss_equals_speculators_up_to_its_denominator():
    """L = C(refined) + 0.3 mean_j C(round j) + 0.6 C(base), each C decayed exp(-(k-1)/4) over slots k >= 1, CE against the data token
    (theirs with `ce_from_data=True`), then `ce:0.1,tv:0.9` (their default, TV against the verifier's logits at p+k-1). One definition
    differs: we divide by the sum of the decay weights of the labelled slots, they by their count (speculators/losses/utils.py:296-299
    and speculators/models/xpress/metrics.py:54, eps 1e-5 and 1e-8), so theirs = ours * sum(w) / count, term by term."""
    model, t, meta = model_fixture()
    out = forward(model.train(), t)                     # training: the three scores (held out, eval mode, the refined alone)
    keep = out.labels[0] != -100
    w = slot_weights(meta['config']['block_size'], meta['gamma']).expand_as(keep)[keep]
    assert torch.equal(keep, t['out.aligned_loss_mask'][:, 1:].bool()) and XPRESS['gamma'] == meta['gamma']
    assert (XPRESS['rounds'], XPRESS['consistency'], XPRESS['base']) == (meta['consistency_passes'], meta['consistency_weight'],
                                                                           meta['base_anchor_weight'])
    scale = float(w.sum()) / keep.sum().item()
    for spec, name in (('ce', 'ce'), ('ce:0.1,tv:0.9', 'ce:0.1,tv:0.9')):
        o = out if spec == 'ce' else forward(model, t, spec)
        m = meta['loss'][name]['metrics']
        for ours, theirs in (('refined', 'tf_loss_sum'), ('rounds', 'consistency_loss_sum'), ('base', 'base_anchor_loss_sum')):
            assert abs(float(o.terms[ours]) * scale - m[theirs]) < 1e-5 * m[theirs], (spec, ours, float(o.terms[ours]) * scale, m[theirs])
        assert abs(o.loss.item() * scale - meta['loss'][name]['loss']) < 1e-5 * meta['loss'][name]['loss'], spec
    assert out.correct.sum().item() == meta['loss']['ce']['metrics']['accuracy_sum']    # hits: refined argmax == the data token
    with torch.no_grad(): ev = forward(model.eval(), t)
    assert abs(float(ev.loss) - float(out.terms['refined'])) < 1e-6 and set(ev.terms) == {'refined'}


def test_a_perturbed_weight_breaks_the_match():
    """The checks above can fail: one element of one weight moved, of the backbone or of the refiner, moves the logits past the tolerance
    (the refiner's: a mixer weight slot 2 reads from slot 1, and the embedding of the anchor token, the token before slot 1)."""
    _, t, _ = model_fixture()
    tok = t['in.input_ids'][0, t['in.anchors'][0]].item()
    for where in (('layers.1.self_attn.k_proj.weight', (0, 0)), ('fc.weight', (0, 0)), ('xpress_head.mix.L', (0, 2, 1)),
                  ('xpress_head.w1.weight', (tok, 0))):
        model, t, _ = model_fixture(perturb=where)
        with torch.no_grad(): out = forward(model, t)
        assert not torch.allclose(out.logits[0], t['out.refined_logits'][:, 1:], atol=1e-4), where
