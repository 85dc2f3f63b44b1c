"""Record DeepSeek's DSpark reference (DeepSpec, deepspec/modeling/dspark/) on a tiny fixed config, for tests/test_dspark.py.

    mkdir -p /tmp/deepspec && git -C MIRROR archive HEAD deepspec | tar -x -C /tmp/deepspec
    .venv/bin/python tools/dspark_fixture.py /tmp/deepspec --commit $(git -C MIRROR rev-parse HEAD)

MIRROR: a clone of github.com/deepseek-ai/DeepSpec (MIT). DeepSpec is not on PyPI: its modules are loaded here by path, their
packages' `__init__` files skipped (they import the Gemma 4 and EAGLE-3 models and the trainer), with stand-ins for the few names
the loaded modules import from elsewhere: `deepspec.utils.metrics.add_metric` (records the metrics, so their loss terms come back
one by one), `deepspec.eval.base_evaluator.DraftProposal` (a three-field dataclass) and `Gemma4DSparkModel` (a type in a union).

Attention. Their training forward runs flex_attention on a `BlockMask` from `create_block_mask(dspark_mask_mod, ...)`. Here
`create_block_mask` is replaced, in their `common` module, by a dense boolean mask made by evaluating their own `dspark_mask_mod`
on every (query, key) pair, and the model runs transformers' `sdpa` attention on it: the same function, no compiler needed, on any
CPU. (Every recorded block is valid: a block their sampler pads out has no key at all, which sdpa answers with NaN and flex with 0.)
`--flex` also runs their real flex path (on CPU it runs without gradients, compiled) and records how far its logits are from
the dense mask's. Their decoding path (`forward_dspark_draft_block`) runs sdpa with no mask, as their evaluator does, over a
`DynamicCache` whose `crop(n)` keeps the first n positions, as in the transformers DeepSpec pins (5.10.2).

Anchors. Their `sample_anchor_positions` draws at random; it is replaced in their modeling module by one returning fixed anchors.

Loss. `compute_dspark_loss` all-reduces its denominators: it runs in a one-process gloo group (a file store in a temporary dir).

Writes tests/fixtures/dspark_reference.safetensors (their weights under their names, the target's embeddings and head among them,
the inputs and every output) and tests/fixtures/dspark_reference.json (the commit, the config, each state-dict key's shape, the
loss and its terms, the drafting schedule, versions)."""
import argparse, contextlib, dataclasses, hashlib, importlib.util, json, sys, tempfile, types
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'tests' / 'fixtures'
NAME = 'dspark_reference'
# the tiny config: vocabulary, hidden, target layers, drafter layers, taps, block, Markov rank, mask token (the last row)
V, H, TL, DL, TAPS, B, R = 96, 32, 4, 2, [1, 2], 4, 8
MASK = V - 1
# the inputs: 2 sequences of 20, loss masks with gaps, 4 anchors each (blocks cut short by a gap and by the end of the sequence)
S, ANCHORS = 20, [[3, 7, 10, 18], [2, 5, 12, 16]]
LOSS_MASK = [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
             [0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]]
DRAFTS = [[2, 6, 9, 13], [4, 11, 17]]      # each sequence's drafting positions, over one cache (the context grows between them)
GAMMA, CE, L1, CONF = 4.0, 0.1, 0.9, 1.0  # the paper's loss (DeepSpec config/dspark/*.py)


class Args(dict):
    "Their `model_args`: a dict read both as `'key' in args` and as `args.key`."
    __getattr__ = dict.__getitem__


def _module(name, path=None, **attrs):
    m = types.ModuleType(name)
    if path is not None: m.__path__ = [str(path)]           # a package whose submodules load from `path`, its __init__ not run
    m.__dict__.update(attrs)
    return m


@contextlib.contextmanager
def reference(root):
    """DeepSpec's DSpark modules from the copy at `root` (the directory holding `deepspec/`), as a namespace; sys.modules is restored
    afterwards. `metrics` collects what their code passes to `add_metric`: {name: (value, denominator)}."""
    root, metrics = Path(root), {}
    pkg = root / 'deepspec'
    if not (pkg / 'modeling' / 'dspark' / 'qwen3' / 'modeling.py').exists(): raise FileNotFoundError(f'{root}: no deepspec/modeling/dspark here')

    @dataclasses.dataclass
    class DraftProposal:                                    # deepspec/eval/base_evaluator.py's, which imports their data and dist code
        draft_token_count: int
        verify_input_ids: torch.Tensor
        draft_probs: torch.Tensor | None

    def add_metric(name, value, *, den=None, reduction='dp_sum', tag='train'):
        metrics[name] = (float(torch.as_tensor(value).detach()), None if den is None else float(torch.as_tensor(den).detach()))

    stubs = {'deepspec': _module('deepspec', pkg), 'deepspec.modeling': _module('deepspec.modeling', pkg / 'modeling'),
             'deepspec.modeling.dspark': _module('deepspec.modeling.dspark', pkg / 'modeling' / 'dspark'),
             'deepspec.modeling.dspark.qwen3': _module('deepspec.modeling.dspark.qwen3', pkg / 'modeling' / 'dspark' / 'qwen3'),
             'deepspec.modeling.dspark.gemma4': _module('deepspec.modeling.dspark.gemma4', Gemma4DSparkModel=type('Gemma4DSparkModel', (), {})),
             'deepspec.utils': _module('deepspec.utils', pkg / 'utils'),
             'deepspec.utils.metrics': _module('deepspec.utils.metrics', add_metric=add_metric),
             'deepspec.eval': _module('deepspec.eval', pkg / 'eval'),
             'deepspec.eval.dspark': _module('deepspec.eval.dspark', pkg / 'eval' / 'dspark'),
             'deepspec.eval.base_evaluator': _module('deepspec.eval.base_evaluator', DraftProposal=DraftProposal)}
    saved = {k: v for k, v in sys.modules.items() if k == 'deepspec' or k.startswith('deepspec.')}
    for k in saved: del sys.modules[k]
    sys.modules.update(stubs)
    try:
        imp = importlib.import_module
        modeling = imp('deepspec.modeling.dspark.qwen3.modeling')
        stubs['deepspec.modeling.dspark.qwen3'].Qwen3DSparkModel = modeling.Qwen3DSparkModel   # what the package's __init__ exports
        ns = types.SimpleNamespace(root=root, metrics=metrics, common=imp('deepspec.modeling.dspark.common'),
                                   markov=imp('deepspec.modeling.dspark.markov_head'), modeling=modeling,
                                   config=imp('deepspec.modeling.dspark.qwen3.config'), loss=imp('deepspec.modeling.dspark.loss'),
                                   sampling=imp('deepspec.utils.sampling'), draft_ops=imp('deepspec.eval.dspark.draft_ops'))
        ns.common.create_block_mask = dense_block_mask     # their mask function, evaluated densely (see the module docstring)
        yield ns
    finally:
        for k in [k for k in sys.modules if k == 'deepspec' or k.startswith('deepspec.')]: del sys.modules[k]
        sys.modules.update(saved)


def dense_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None):
    "What `create_block_mask` stands for, as a dense bool [B, 1, Q, KV] (True: attend): `mask_mod` at every (query, key)."
    b, q, kv = torch.arange(B, device=device), torch.arange(Q_LEN, device=device), torch.arange(KV_LEN, device=device)
    return mask_mod(b[:, None, None], None, q[None, :, None], kv[None, None, :])[:, None]


def file_sha256(root):
    "One sha256 over the DSpark files read (path and bytes), to name the copy beside its commit."
    h = hashlib.sha256()
    for p in sorted((Path(root) / 'deepspec').rglob('*.py')):
        if 'dspark' in p.parts or p.name in ('sampling.py',):
            h.update(str(p.relative_to(root)).encode()); h.update(p.read_bytes())
    return h.hexdigest()


def target_config():
    "The tiny target's Qwen3 config (their drafter copies it: heads, rope, norms)."
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=TL, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=H // 4, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False)


def build(ref, seed=0):
    "Their drafter on the tiny config (their `build_draft_config`), seeded weights large enough that attention and both heads matter."
    args = Args(num_draft_layers=DL, target_layer_ids=TAPS, block_size=B, mask_token_id=MASK, num_anchors=len(ANCHORS[0]),
                markov_rank=R, markov_head_type='vanilla', confidence_head_alpha=CONF, confidence_head_with_markov=True)
    cfg = ref.config.build_draft_config(target_config(), args)
    cfg._attn_implementation = 'sdpa'
    torch.manual_seed(seed)
    model = ref.modeling.Qwen3DSparkModel(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if n.endswith('norm.weight'): p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n == 'confidence_head.proj.bias': p.fill_(0.3)
            else: p.copy_(torch.randn(p.shape, generator=g) * (0.5 if 'markov' in n or 'embed' in n else 0.2))
    return model


def inputs(seed=1):
    "Token ids (never the mask token), loss mask, taps [b, S, 2H], the target's final states [b, S, H] and the anchors."
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (2, S), generator=g)
    return dict(input_ids=ids, loss_mask=torch.tensor(LOSS_MASK), hidden_states=torch.randn(2, S, len(TAPS) * H, generator=g),
                final_hidden=torch.randn(2, S, H, generator=g), anchors=torch.tensor(ANCHORS))


def _one_process_group():
    import torch.distributed as dist
    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix='dspark-gloo-')
        dist.init_process_group('gloo', init_method=f'file://{store}/store', rank=0, world_size=1)


def training_outputs(ref, model, x):
    "Their training forward on `x` (anchors fixed), and their loss with its terms."
    anchors = x['anchors']
    ref.modeling.sample_anchor_positions = lambda **kw: (anchors.clone(), torch.ones_like(anchors, dtype=torch.bool))
    _one_process_group()
    ref.metrics.clear()
    out = model(input_ids=x['input_ids'], target_hidden_states=x['hidden_states'], loss_mask=x['loss_mask'],
                target_last_hidden_states=x['final_hidden'])
    loss = ref.loss.compute_dspark_loss(outputs=out, loss_decay_gamma=GAMMA, ce_loss_alpha=CE, l1_loss_alpha=L1, confidence_head_alpha=CONF)
    terms = {k: ref.metrics[k][0] / ref.metrics[k][1] for k in ('ce_loss', 'l1_loss', 'confidence_loss')}
    return out, float(loss.detach()), terms


def _cache_class():
    from transformers import DynamicCache
    class KeepFirstCache(DynamicCache):
        """`crop(n)` keeps the first n positions, as DeepSpec's pinned transformers (5.10.2) does for n > 0: its drafting crops the
        block's keys off that way. Newer transformers refuse a positive n and remove -n positions instead."""
        def crop(self, n):
            super().crop(n - self.get_seq_length() if n > 0 else n)
    return KeepFirstCache


@torch.no_grad()
def greedy_drafts(ref, model, x):
    """Their evaluator's drafting, step by step: for each sequence one `DynamicCache`, and at each position of `DRAFTS` the new
    context fed with the block (`forward_dspark_draft_block`), then `build_dspark_proposal` at T = 0 (`sample_draft_tokens`'s greedy
    walk through the Markov head, and the confidence head along it). Returns per draft: the tokens [B], the confidence logits [B],
    and the walk's logits [B, V] (`sample_draft_tokens`'s corrected logits)."""
    KeepFirstCache, toks, confs, logits = _cache_class(), [], [], []
    for r, starts in enumerate(DRAFTS):
        cache, fed = KeepFirstCache(), 0
        for s in starts:
            draft_ids = torch.full((1, B), MASK, dtype=torch.long); draft_ids[0, 0] = x['input_ids'][r, s]
            pos = torch.arange(s + B)[None]
            h = ref.draft_ops.forward_dspark_draft_block(model, draft_input_ids=draft_ids, position_ids=pos, past_key_values_draft=cache,
                                                         target_hidden_states=x['hidden_states'][r:r + 1, fed:s], start=s, block_size=B)
            fed = s
            p = ref.draft_ops.build_dspark_proposal(model, draft_input_ids=draft_ids, block_hidden=h, block_size=B, temperature=0.0,
                                                    confidence_threshold=0.0)
            t, z = model.sample_draft_tokens(model.compute_logits(h[:, :B]), first_prev_token_ids=draft_ids[:, 0], temperature=0.0,
                                             hidden_states=h[:, :B])
            assert torch.equal(p.verify_input_ids[0, 1:], t[0])
            toks.append(t[0]); confs.append(p.confidence_logits[0]); logits.append(z[0])
    return torch.stack(toks), torch.stack(confs), torch.stack(logits)


@torch.no_grad()
def flex_check(ref, model, x, dense):
    """Their own flex_attention path on this CPU (the real `create_block_mask`; flex on CPU runs without gradients, compiled): the
    largest difference of its draft logits from the dense mask's `dense`, and its loss."""
    from torch.nn.attention.flex_attention import create_block_mask
    ref.common.create_block_mask, model.config._attn_implementation = create_block_mask, 'flex_attention'
    try:
        out, loss, _ = training_outputs(ref, model, x)
        return dict(max_abs_diff_draft_logits=float((out.draft_logits - dense.draft_logits).abs().max()), loss=loss)
    finally: ref.common.create_block_mask, model.config._attn_implementation = dense_block_mask, 'sdpa'


def record(root, flex=False):
    "`(tensors, meta)`: everything the fixture holds, from the DeepSpec copy at `root`; `flex`: also `flex_check` it."
    with reference(root) as ref:
        model, x = build(ref), inputs()
        out, loss, terms = training_outputs(ref, model, x)
        checked = flex_check(ref, model, x, out) if flex else None
        toks, confs, walk = greedy_drafts(ref, model, x)
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        tensors = {**{f'weight.{k}': v for k, v in sd.items()}, **{f'input.{k}': v.contiguous() for k, v in x.items()},
                   'out.draft_logits': out.draft_logits.detach(), 'out.target_ids': out.target_ids, 'out.eval_mask': out.eval_mask,
                   'out.confidence_logits': out.confidence_pred.detach(), 'out.aligned_target_logits': out.aligned_target_logits.detach(),
                   'draft.tokens': toks, 'draft.confidence_logits': confs, 'draft.logits': walk}
        cfg = model.config.to_dict()
        cfg.pop('_attn_implementation', None)
        meta = dict(config=cfg, state_dict={k: list(v.shape) for k, v in sd.items()}, loss=loss, terms=terms,
                    loss_settings=dict(loss_decay_gamma=GAMMA, ce_loss_alpha=CE, l1_loss_alpha=L1, confidence_head_alpha=CONF),
                    drafts=DRAFTS, anchors=ANCHORS, attention='sdpa on a dense mask of their dspark_mask_mod (training); sdpa, no mask (drafting)',
                    files_sha256=file_sha256(root), **(dict(flex_check=checked) if flex else {}))
    return {k: v.contiguous() for k, v in tensors.items()}, meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('deepspec', help='a copy of the DeepSpec repository (the directory holding deepspec/)')
    ap.add_argument('--commit', required=True, help='the commit the copy is of (git -C MIRROR rev-parse HEAD)')
    ap.add_argument('--out', default=str(OUT))
    ap.add_argument('--flex', action='store_true', help="also run their flex_attention path (CPU: no gradients, compiled, ~40 s) against the dense mask")
    a = ap.parse_args(argv)
    import transformers
    from safetensors.torch import save_file
    tensors, meta = record(a.deepspec, a.flex)
    meta = dict(reference='github.com/deepseek-ai/DeepSpec', commit=a.commit, torch=torch.__version__,
                transformers=transformers.__version__, **meta)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / f'{NAME}.safetensors', metadata={'commit': a.commit})
    (out / f'{NAME}.json').write_text(json.dumps(meta, indent=1, sort_keys=True) + '\n')
    print(f'wrote {out / NAME}.{{safetensors,json}}: loss {meta["loss"]:.6f}, terms {meta["terms"]}, drafts {tensors["draft.tokens"].tolist()}')


if __name__ == '__main__':
    main()
