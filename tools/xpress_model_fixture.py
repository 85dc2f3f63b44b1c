"""Record speculators 0.9.0's whole XPress drafter (`speculators/models/xpress/core.py`, `XPressDraftModel`: their DFlash backbone
and `XPressRefinerHead`) on a tiny fixed config, for tests/test_xpress.py. Run it in the speculators venv (`make peers-venvs`, its
SP_VENV half), on the unzipped wheel:

    .venv-speculators/bin/python -m pip download --no-deps speculators==0.9.0 -d /tmp/sp
    .venv-speculators/bin/python -m zipfile -e /tmp/sp/speculators-0.9.0-py3-none-any.whl /tmp/sp/wheel
    .venv-speculators/bin/python tools/xpress_model_fixture.py /tmp/sp/wheel

The wheel's folder goes first on sys.path, so their code is the wheel's, as it is (its dependencies: the venv's). On CPU their
`forward` is not compiled (`conditional_torch_compile`); the draft layers run transformers' eager attention on their dense float
mask (`_attn_implementation='eager'`: `create_float_mask` of their own `mask_mod`), and the losses are their eager ones.

The drafter: a Qwen3-shaped verifier of 4 layers (vocabulary 128, hidden 48), 2 draft layers, a block of 8, refiner rank 16, the
whole vocabulary drafted, taps `aux_hidden_state_layer_ids` [1, 3, 4] (ours: [0, 2, 3]). Every weight is drawn with a fixed seed,
larger than their init so attention, the mixer (`mix_l`, zero at init) and the refiner's bias all matter: the bias moves about half
the argmaxes. The verifier's embeddings, head and final norm are drawn too and copied into their frozen `embed_tokens`, `lm_head`,
`verifier_lm_head`, `verifier_norm`.

Inputs: one packed sequence of 40 tokens (their forward reads row 0 only), one document, a loss mask with a gap, and 5 fixed anchors
(their `select_anchors` replaced in their DFlash module by one returning them). At every anchor p the token before it equals the
anchor (x_(p-1) = x_p): their training feeds x_(p-1) as the token before slot 0, vLLM and we feed the anchor, and so here both agree.

Runs their forward twice: with the loss `ce` (eager) and `ce_from_data=True` (CE against the data tokens, as ours), and with their
default `{"ce": 0.1, "tv": 0.9}` (eager, `ce_from_data=True`). Their `compute_metrics` is wrapped to record what it is given (the
teacher-forced refined logits, each consistency round's logits, the backbone's logits, the teacher's logits, the aligned loss mask)
and what it returns (the loss and its terms).

Writes tests/fixtures/xpress_model_reference.safetensors (their checkpoint as their `save_pretrained` writes it, under their names;
`verifier.*`: the verifier's embeddings, head and final norm; `in.*`: the inputs; `out.*`: the outputs) and
tests/fixtures/xpress_model_reference.json (version, sha256 of the files run, the config, the anchors, the losses, what each output
means)."""
import argparse, hashlib, json, sys, tempfile
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'tests' / 'fixtures'
NAME = 'xpress_model_reference'
V, H, HEADS, KV_HEADS, INTER, TL, DL, B, R, RATIO = 128, 48, 4, 2, 96, 4, 2, 8, 16, 2
AUX = [1, 3, 4]                      # speculators' aux_hidden_state_layer_ids; ours, as vLLM maps them: each minus 1
MASK = V - 1
S, ANCHORS = 40, [3, 9, 14, 22, 30]
GAP = (17, 20)                       # loss mask 0 at positions 0..1 and 17..19: the block at 14 loses slots 3..5
GAMMA, ROUNDS, CONSISTENCY, BASE = 4.0, 3, 0.3, 0.6
FILES = ['models/xpress/core.py', 'models/xpress/model_definitions.py', 'models/xpress/metrics.py', 'models/dflash/core.py',
         'models/dflash/model_definitions.py', 'models/dflash/attention.py', 'losses/utils.py', 'losses/eager.py']


def verifier_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=TL, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=H // HEADS, max_position_embeddings=128, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)


def build(core, cfg_mod):
    "Their drafter on the tiny config, weights drawn (seed 0), the verifier's weights copied in: `(model, verifier tensors)`."
    tl = verifier_config(); tl.num_hidden_layers = DL; tl._attn_implementation = 'eager'   # the draft layers: as their CLI makes them
    cfg = cfg_mod.XPressSpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=V, block_size=B, aux_hidden_state_layer_ids=AUX,
                                         mask_token_id=MASK, xpress_rank=R, xpress_mlp_ratio=RATIO)
    torch.manual_seed(0)
    model = core.XPressDraftModel(cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    ver = {'verifier.embed_tokens.weight': torch.randn(V, H, generator=g) * 0.5, 'verifier.lm_head.weight': torch.randn(V, H, generator=g) * 0.3,
           'verifier.norm.weight': 1 + 0.1 * torch.randn(H, generator=g)}
    frozen = {'embed_tokens.weight': 'verifier.embed_tokens.weight', 'lm_head.weight': 'verifier.lm_head.weight',
              'verifier_lm_head.weight': 'verifier.lm_head.weight', 'verifier_norm.weight': 'verifier.norm.weight'}
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if n in frozen: p.copy_(ver[frozen[n]])
            elif n.endswith('norm.weight'): p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n == 'refiner_head.mix_l': p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif n == 'refiner_head.token_embed.weight': p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif n == 'refiner_head.readout.weight': p.copy_(0.15 * torch.randn(p.shape, generator=g))
            elif n.startswith('refiner_head.'): p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))
            else: p.copy_(0.2 * torch.randn(p.shape, generator=g))
    assert not any(p.isnan().any() for p in model.parameters())
    return model, ver


def inputs(model):
    "Taps [1, S, 3H], tokens (never the mask token; x_(p-1) = x_p at each anchor), loss mask, the verifier's last states, document ids."
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MASK, (1, S), generator=g)
    for p in ANCHORS: ids[0, p - 1] = ids[0, p]
    lm = torch.ones(1, S, dtype=torch.long); lm[0, :2] = 0; lm[0, GAP[0]:GAP[1]] = 0
    assert all(lm[0, p] == 1 and 0 < p <= S - B - 1 for p in ANCHORS)     # as their `select_anchors` picks them
    x = dict(hidden_states=torch.randn(1, S, len(AUX) * H, generator=g), input_ids=ids, loss_mask=lm,
             verifier_last_hidden_states=torch.randn(1, S, H, generator=g) * 2, document_ids=torch.zeros(1, S, dtype=torch.long))
    with torch.no_grad(): x['final_hidden'] = model.verifier_norm(x['verifier_last_hidden_states'])   # the target's normed final states
    return x


def run(model, core, dcore, losses, x, spec):
    "Their forward (fixed anchors, eager loss `spec`, `ce_from_data`): `(loss, metrics, what compute_metrics was given)`."
    anchors = torch.tensor(ANCHORS)
    dcore.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors.clone(), torch.ones(len(anchors), dtype=torch.bool))
    seen, real = {}, core.compute_metrics
    def record(logits_tf, round_logits, base_logits, targets, loss_mask, *a, **kw):
        seen.update(tf=logits_tf.detach().clone(), rounds=[r.detach().clone() for r in round_logits], base=base_logits.detach().clone(),
                    targets=targets.detach().clone(), mask=loss_mask.detach().clone(), kw=kw)
        return real(logits_tf, round_logits, base_logits, targets, loss_mask, *a, **kw)
    core.compute_metrics = record
    try:
        with torch.no_grad():
            _, loss, metrics = model(**{k: v for k, v in x.items() if k != 'final_hidden'},
                                     loss_config=losses.resolve_loss_config(spec, 'eager'), gamma=GAMMA, max_anchors=len(ANCHORS),
                                     consistency_weight=CONSISTENCY, consistency_passes=ROUNDS, base_anchor_weight=BASE, ce_from_data=True)
    finally: core.compute_metrics = real
    return float(loss), {k: float(v) for k, v in metrics.items()}, seen


def main(a):
    wheel = Path(a.wheel).resolve()
    sys.path.insert(0, str(wheel))
    import speculators
    from speculators.models.xpress import core, config as cfg_mod
    from speculators.models.dflash import core as dcore
    from speculators import losses
    pkg = Path(speculators.__file__).resolve().parent
    if pkg != wheel / 'speculators': raise SystemExit(f'speculators loaded from {pkg}, not the wheel at {wheel}')
    assert not torch.cuda.is_available() or a.allow_cuda, 'run on CPU: on CUDA their forward is torch.compiled'
    model, ver = build(core, cfg_mod)
    x = inputs(model)
    loss_ce, m_ce, seen = run(model, core, dcore, losses, x, 'ce')
    loss_tv, m_tv, seen_tv = run(model, core, dcore, losses, x, '{"ce": 0.1, "tv": 0.9}')
    assert torch.equal(seen['tf'], seen_tv['tf']) and torch.equal(seen['base'], seen_tv['base'])
    A = len(ANCHORS)
    base, tf = seen['base'].view(A, B, V), seen['tf'].view(A, B, V)
    rounds = torch.stack([r.view(A, B, V) for r in seen['rounds']])                          # [ROUNDS, A, B, V]
    moved = (tf[:, 1:].argmax(-1) != base[:, 1:].argmax(-1)).float().mean()
    r_tok = rounds.argmax(-1)
    print(f'bias moved {moved:.0%} of the teacher-forced argmaxes; rounds differ: '
          f'{[(r_tok[j, :, 1:] != r_tok[j + 1, :, 1:]).sum().item() for j in range(ROUNDS - 1)]}', file=sys.stderr)
    assert 0.2 < moved < 0.8 and (r_tok[0] != r_tok[1]).any()
    with tempfile.TemporaryDirectory() as d:                 # their checkpoint, as their save_pretrained writes it
        model.save_pretrained(d)
        from safetensors.torch import load_file
        ckpt = load_file(str(Path(d) / 'model.safetensors'))
    assert not any(k.startswith(('embed_tokens', 'lm_head', 'verifier_')) for k in ckpt), sorted(ckpt)
    sd = model.state_dict()
    assert all(torch.equal(ckpt[k], sd[k]) for k in ckpt)
    tensors = {**{k: v.contiguous() for k, v in ckpt.items()}, **ver,
               **{f'in.{k}': v for k, v in x.items()}, 'in.anchors': torch.tensor(ANCHORS),
               'out.base_logits': base.contiguous(), 'out.refined_logits': tf.contiguous(),
               'out.round_tokens': r_tok.contiguous(), 'out.aligned_loss_mask': seen['mask'].view(A, B).contiguous(),
               'out.round1_logits': rounds[0].contiguous()}
    from safetensors.torch import save_file
    save_file(tensors, str(OUT / f'{NAME}.safetensors'))
    sha = {f: hashlib.sha256((pkg / f).read_bytes()).hexdigest() for f in FILES}
    meta = dict(reference='speculators 0.9.0 (PyPI), speculators/models/xpress/core.py XPressDraftModel', license='Apache-2.0',
                sha256=sha, torch=torch.__version__, transformers=__import__('transformers').__version__,
                config=dict(vocab_size=V, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=H // HEADS,
                            intermediate_size=INTER, verifier_layers=TL, draft_layers=DL, block_size=B, xpress_rank=R,
                            xpress_mlp_ratio=RATIO, aux_hidden_state_layer_ids=AUX, target_layer_ids=[i - 1 for i in AUX],
                            mask_token_id=MASK, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
                            attn_implementation='eager'),
                anchors=ANCHORS, seq_len=S, gamma=GAMMA, consistency_passes=ROUNDS, consistency_weight=CONSISTENCY,
                base_anchor_weight=BASE, base_anchor_full_weight=False, ce_from_data=True,
                loss={'ce': dict(loss=loss_ce, metrics=m_ce), 'ce:0.1,tv:0.9': dict(loss=loss_tv, metrics=m_tv)},
                keys=sorted(ckpt), verifier_keys=sorted(ver),
                outputs={'out.base_logits': "[A, B, V] the backbone's logits lm_head(norm(h)) of every slot (slot 0: the anchor's)",
                         'out.refined_logits': '[A, B, V] teacher-forced refined logits base + block_bias(prev_tf), prev_tf = '
                                               '[x_(p-1), x_p, .., x_(p+B-2)] (their logits_tf)',
                         'out.round1_logits': '[A, B, V] the first consistency round: base + block_bias([x_(p-1), anchor, base argmax of '
                                              'slots 1..B-2])',
                         'out.round_tokens': '[rounds, A, B] each consistency round\'s argmax (slot 0 not used: the anchor)',
                         'out.aligned_loss_mask': '[A, B] their loss mask over the slots (slot 0 zeroed)',
                         'in.final_hidden': "verifier_norm(verifier_last_hidden_states): our `final_hidden` (the teacher's logits are "
                                            "the verifier head's, at p+k-1 for slot k)"})
    (OUT / f'{NAME}.json').write_text(json.dumps(meta, indent=1) + '\n')
    size = (OUT / f'{NAME}.safetensors').stat().st_size
    print(f'wrote {OUT / NAME}.safetensors ({size} bytes, {len(ckpt)} weights) and its json; loss ce {loss_ce:.6f}, '
          f'ce:0.1,tv:0.9 {loss_tv:.6f}', file=sys.stderr)


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('wheel', help="the unzipped speculators 0.9.0 wheel: the folder holding speculators/")
    p.add_argument('--allow-cuda', action='store_true', help=argparse.SUPPRESS)
    main(p.parse_args())
