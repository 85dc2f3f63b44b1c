"""Faults of issue 25 in the converter, regeneration and data jobs: each case asserts the exit status, the one-line message
(naming the path), and that nothing earlier was changed or lost. The console scripts' functions run in this process;
the servers are real ones on local ports (the standard library's http.server, answering as a broken server would)."""
import contextlib, hashlib, http.server, io, json, os, shutil, threading
from pathlib import Path
import numpy as np, pytest
from dflash.core import HELDOUT_DATA, TINY_TARGET
from dflash.data import encode, load_conversations, prepare_cli, show_mask, TokenizedDataset
from dflash.gguf import gguf_cli
from dflash.regenerate import regenerate_cli, settings_path, refused_path


def cli(fn, *args):
    "`(exit status, stdout, stderr)` of a console script's function run in this process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try: code = fn([str(a) for a in args])
        except SystemExit as e: code = e.code
    return code, out.getvalue(), err.getvalue()


def ok(fn, *args):
    code, out, err = cli(fn, *args)
    assert code in (0, None), err[-3000:]
    return out


def fails(fn, *args, msg):
    "The script exits 1 with one line `PROG: error: ...` that contains `msg`; returns that line."
    code, out, err = cli(fn, *args)
    line = next((l for l in err.splitlines() if ': error: ' in l and l.startswith('dflash_')), '')
    assert code == 1 and msg in line, (code, err[-3000:])
    return line


def tree(d):
    "{relative path: sha256} of every file under `d`."
    d = Path(d)
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob('*')) if p.is_file()}


# --- dflash_gguf ----------------------------------------------------------------------------------------------

def tiny_gguf(path, seed=0, nan=False):
    "A real GGUF file of a 1-layer llama (F32 tensors) with the embedded target's tokenizer: converts in about a second."
    gguf = pytest.importorskip('gguf')
    t = json.loads((TINY_TARGET / 'tokenizer.json').read_text()); m = t['model']
    added = {a['id']: a['content'] for a in t['added_tokens']}
    vocab = {**m['vocab'], **{v: k for k, v in added.items()}}
    toks = [''] * (max(vocab.values()) + 1)
    for s, i in vocab.items(): toks[i] = s
    h, ff, heads, kv = 32, 64, 4, 2
    w = gguf.GGUFWriter(str(path), 'llama')
    w.add_block_count(1); w.add_context_length(256); w.add_embedding_length(h); w.add_feed_forward_length(ff)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(toks)); w.add_rope_dimension_count(h // heads)
    w.add_tokenizer_model('gpt2'); w.add_tokenizer_pre('default'); w.add_token_list(toks)
    w.add_token_types([3 if i in added else 1 for i in range(len(toks))]); w.add_token_merges([' '.join(p) for p in m['merges']])
    w.add_bos_token_id(0); w.add_eos_token_id(next(i for i, s in added.items() if s == '<|im_end|>'))
    w.add_chat_template((TINY_TARGET / 'chat_template.jinja').read_text())
    rng = np.random.default_rng(seed); r = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)
    q = r(h, h)
    if nan: q[0, 0] = np.nan
    w.add_tensor('token_embd.weight', r(len(toks), h)); w.add_tensor('output_norm.weight', np.ones(h, np.float32))
    for name, a in [('attn_norm', np.ones(h, np.float32)), ('ffn_norm', np.ones(h, np.float32)), ('attn_q', q), ('attn_k', r(kv * h // heads, h)),
                    ('attn_v', r(kv * h // heads, h)), ('attn_output', r(h, h)), ('ffn_gate', r(ff, h)), ('ffn_up', r(ff, h)), ('ffn_down', r(h, ff))]:
        w.add_tensor(f'blk.0.{name}.weight', a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.fixture(scope='module')
def gg(tmp_path_factory):
    "Two tiny GGUF files, and a conversion of the first."
    d = tmp_path_factory.mktemp('gguf')
    a, b = tiny_gguf(d / 'a.gguf'), tiny_gguf(d / 'b.gguf', seed=1)
    ok(gguf_cli, '--gguf', a, '--out', d / 'a-conv')
    return d


def test_gguf_refuses_a_folder_of_yours_and_changes_nothing(gg, tmp_path):
    out = tmp_path / 'mine'; (out / 'sub').mkdir(parents=True)
    (out / 'notes.txt').write_text('my notes'); (out / 'sub' / 'data.bin').write_bytes(b'\0\1\2')
    before = tree(tmp_path)
    fails(gguf_cli, '--gguf', gg / 'a.gguf', '--out', out, msg=f'out: {out} is not empty (notes.txt, sub) and it is not a conversion (no gguf.json)')
    assert tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ['mine']   # no temporary folder left either


def test_gguf_never_deletes_its_source(gg, tmp_path):
    "--gguf DIR/model.gguf --out DIR: refused, the GGUF file and its neighbours as they were."
    shutil.copy(gg / 'a.gguf', tmp_path / 'model.gguf'); (tmp_path / 'README.md').write_text('about the model')
    before = tree(tmp_path)
    fails(gguf_cli, '--gguf', tmp_path / 'model.gguf', '--out', tmp_path,
          msg=f'out: {tmp_path} is not empty (README.md, model.gguf) and it holds the GGUF file itself')
    assert tree(tmp_path) == before


def test_gguf_refuses_the_conversion_of_another_file(gg, tmp_path):
    shutil.copytree(gg / 'a-conv', tmp_path / 'conv'); before = tree(tmp_path)
    fails(gguf_cli, '--gguf', gg / 'b.gguf', '--out', tmp_path / 'conv', msg=f"it is the conversion of another file, {gg / 'a.gguf'}")
    assert tree(tmp_path) == before


def test_gguf_again_sets_the_earlier_conversion_aside(gg, tmp_path):
    "An earlier conversion of the same file: what it wrote moves to out/previous-*/ unchanged; a file of yours stays where it is."
    from transformers import AutoModelForCausalLM
    out = tmp_path / 'conv'; shutil.copytree(gg / 'a-conv', out)
    earlier = tree(out); (out / 'notes.txt').write_text('mine')
    src = (gg / 'a.gguf').read_bytes()
    assert ok(gguf_cli, '--gguf', gg / 'a.gguf', '--out', out).strip().endswith(str(out))
    aside = [p for p in out.iterdir() if p.name.startswith('previous-')]
    assert len(aside) == 1 and tree(aside[0]) == earlier and (out / 'notes.txt').read_text() == 'mine'
    rec = json.loads((out / 'gguf.json').read_text())
    assert rec['source'] == str(gg / 'a.gguf') and sorted(rec['files'] + ['gguf.json']) == sorted(earlier)
    assert sorted(p.name for p in out.iterdir()) == sorted([*earlier, 'notes.txt', aside[0].name]) and (gg / 'a.gguf').read_bytes() == src
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]   # the temporary folder is gone


def test_gguf_an_older_conversion_without_a_file_list(gg, tmp_path):
    "A gguf.json of an older version lists no files: the converter's own names are set aside, nothing else."
    out = tmp_path / 'conv'; shutil.copytree(gg / 'a-conv', out)
    rec = json.loads((out / 'gguf.json').read_text()); rec.pop('files'); (out / 'gguf.json').write_text(json.dumps(rec))
    earlier = tree(out); (out / 'README.md').write_text('my card')
    ok(gguf_cli, '--gguf', gg / 'a.gguf', '--out', out)
    aside = next(p for p in out.iterdir() if p.name.startswith('previous-'))
    assert tree(aside) == earlier and (out / 'README.md').read_text() == 'my card'


def test_gguf_into_an_empty_folder(gg, tmp_path):
    ok(gguf_cli, '--gguf', gg / 'a.gguf', '--out', tmp_path)
    assert tree(tmp_path).keys() == tree(gg / 'a-conv').keys()


@pytest.mark.parametrize('damage', ['truncated', '8 bytes', 'header only', 'empty', 'not gguf'])
def test_gguf_truncated_or_corrupt_file_is_named(gg, tmp_path, damage):
    data = (gg / 'a.gguf').read_bytes()
    f = tmp_path / 'model.gguf'
    f.write_bytes({'truncated': data[:-1000], '8 bytes': data[:8], 'header only': data[:5000], 'empty': b'',
                   'not gguf': b'PK\3\4' + data[4:]}[damage])
    fails(gguf_cli, '--gguf', f, '--out', tmp_path / 'out', msg=f'gguf: {f} is truncated or corrupt ({f.stat().st_size} bytes')
    assert sorted(os.listdir(tmp_path)) == ['model.gguf']


def test_gguf_non_finite_weights_refused(tmp_path):
    f = tiny_gguf(tmp_path / 'nan.gguf', nan=True)
    fails(gguf_cli, '--gguf', f, msg=f'gguf: {f}: tensor model.layers.0.self_attn.q_proj.weight holds NaN or inf')
    assert sorted(os.listdir(tmp_path)) == ['nan.gguf']


def test_gguf_out_is_a_file(gg, tmp_path):
    (tmp_path / 'x').write_text('mine')
    fails(gguf_cli, '--gguf', gg / 'a.gguf', '--out', tmp_path / 'x', msg=f'out: {tmp_path}/x is a file, not a directory')
    assert (tmp_path / 'x').read_text() == 'mine'


# --- dflash_regenerate: only what this job made counts as done -------------------------------------------------

REGEN = ['--batch-size', '4', '--max-new-tokens', '6']


def write_rows(path, rows):
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows)); return path


@pytest.fixture(scope='module')
def rg(tmp_path_factory):
    "Four held-out conversations (with answers), and a regeneration of the first two of them (as if interrupted)."
    d = tmp_path_factory.mktemp('regen')
    (d / 'four.jsonl').write_text(''.join(open(HELDOUT_DATA).readlines()[:4]))
    ok(regenerate_cli, '--data', d / 'four.jsonl', '--out', d / 'two.jsonl', '--max-samples', '2', *REGEN)
    return d


def _copy_two(rg, tmp_path):
    for f in ('two.jsonl', 'two.settings.json'): shutil.copy(rg / f, tmp_path / f)
    return tmp_path / 'two.jsonl'


@pytest.mark.parametrize('spelling', ['same', 'symlink', 'dotdot', 'hardlink'])
def test_regenerate_out_equal_to_data_refused(rg, tmp_path, spelling):
    data = tmp_path / 'data.jsonl'; shutil.copy(rg / 'four.jsonl', data); (tmp_path / 'sub').mkdir()
    out = {'same': data, 'symlink': tmp_path / 'link.jsonl', 'dotdot': tmp_path / 'sub' / '..' / 'data.jsonl',
           'hardlink': tmp_path / 'hard.jsonl'}[spelling]
    if spelling == 'symlink': out.symlink_to(data)
    if spelling == 'hardlink': os.link(data, out)
    before = tree(tmp_path)
    fails(regenerate_cli, '--data', data, '--out', out, *REGEN, msg=f'out: {out} is the data file {data} itself')
    assert tree(tmp_path) == before


def test_regenerate_side_files_never_the_data(rg, tmp_path):
    "A data file named as out's list of refusals (which a server run replaces) is refused too."
    data = tmp_path / 'x.refused.jsonl'; shutil.copy(rg / 'four.jsonl', data)
    fails(regenerate_cli, '--data', data, '--out', tmp_path / 'x.jsonl', '--server', 'http://127.0.0.1:9',
          msg=f"out: {tmp_path / 'x.jsonl'}: its list of refused conversations, {data}, is the data file {data} itself")
    assert data.read_bytes() == (rg / 'four.jsonl').read_bytes()


def test_regenerate_refuses_rows_it_did_not_write(rg, tmp_path):
    "A corpus with answers as out (another copy of data): its rows would count as done; refused, not even its last line cut."
    out = tmp_path / 'corpus.jsonl'; out.write_text((rg / 'four.jsonl').read_text()[:-30])   # a last line cut short, as well
    before = out.read_bytes()
    fails(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, *REGEN,
          msg=f'out: {out} holds 3 conversations that dflash_regenerate did not write')
    assert out.read_bytes() == before and not settings_path(out).exists()


def test_regenerate_refuses_rows_made_from_another_file(rg, tmp_path):
    "Ids are row numbers in files without ids: a regeneration of file A resumed with file B would take A's replies as B's."
    rows = lambda k: [dict(messages=[dict(role='user', content=f'Question {k}-{i}')]) for i in range(3)]
    a, b = write_rows(tmp_path / 'a.jsonl', rows('a')), write_rows(tmp_path / 'b.jsonl', rows('b'))
    out = tmp_path / 'regen.jsonl'
    ok(regenerate_cli, '--data', a, '--out', out, '--max-samples', '2', *REGEN)
    before = tree(tmp_path)
    line = fails(regenerate_cli, '--data', b, '--out', out, *REGEN,
                 msg=f'out: {out} holds 2 conversations whose prompts differ from those of the same id in data {b}')
    assert "'1'" in line and "'2'" in line
    four = write_rows(tmp_path / 'c.jsonl', [dict(id=f'c{i}', messages=[dict(role='user', content='Hi')]) for i in range(4)])
    fails(regenerate_cli, '--data', four, '--out', out, *REGEN, msg=f'out: {out} holds 2 conversations that data {four} does not (ids ')
    assert tree(tmp_path) == {**before, 'c.jsonl': tree(tmp_path)['c.jsonl']}


@pytest.mark.parametrize('change,old,new', [
    (['--max-new-tokens', '12'], "max_new_tokens=6", "max_new_tokens=12"),
    (['--temperature', '0.9', '--top-p', '0.5'], 'temperature=0.0, top_p=None, top_k=None, seed=None', 'temperature=0.9, top_p=0.5, top_k=0, seed=0'),
    (['--reasoning', 'drop'], "reasoning='keep'", "reasoning='drop'"),
    (['--chat-template-kwargs', '{"enable_thinking": false}'], 'chat_template_kwargs={}', "chat_template_kwargs={'enable_thinking': False}"),
    ('other target', "target='{TINY}'", "target='{OTHER}'")])
def test_regenerate_resume_with_other_settings_refused(rg, tmp_path, change, old, new, make_target, save_target):
    "Each setting that shapes a reply, changed on a resume: refused, naming it with both values; the file and its settings unchanged."
    out = _copy_two(rg, tmp_path)
    if change == 'other target':
        other = save_target(make_target('qwen3_5'), tmp_path / 'other-target')
        change, old, new = ['--target', other], old.format(TINY=TINY_TARGET), new.format(OTHER=other)
    before = tree(tmp_path)
    line = fails(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, *REGEN, *change, msg=f'resume: {out} was written with {old}')
    assert f'this run has {new}' in line and str(settings_path(out)) in line and 'would mix two settings' in line
    if 'target=' in old: assert 'target_config_sha256=' in line
    assert tree(tmp_path) == before


def test_regenerate_resume_with_the_same_settings(rg, tmp_path):
    out = _copy_two(rg, tmp_path); two = out.read_text()
    so = ok(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, *REGEN)
    assert f'2 already in {out}, 2 to do' in so
    rows = [json.loads(l) for l in open(out)]
    assert out.read_text().startswith(two) and len({r['id'] for r in rows}) == len(rows) == 4
    s = json.loads(settings_path(out).read_text())['settings']
    assert s['target'] == str(TINY_TARGET) and s['max_new_tokens'] == 6 and s['generator'] == 'in process' and len(s['target_config_sha256']) == 64


def test_regenerate_an_older_out_without_settings(rg, tmp_path):
    "Rows of an older version, no settings file: with nothing to do it stays as it was; with more to do, refused unless adopted."
    out = _copy_two(rg, tmp_path); settings_path(out).unlink(); before = tree(tmp_path)
    so = ok(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, '--max-samples', '2', '--max-new-tokens', '99')
    assert 'recorded no settings' in so and 'nothing is left to do' in so and tree(tmp_path) == before
    fails(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, *REGEN,
          msg=f'resume: {out} holds 2 conversations of an older dflash_regenerate, which recorded no settings')
    assert tree(tmp_path) == before
    so = ok(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, *REGEN, '--adopt-settings')
    assert 'taken as made with the settings of this run' in so and len(out.read_text().splitlines()) == 4
    assert json.loads(settings_path(out).read_text())['settings']['max_new_tokens'] == 6


def test_regenerate_records_which_replies_were_cut(rg, tmp_path):
    "Multi-turn conversations at 3 tokens a reply: each row lists the indices in `messages` of its replies cut, and counts them."
    out = tmp_path / 'cut.jsonl'
    ok(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, '--max-new-tokens', '3')
    rows = [json.loads(l) for l in open(out)]
    for r in rows:
        replies = [i for i, m in enumerate(r['messages']) if m['role'] == 'assistant']
        assert set(r['truncated_messages']) <= set(replies) and r['truncated_turns'] == len(r['truncated_messages'])
    assert any(len(r['truncated_messages']) > 1 for r in rows)


# --- dflash_regenerate on a broken server ----------------------------------------------------------------------

class Stub:
    "A real HTTP server (the standard library's) with enough of the OpenAI API: `answer(body) -> (status, JSON)` makes each chat reply."
    def __init__(self, answer, model='stub-model'):
        stub = self
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self): self.send(200, dict(data=[dict(id=stub.model)]))
            def do_POST(self): self.send(*stub.answer(json.loads(self.rfile.read(int(self.headers['Content-Length'])))))
            def send(self, code, obj):
                b = json.dumps(obj).encode()
                self.send_response(code); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)
            def log_message(self, *args): pass
        self.answer, self.model = answer, model
        self.srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f'http://127.0.0.1:{self.srv.server_port}'
    def __enter__(self): return self
    def __exit__(self, *exc): self.srv.shutdown(); self.srv.server_close()


def chat(content, finish='stop'):
    return 200, dict(choices=[dict(message=dict(role='assistant', content=content), finish_reason=finish)], usage=dict(completion_tokens=3))


def prompts(tmp_path, n):
    return write_rows(tmp_path / 'prompts.jsonl', [dict(id=f'p{i}', messages=[dict(role='user', content=f'Question {i}')]) for i in range(n)])


def test_server_of_empty_replies_stops_the_job(tmp_path):
    "null content for every request: the job stops after 16 replies, naming the server and a reply as it came; no row written."
    data, out = prompts(tmp_path, 24), tmp_path / 'out.jsonl'
    with Stub(lambda body: chat(None)) as s:
        line = fails(regenerate_cli, '--server', s.url, '--data', data, '--out', out, '--in-flight', '1',
                     msg=f'16 of 16 replies from the server {s.url} are empty')
    assert "'content': None" in line and f'not written to {out}' in line and out.read_text() == ''
    with Stub(lambda body: chat('')) as s:   # empty strings, and fewer than 16 conversations: checked at the end
        fails(regenerate_cli, '--server', s.url, '--data', prompts(tmp_path, 3), '--out', out, msg='3 of 3 replies from the server')
    assert out.read_text() == ''


def test_server_with_a_few_empty_replies_goes_on(tmp_path):
    "One empty reply in four: counted in the summary, the row written (prepare skips it), exit 0."
    data, out = prompts(tmp_path, 4), tmp_path / 'out.jsonl'
    with Stub(lambda body: chat('' if body['messages'][-1]['content'] == 'Question 2' else 'An answer.')) as s:
        so = ok(regenerate_cli, '--server', s.url, '--data', data, '--out', out)
    assert '4 replies ended by the target, 0 cut at max_new_tokens=256, 1 empty)' in so
    rows = {r['id']: r['messages'][-1]['content'] for r in map(json.loads, open(out))}
    assert rows == {'p0': 'An answer.', 'p1': 'An answer.', 'p2': '', 'p3': 'An answer.'}


def test_on_refused_skip_when_the_server_refuses_everything(tmp_path):
    "Every request refused with on_refused=skip: exit 1 naming the server and its message; the refusals listed, no row."
    data, out = prompts(tmp_path, 4), tmp_path / 'out.jsonl'
    with Stub(lambda body: (404, dict(error=dict(message="The model 'stub-model' does not exist")))) as s:
        line = fails(regenerate_cli, '--server', s.url, '--data', data, '--out', out, '--on-refused', 'skip',
                     msg='the server refused 4 of 4 conversations (on_refused=skip)')
    assert f'{s.url}/v1/chat/completions: HTTP 404' in line and "does not exist" in line and str(refused_path(out)) in line
    assert out.read_text() == '' and len(refused_path(out).read_text().splitlines()) == 4
    data = prompts(tmp_path, 40)   # a long job stops early: after 16 refusals, not after all 40
    with Stub(lambda body: (400, dict(error='no'))) as s:
        fails(regenerate_cli, '--server', s.url, '--data', data, '--out', out, '--on-refused', 'skip', '--in-flight', '1', msg='refused 16 of 16')


def test_on_refused_skip_with_a_few_refusals_goes_on(tmp_path):
    data, out = prompts(tmp_path, 4), tmp_path / 'out.jsonl'
    with Stub(lambda body: (400, dict(error='prompt too long')) if body['messages'][-1]['content'] == 'Question 1' else chat('Yes.')) as s:
        so = ok(regenerate_cli, '--server', s.url, '--data', data, '--out', out, '--on-refused', 'skip')
    assert '1 conversations refused by the server, skipped' in so and len(out.read_text().splitlines()) == 3
    assert [json.loads(l)['id'] for l in open(refused_path(out))] == ['p1']


def test_server_resume_with_another_served_model_refused(tmp_path):
    data, out = prompts(tmp_path, 4), tmp_path / 'out.jsonl'
    with Stub(lambda body: chat(f"from {body['model']}")) as s:
        ok(regenerate_cli, '--server', s.url, '--data', data, '--out', out, '--max-samples', '2')
        assert json.loads(settings_path(out).read_text())['settings']['served_model'] == 'stub-model'
        before = tree(tmp_path); s.model = 'another-model'
        fails(regenerate_cli, '--server', s.url, '--data', data, '--out', out,
              msg=f"resume: {out} was written with served_model='stub-model'; this run has served_model='another-model'")
        assert tree(tmp_path) == before
        s.model = 'stub-model'
        ok(regenerate_cli, '--server', s.url, '--data', data, '--out', out)
    assert len(out.read_text().splitlines()) == 4


# --- dflash_prepare: replies cut at max_new_tokens --------------------------------------------------------------

def test_prepare_trains_no_end_of_turn_after_a_cut_reply(tmp_path, tok):
    "A reply cut at max_new_tokens gets no end-of-turn label (the indices recorded, or a count alone); the report counts them."
    q = dict(role='user', content='Show me the record.')
    rows = [dict(id='cut', messages=[q, dict(role='assistant', content='Here is the ')], truncated_turns=1, truncated_messages=[1]),
            dict(id='count', messages=[q, dict(role='assistant', content='Sure.'), q, dict(role='assistant', content='Here')], truncated_turns=1),
            dict(id='whole', messages=[q, dict(role='assistant', content='Done.')], truncated_turns=0, truncated_messages=[])]
    data = write_rows(tmp_path / 'rows.jsonl', rows)
    so = ok(prepare_cli, '--data', data, '--out', tmp_path / 'ds')
    assert '3 replies cut at max_new_tokens (trained without their end of turn)' in so
    ds = TokenizedDataset.load(tmp_path / 'ds')
    masks = {s['id']: show_mask(tok, s['input_ids'], s['loss_mask']) for s in ds}
    assert masks['cut'].endswith('assistant\n[Here is the] <|im_end|>\n')   # the text trained, not the end of turn after it
    assert '[Sure.]<|im_end|>' in masks['count'] and masks['count'].endswith('[Here]<|im_end|>\n')   # a count alone: no reply ends
    assert masks['whole'].endswith('[Done.<|im_end|>]\n')
    rep = json.loads((tmp_path / 'ds' / 'report.json').read_text())
    assert rep['cut_replies'] == 3 and rep['kept'] == 3 and ds.meta['cut_replies'] == 3


def test_prepare_bad_truncation_fields(tmp_path):
    q = dict(role='user', content='Hi')
    rows = [dict(id='a', messages=[q, dict(role='assistant', content='Hello')], truncated_turns='one'),
            dict(id='b', messages=[q, dict(role='assistant', content='Hello')], truncated_messages=[0]),
            dict(id='c', messages=[q, dict(role='assistant', content='Hello')])]
    data = write_rows(tmp_path / 'rows.jsonl', rows)
    assert 'skipped 2 of 3 rows: 2 bad turn' in ok(prepare_cli, '--data', data, '--out', tmp_path / 'ds')
    fails(prepare_cli, '--data', data, '--out', tmp_path / 'ds2', '--strict', msg='2 bad rows (strict mode)')
    rep = json.loads((tmp_path / 'ds2' / 'report.json').read_text())
    assert [(p['row'], p['detail']) for p in rep['problems']] == [(1, "truncated_turns='one': not a count of its 1 replies"),
                                                                  (2, 'truncated_messages=[0]: not a list of indices of assistant turns')]


def test_regenerated_replies_cut_short_train_no_end_of_turn(rg, tmp_path, tok):
    "Regenerate at 4 tokens a reply, prepare: the end-of-turn tokens in each mask are exactly the replies the target ended."
    out = tmp_path / 'regen.jsonl'
    ok(regenerate_cli, '--data', rg / 'four.jsonl', '--out', out, '--max-new-tokens', '4')
    rows = {r['id']: r for r in map(json.loads, open(out))}
    so = ok(prepare_cli, '--data', out, '--out', tmp_path / 'ds')
    cut = sum(r['truncated_turns'] for r in rows.values())
    assert cut > 0 and f'{cut} replies cut at max_new_tokens' in so
    eot = tok.convert_tokens_to_ids('<|im_end|>')
    for s in TokenizedDataset.load(tmp_path / 'ds'):
        r = rows[s['id']]; ended = sum(m['role'] == 'assistant' for m in r['messages']) - r['truncated_turns']
        assert int(((s['input_ids'] == eot) & (s['loss_mask'] == 1)).sum()) == ended


# --- dflash_prepare: an out that is not its own -----------------------------------------------------------------

def test_prepare_refuses_an_out_of_yours(tmp_path):
    "A folder of your own, or an earlier dataset with a file of yours added: the new dataset would replace it whole; refused."
    rows = write_rows(tmp_path / 'rows.jsonl', [dict(messages=[dict(role='user', content='Hi'), dict(role='assistant', content='Hello.')])])
    mine = tmp_path / 'mine'; (mine / 'sub').mkdir(parents=True); (mine / 'notes.txt').write_text('keep'); (mine / 'sub' / 'x.bin').write_bytes(b'1')
    before = tree(tmp_path)
    fails(prepare_cli, '--data', rows, '--out', mine, msg=f'out: {mine} holds files prepare did not write (notes.txt, sub)')
    assert tree(tmp_path) == before
    ok(prepare_cli, '--data', rows, '--out', tmp_path / 'ds')
    (tmp_path / 'ds' / 'notes.md').write_text('about this dataset'); before = tree(tmp_path / 'ds')
    fails(prepare_cli, '--data', rows, '--out', tmp_path / 'ds', msg=f"out: {tmp_path / 'ds'} holds files prepare did not write (notes.md)")
    assert tree(tmp_path / 'ds') == before
    (tmp_path / 'ds' / 'notes.md').unlink()
    ok(prepare_cli, '--data', rows, '--out', tmp_path / 'ds')   # its own earlier dataset is replaced as before
