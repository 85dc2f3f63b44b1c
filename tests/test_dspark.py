"""dflash.dspark against DeepSeek's reference (DeepSpec, deepspec/modeling/dspark/): the fixture tools/dspark_fixture.py recorded
from their code (tests/fixtures/dspark_reference.*, the commit inside) gives the same logits, confidences, loss and greedy drafts in
our class, loaded under their tensor names; our checkpoint has their keys but the target's embeddings and head. With a copy of
DeepSpec (`DSPARK_REF=/path/to/deepspec`, the directory holding deepspec/) their code runs live and loads our checkpoint.
Also: the drafter answers the decoding loop's wrapper (`dflash.evaluate.DFlashDrafter`) with B tokens, sampled and as a tree."""
import importlib.util, json, os
from pathlib import Path
import pytest, torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file
from dflash.dspark import DSparkConfig, DSparkDraftModel
from dflash.designs import drafter_class
from dflash.publish import save_drafter

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / 'tests' / 'fixtures' / 'dspark_reference'
TARGET_IO = {'embed_tokens.weight', 'lm_head.weight'}      # their class keeps copies of the target's; vLLM and SGLang use the target's


@pytest.fixture(scope='module')
def fixture():
    "`(tensors by kind, meta)` of the recorded reference: weights (their names), inputs, training outputs, drafts."
    t, meta = load_file(f'{FIX}.safetensors'), json.loads(Path(f'{FIX}.json').read_text())
    part = lambda p: {k.removeprefix(p): v for k, v in t.items() if k.startswith(p)}
    return dict(weight=part('weight.'), input=part('input.'), out=part('out.'), draft=part('draft.')), meta


def target_io(weights):
    "The target's embeddings and head, from their drafter's copies."
    head = nn.Linear(weights['lm_head.weight'].shape[1], weights['lm_head.weight'].shape[0], bias=False)
    head.weight.data = weights['lm_head.weight'].clone()
    return dict(embed_tokens=nn.Embedding.from_pretrained(weights['embed_tokens.weight'].clone()), lm_head=head)


@pytest.fixture(scope='module')
def ours(fixture):
    "Our class on their config, with their weights (their names, less the target's embeddings and head)."
    (t, meta) = fixture
    m = DSparkDraftModel(DSparkConfig.from_dict(meta['config'])).eval()
    m.load_state_dict({k: v for k, v in t['weight'].items() if k not in TARGET_IO}, strict=True)
    return m.attach_target(**target_io(t['weight']))


def training(model, x, **kw):
    with torch.no_grad():
        return model(x['hidden_states'], x['input_ids'], x['loss_mask'], anchors=x['anchors'], final_hidden=x['final_hidden'],
                     return_logits=True, **kw)


def drafts(model, x, schedule):
    "Greedy drafts over one cache per sequence at each position of `schedule`: tokens, walk logits, confidences (stacked)."
    out = []
    for r, starts in enumerate(schedule):
        cache, fed = model.new_cache(), 0
        for s in starts:
            z = model.draft(x['hidden_states'][r:r + 1, fed:s], x['input_ids'][r, s], s, cache); fed = s
            out.append((z[0].argmax(-1), z[0], model.last_confidence[0]))
    return [torch.stack(c) for c in zip(*out)]


def test_fixture_names_its_reference(fixture):
    _, meta = fixture
    assert meta['reference'] == 'github.com/deepseek-ai/DeepSpec' and len(meta['commit']) == 40
    assert meta['loss_settings'] == dict(loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0)


def test_their_config_reads_as_ours(fixture):
    _, meta = fixture
    c, theirs = DSparkConfig.from_dict(meta['config']), meta['config']
    assert (c.target_layer_ids, c.mask_token_id, c.block_size, c.markov_rank) == (theirs['target_layer_ids'], theirs['mask_token_id'],
                                                                                  theirs['block_size'], theirs['markov_rank'])
    assert c.enable_confidence_head and c.confidence_head_with_markov and c.architectures == ['Qwen3DSparkModel']


def test_training_forward_matches_reference(fixture, ours):
    t, meta = fixture
    o, ref = training(ours, t['input']), t['out']
    scored = ref['eval_mask'].bool()
    assert torch.equal(o.labels != -100, scored) and torch.equal(o.labels[scored], ref['target_ids'][scored])
    assert torch.allclose(o.logits[scored], ref['draft_logits'][scored], atol=1e-5)
    assert torch.allclose(o.confidence[scored], ref['confidence_logits'][scored].sigmoid(), atol=1e-6)
    assert abs(o.loss.item() - meta['loss']) < 1e-5
    names = dict(ce='ce_loss', l1='l1_loss', confidence='confidence_loss')
    assert all(abs(o.terms[k].item() - meta['terms'][v]) < 1e-5 for k, v in names.items())
    q = ref['aligned_target_logits'].softmax(-1)
    assert torch.allclose(o.accept_prob[scored], (1 - 0.5 * (o.logits.softmax(-1) - q).abs().sum(-1))[scored], atol=1e-5)


def test_greedy_drafts_match_reference(fixture, ours):
    t, meta = fixture
    toks, walk, conf = drafts(ours, t['input'], meta['drafts'])
    assert torch.equal(toks, t['draft']['tokens'])
    assert torch.allclose(walk, t['draft']['logits'], atol=1e-5)
    assert torch.allclose(conf, t['draft']['confidence_logits'].sigmoid(), atol=1e-6)


def test_checkpoint_keys_are_theirs_but_the_targets(fixture, ours, tmp_path):
    "Their keys and shapes, less `embed_tokens` and `lm_head` (vLLM shares the target's when absent, SGLang always skips them)."
    _, meta = fixture
    save_drafter(ours, tmp_path)
    with safe_open(tmp_path / 'model.safetensors', 'pt') as f: saved = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert saved == {k: v for k, v in meta['state_dict'].items() if k not in TARGET_IO}
    c = json.loads((tmp_path / 'config.json').read_text())
    assert c['architectures'] == ['Qwen3DSparkModel'] and drafter_class(tmp_path) is DSparkDraftModel
    for k in ('target_layer_ids', 'mask_token_id', 'num_anchors', 'enable_confidence_head', 'markov_rank', 'markov_head_type',
              'confidence_head_with_markov', 'block_size', 'num_target_layers'):
        assert c[k] == meta['config'][k], k                            # every field their class requires, at the top level
    assert c['dflash_config']['mask_token_id'] == c['mask_token_id'] and c['dflash_config']['markov_rank'] == c['markov_rank']
    back = DSparkDraftModel.from_pretrained(tmp_path).attach_target(**target_io(fixture[0]['weight'])).eval()
    assert abs(training(back, fixture[0]['input']).loss.item() - meta['loss']) < 1e-5


def test_decoding_loop_wrapper(ours, fixture):
    "The loop's wrapper asks for up to `draft_len` = B tokens, greedy, sampled (with q rows) and as a tree."
    from dflash.evaluate import DFlashDrafter
    from dflash.sampling import Sampling
    x, B = fixture[0]['input'], ours.block_size
    w = DFlashDrafter(ours); w.reset()
    toks = x['input_ids'][0, :9].tolist()
    got = w.propose(toks, x['hidden_states'][:1, :8], ours.draft_len)
    assert len(got) == ours.draft_len == B and got == ours.propose(x['hidden_states'][:1, :8], toks[-1], 8)[0][0].tolist()
    w.reset()
    s, q = w.propose_sampled(toks, x['hidden_states'][:1, :8], 3, Sampling(0.7), torch.Generator().manual_seed(0))
    assert len(s) == 3 and q.shape == (3, 96) and torch.allclose(q.sum(-1), torch.ones(3))
    w.reset()
    tree = w.propose_tree(toks, x['hidden_states'][:1, :8], 6, B)
    assert len(tree) == 6 and tree.tokens[0] == got[0]


def _reference_tool():
    spec = importlib.util.spec_from_file_location('dspark_fixture', ROOT / 'tools' / 'dspark_fixture.py')
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m


def test_live_reference_loads_our_checkpoint(fixture, tmp_path):
    """With `DSPARK_REF` (a DeepSpec copy): their code reproduces the fixture, and their class, loading our checkpoint of a drafter of
    our own (other weights), computes our logits, confidences, loss and greedy drafts."""
    ref_dir = os.environ.get('DSPARK_REF')
    if not ref_dir: pytest.skip('DSPARK_REF is not set: no DeepSpec copy to run (the committed fixture is tested above)')
    tool, (t, meta) = _reference_tool(), fixture
    tensors, live = tool.record(ref_dir)
    assert abs(live['loss'] - meta['loss']) < 1e-5 and torch.equal(tensors['draft.tokens'], t['draft']['tokens'])
    io = target_io(t['weight'])
    torch.manual_seed(3)
    mine = DSparkDraftModel(DSparkConfig.from_dict(meta['config'])).eval()
    with torch.no_grad():
        for p in mine.parameters(): p.normal_(0, 0.3)
    mine.attach_target(**io)
    save_drafter(mine, tmp_path)
    with tool.reference(ref_dir) as ref:
        theirs = ref.modeling.Qwen3DSparkModel.from_pretrained(tmp_path, attn_implementation='sdpa').float().eval()
        theirs.initialize_embeddings_and_head(embed_tokens=io['embed_tokens'], lm_head=io['lm_head'])
        out, loss, terms = tool.training_outputs(ref, theirs, t['input'])
        toks, confs, walk = tool.greedy_drafts(ref, theirs, t['input'])
    o, scored = training(mine, t['input']), out.eval_mask.bool()
    assert torch.allclose(o.logits[scored], out.draft_logits.detach()[scored], atol=1e-5) and abs(o.loss.item() - loss) < 1e-5
    assert torch.allclose(o.confidence[scored], out.confidence_pred.detach()[scored].sigmoid(), atol=1e-6)
    my_toks, my_walk, my_conf = drafts(mine, t['input'], meta['drafts'])
    assert torch.equal(my_toks, toks) and torch.allclose(my_walk, walk, atol=1e-5) and torch.allclose(my_conf, confs.sigmoid(), atol=1e-6)


# The confidence's temperatures (`sts_temperatures.json`): checked where they load and where they are used.

def test_sts_file_refused_unless_one_finite_positive_number_per_slot(ours, tmp_path):
    "Too few, too many, zero, negative, non-finite, bool or non-number: the load refuses it, naming the file, the count and the number expected."
    from dflash.dspark import STS_FILE, write_sts, read_sts
    save_drafter(ours, tmp_path)
    f, B = tmp_path / STS_FILE, ours.draft_len
    for T in ([1.0] * (B - 2), [1.0] * (B + 4)):
        write_sts(f, T)
        with pytest.raises(ValueError, match=rf'{STS_FILE}: {len(T)} temperatures, expected {B}'): DSparkDraftModel.from_pretrained(tmp_path)
    for bad in ('0', '-1.5', 'NaN', 'Infinity', '-Infinity', 'true', 'false', '"2"', 'null', '[1]', '{}'):
        f.write_text('{"temperatures": [%s]}' % ', '.join(['1.0'] * (B - 1) + [bad]))
        with pytest.raises(ValueError, match=STS_FILE): read_sts(f)
        with pytest.raises(ValueError, match=STS_FILE): DSparkDraftModel.from_pretrained(tmp_path)
    write_sts(f, [0.5 + k for k in range(B)])
    assert DSparkDraftModel.from_pretrained(tmp_path).sts_temperatures == [0.5 + k for k in range(B)]


def test_sts_in_memory_wrong_count_refused_when_drafting(ours, fixture):
    "Temperatures set in memory for another block size: decoding stops with what is wrong, not a tensor shape error."
    x, B = fixture[0]['input'], ours.draft_len
    try:
        for T in ([1.0, 2.0], [1.0] * (B + 1)):
            ours.sts_temperatures = T
            with pytest.raises(ValueError, match=rf'sts_temperatures: {len(T)} temperatures, expected {B}'):
                ours.propose(x['hidden_states'][:1, :8], x['input_ids'][0, 8], 8)
        ours.sts_temperatures = [2.0] * B
        ours.propose(x['hidden_states'][:1, :8], x['input_ids'][0, 8], 8)
        c = ours.last_confidence
        ours.sts_temperatures = None
        ours.propose(x['hidden_states'][:1, :8], x['input_ids'][0, 8], 8)
        assert torch.allclose(c, torch.sigmoid(torch.logit(ours.last_confidence) / 2), atol=1e-5)
    finally: ours.sts_temperatures = None


def test_missing_sts_file_noted_for_a_confidence_head(ours, tmp_path):
    "No file beside a drafter with a confidence head: one note that its confidences are uncalibrated; a stale file is not left by a save."
    from dflash.dspark import STS_FILE, write_sts
    save_drafter(ours, tmp_path)
    with pytest.warns(UserWarning, match=r'no sts_temperatures\.json: .*uncalibrated \(temperature 1'): DSparkDraftModel.from_pretrained(tmp_path)
    write_sts(tmp_path / STS_FILE, [3.0] * ours.draft_len)
    save_drafter(ours, tmp_path)                                          # saved again, without temperatures: not the old file's
    assert not (tmp_path / STS_FILE).exists()


def test_config_keeps_num_anchors_through_save_and_publish(ours, tmp_path):
    "`num_anchors` as the run set it survives `save_drafter` (fp32 and bf16), a reload, a second save, and the model card."
    from dflash.publish import model_card
    c = DSparkConfig.from_dict({**ours.config.to_dict(), 'num_anchors': 16})
    m = DSparkDraftModel(c)
    for i, dtype in enumerate((None, torch.bfloat16)):
        p = save_drafter(m, tmp_path / str(i), dtype)
        back = DSparkDraftModel.from_pretrained(p)
        q = save_drafter(back, tmp_path / f'{i}b', dtype); model_card(q)
        assert json.loads((p / 'config.json').read_text())['num_anchors'] == back.config.num_anchors == 16
        assert json.loads((q / 'config.json').read_text())['num_anchors'] == 16
