"Tests of dflash.data: validation rules on bad-input fixtures, the loss mask token by token, the saved dataset, the CLI, regeneration."
import json, subprocess, sys
from pathlib import Path
import numpy as np, pytest, torch
from transformers import AutoTokenizer
from dflash.core import TINY_TARGET, HELDOUT_DATA
from dflash.taps import target_name
from dflash.data import DataError, LLAMA3_TEMPLATE, TokenizedDataset, encode, load_conversations, prepare, read_rows
from dflash.regenerate import regenerate

FIX = Path(__file__).parent / 'fixtures' / 'data'
# fixture, the bad row, its reason (every fixture has valid rows 1 and 3 around it)
RULES = [('not_object.jsonl', 2, 'not an object'), ('neither_key.jsonl', 2, 'no conversations or messages'),
         ('unknown_role.jsonl', 2, 'unknown role'), ('non_string_content.jsonl', 2, 'non-string content'),
         ('no_assistant_turn.jsonl', 2, 'no assistant turn'), ('no_turns.jsonl', 2, 'no turns')]
CONV = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2 + 2?'},
        {'role': 'assistant', 'content': 'So 2 + 2 = 4.'}, {'role': 'user', 'content': 'And 3 + 3?'},
        {'role': 'assistant', 'content': '6.'}]


@pytest.fixture(scope='module')
def llama_tok():
    "The tiny tokenizer with Llama 3's special tokens and chat template."
    t = AutoTokenizer.from_pretrained(TINY_TARGET)
    t.add_special_tokens({'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'})
    t.add_tokens(['<|start_header_id|>', '<|end_header_id|>'], special_tokens=True)
    t.chat_template = LLAMA3_TEMPLATE
    return t


# --- validation -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name,row,reason', RULES)
def test_bad_row_is_skipped_and_reported(name, row, reason, tok, tmp_path, capsys):
    ds = prepare(FIX / name, tokenizer=tok, out=tmp_path)
    rep = json.loads((tmp_path / 'report.json').read_text())
    assert [(p['file'], p['row'], p['reason']) for p in rep['problems']] == [(str(FIX / name), row, reason)]
    assert rep['counts'] == {reason: 1} and rep['rows'] == 3 and rep['kept'] == 2
    assert ds.ids == ['ok-1', 'ok-3']
    assert f'skipped 1 of 3 rows: 1 {reason}' in capsys.readouterr().out


@pytest.mark.parametrize('name,row,reason', RULES)
def test_bad_row_strict_raises(name, row, reason, tok, tmp_path):
    with pytest.raises(DataError) as e: prepare(FIX / name, tokenizer=tok, out=tmp_path, strict=True)
    assert str(e.value).startswith('1 bad rows (strict mode)') and f'{FIX / name} row {row}: {reason}' in str(e.value)
    assert json.loads((tmp_path / 'report.json').read_text())['counts'] == {reason: 1}  # the report is still written
    assert not (tmp_path / 'meta.json').exists()


def test_problem_details_say_where():
    _, probs = load_conversations(FIX / 'unknown_role.jsonl')
    assert probs[0]['detail'] == "turn 1: 'narrator'"
    _, probs = load_conversations(FIX / 'non_string_content.jsonl')
    assert probs[0]['detail'] == 'turn 1 (gpt): a JSON number'


@pytest.mark.parametrize('strict', [False, True])
@pytest.mark.parametrize('name,msg', [('not_json.jsonl', 'not JSON or JSONL; first bad line 2'),
                                      ('bad_array.json', 'not valid JSON; first bad line 3'),
                                      ('empty.jsonl', 'the file is empty')])
def test_unreadable_file_is_an_error_in_both_modes(name, msg, strict, tok, tmp_path):
    with pytest.raises(DataError, match='^' + str(FIX / name) + ': ' + msg): prepare(FIX / name, tokenizer=tok, out=tmp_path, strict=strict)


def test_json_array_messages_ids_and_roles():
    rows = read_rows(FIX / 'array.json')
    assert [r for r, _ in rows] == [1, 2, 3, 4]
    convs, probs = load_conversations(FIX / 'array.json')
    assert [c['id'] for c in convs] == ['c-1', '2', '4']  # id, conversation_id, else the row number
    assert [(p['row'], p['reason']) for p in probs] == [(3, 'not an object')]
    assert [m['role'] for m in convs[1]['messages']] == ['user', 'assistant', 'tool', 'assistant']
    assert [m['role'] for m in convs[2]['messages']] == ['user', 'assistant', 'tool']
    assert 'source' not in convs[0]


def test_strict_lists_first_20_and_the_count(tok, tmp_path):
    f = tmp_path / 'many.jsonl'
    f.write_text('\n'.join(json.dumps({'id': i, 'conversations': []}) for i in range(25)))
    with pytest.raises(DataError) as e: prepare(f, tokenizer=tok, out=tmp_path / 'out', strict=True)
    lines = str(e.value).split('\n')
    assert lines[0] == '25 bad rows (strict mode):' and len(lines) == 22 and lines[-1].strip() == '... and 5 more'
    assert lines[20].endswith('row 20: no turns (conversations is empty)')


def test_duplicate_ids_are_reported(tmp_path):
    f = tmp_path / 'dup.jsonl'
    row = {'id': 'x', 'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello.'}]}
    f.write_text(json.dumps(row) + '\n' + json.dumps(row) + '\n')
    convs, probs = load_conversations(f)
    assert len(convs) == 1 and [(p['row'], p['reason']) for p in probs] == [(2, 'duplicate id')]


# --- the loss mask ----------------------------------------------------------------------------------------

def expected_mask(tok, ids, segments):
    "Per-token mask from hand-written `(text, mask)` segments; each token must lie inside one segment."
    text, ends = ''.join(t for t, _ in segments), np.cumsum([len(t) for t, _ in segments])
    pos, out = 0, []
    for i, t in enumerate(tok.convert_ids_to_tokens([int(x) for x in ids])):
        s = tok.convert_tokens_to_string([t])
        seg = int(np.searchsorted(ends, pos, side='right'))
        assert text[pos:pos + len(s)] == s, f'token {i} {t!r} is not the text at {pos}'
        assert np.searchsorted(ends, pos + len(s) - 1, side='right') == seg, f'token {i} {t!r} straddles a segment boundary'
        out.append(segments[seg][1]); pos += len(s)
    assert pos == len(text)
    return out


def check_token_by_token(tok, ids, mask, segments):
    exp = expected_mask(tok, ids, segments)
    for i, (t, m, e) in enumerate(zip(tok.convert_ids_to_tokens([int(x) for x in ids]), mask, exp)):
        assert m == e, f'token {i} {t!r}: mask {m}, expected {e}'
    assert len(mask) == len(exp)


def test_loss_mask_chatml(tok):
    ids, mask = encode(tok, CONV)
    assert ids.tolist() == tok.apply_chat_template(CONV, tokenize=True, return_dict=False)
    segments = [('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n', 0),
                ('So 2 + 2 = 4.<|im_end|>', 1),
                ('\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n', 0),
                ('6.<|im_end|>', 1), ('\n', 0)]
    check_token_by_token(tok, ids, mask, segments)
    toks = tok.convert_ids_to_tokens(ids.tolist())
    assert [m for t, m in zip(toks, mask) if t == '<|im_end|>'] == [0, 0, 1, 0, 1]  # only the assistant's end-of-turn
    assert all(m == 0 for t, m in zip(toks, mask) if t == '<|im_start|>')


def test_loss_mask_llama3(llama_tok):
    conv = CONV[:2] + [{'role': 'assistant', 'content': ' So 2 + 2 = 4.\n'}] + CONV[3:]  # the template trims content
    ids, mask = encode(llama_tok, conv)
    assert ids.tolist() == llama_tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    H = lambda r: f'<|start_header_id|>{r}<|end_header_id|>\n\n'
    segments = [('<|begin_of_text|>' + H('system') + 'Be brief.<|eot_id|>' + H('user') + 'What is 2 + 2?<|eot_id|>' + H('assistant'), 0),
                ('So 2 + 2 = 4.<|eot_id|>', 1), (H('user') + 'And 3 + 3?<|eot_id|>' + H('assistant'), 0), ('6.<|eot_id|>', 1)]
    check_token_by_token(llama_tok, ids, mask, segments)
    assert mask[-1] == 1 and llama_tok.convert_ids_to_tokens(int(ids[-1])) == '<|eot_id|>'


def test_loss_mask_conversation_opening_with_the_assistant(tok, llama_tok):
    conv = [{'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Yes?'}]
    check_token_by_token(tok, *encode(tok, conv), [('<|im_start|>assistant\n', 0), ('Hello!<|im_end|>', 1),
                         ('\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n', 0), ('Yes?<|im_end|>', 1), ('\n', 0)])
    H = lambda r: f'<|start_header_id|>{r}<|end_header_id|>\n\n'
    check_token_by_token(llama_tok, *encode(llama_tok, conv), [('<|begin_of_text|>' + H('assistant'), 0), ('Hello!<|eot_id|>', 1),
                         (H('user') + 'Hi<|eot_id|>' + H('assistant'), 0), ('Yes?<|eot_id|>', 1)])


def test_loss_mask_template_that_is_not_prefix_stable():
    "A Qwen3-style template puts an empty think block in the last reply only: earlier turns render differently."
    t = AutoTokenizer.from_pretrained(TINY_TARGET)
    t.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and loop.last %}"
                       "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    check_token_by_token(t, *encode(t, CONV), [
        ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n', 0),
        ('So 2 + 2 = 4.<|im_end|>', 1), ('\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n', 0),
        ('<think>\n\n</think>\n\n6.<|im_end|>', 1), ('\n', 0)])


def test_tool_turns_are_context(tok):
    conv = [{'role': 'user', 'content': 'Weather?'}, {'role': 'assistant', 'content': 'Let me look.'},
            {'role': 'tool', 'content': '{"temp": 21}'}, {'role': 'assistant', 'content': '21 degrees.'}]
    ids, mask = encode(tok, conv)
    check_token_by_token(tok, ids, mask, [('<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n', 0), ('Let me look.<|im_end|>', 1),
                         ('\n<|im_start|>tool\n{"temp": 21}<|im_end|>\n<|im_start|>assistant\n', 0), ('21 degrees.<|im_end|>', 1), ('\n', 0)])


# --- truncation, min_loss_tokens, the saved dataset -------------------------------------------------------

def write_jsonl(path, convs):
    path.write_text(''.join(json.dumps(dict(id=i, messages=m)) + '\n' for i, m in convs)); return path


def test_truncation_and_min_loss_tokens(tok, tmp_path):
    long_sys = [{'role': 'system', 'content': 'Be brief. ' * 40}] + CONV[1:3]  # the reply starts past token 64
    f = write_jsonl(tmp_path / 'd.jsonl', [('short', CONV[1:3]), ('long-sys', long_sys), ('long', CONV[1:2] + [{'role': 'assistant', 'content': 'ok ' * 100}])])
    ds = prepare(f, tokenizer=tok, out=tmp_path / 'out', max_length=64)
    rep = json.loads((tmp_path / 'out' / 'report.json').read_text())
    assert ds.ids == ['short', 'long'] and ds.lengths.max() == 64 and ds.lengths[0] == len(encode(tok, CONV[1:3])[0])
    assert rep['truncated'] == 2 and rep['counts'] == {'too few loss tokens': 1}
    assert rep['problems'][0]['id'] == 'long-sys' and rep['problems'][0]['row'] == 2
    full = encode(tok, CONV[1:2] + [{'role': 'assistant', 'content': 'ok ' * 100}])
    assert (ds[1]['input_ids'] == full[0][:64]).all() and (ds[1]['loss_mask'] == full[1][:64]).all()
    n_short = int(encode(tok, CONV[1:3])[1].sum())
    ds = prepare(f, tokenizer=tok, out=tmp_path / 'out2', max_length=64, min_loss_tokens=n_short + 1)
    assert ds.ids == ['long'] and json.loads((tmp_path / 'out2' / 'report.json').read_text())['counts'] == {'too few loss tokens': 2}


def test_save_load_round_trip(tok, tmp_path):
    convs, _ = load_conversations(HELDOUT_DATA, max_samples=50)
    ds = prepare(HELDOUT_DATA, tokenizer=tok, out=tmp_path, max_length=128, max_samples=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'input_ids.npy', 'loss_mask.npy', 'meta.json', 'offsets.npy', 'report.json']
    ds = TokenizedDataset.load(tmp_path)
    assert isinstance(ds.input_ids, np.memmap) and isinstance(ds.loss_mask, np.memmap)
    assert np.load(tmp_path / 'input_ids.npy').dtype == np.int32 and np.load(tmp_path / 'loss_mask.npy').dtype == np.uint8
    assert np.load(tmp_path / 'offsets.npy').dtype == np.int64 and len(np.load(tmp_path / 'offsets.npy')) == len(ds) + 1
    assert len(ds) == 50 and ds.ids == [c['id'] for c in convs] and np.issubdtype(ds.lengths.dtype, np.integer)
    for c, s in zip(convs, ds):
        ids, mask = encode(tok, c['messages'])
        assert s['id'] == c['id'] and (s['input_ids'] == ids[:128]).all() and (s['loss_mask'] == mask[:128]).all()
    meta = json.loads((tmp_path / 'meta.json').read_text())
    assert meta['max_length'] == 128 and meta['tokenizer'] == target_name(TINY_TARGET) and meta['n'] == 50 and meta['ids'] == ds.ids
    st = ds.stats()
    assert st['n'] == 50 and st['tokens'] == ds.lengths.sum() == meta['tokens'] and st['max_len'] <= 128
    assert st['loss_tokens'] == sum(int(s['loss_mask'].sum()) for s in ds) and st['min_len'] <= st['p50_len'] <= st['p90_len'] <= st['max_len']
    assert ds.plot_lengths().axes[0].get_xlabel() == 'tokens per sample'
    with pytest.raises(IndexError): ds[50]
    (tmp_path / 'meta.json').unlink()
    with pytest.raises(DataError, match='no meta.json'): TokenizedDataset.load(tmp_path)


# --- the CLI ----------------------------------------------------------------------------------------------

def test_prepare_cli(tmp_path):
    exe = Path(sys.executable).parent / 'dflash_prepare'
    cmd = [str(exe)] if exe.exists() else [sys.executable, '-c', 'from dflash.data import prepare_cli; prepare_cli()']
    r = subprocess.run(cmd + ['--data', str(FIX / 'unknown_role.jsonl'), '--out', str(tmp_path / 'a'), '--max-length', '64'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert 'skipped 1 of 3 rows: 1 unknown role' in r.stdout and TokenizedDataset.load(tmp_path / 'a').ids == ['ok-1', 'ok-3']
    assert json.loads((tmp_path / 'a' / 'meta.json').read_text())['max_length'] == 64
    r = subprocess.run(cmd + ['--data', str(FIX / 'unknown_role.jsonl'), '--out', str(tmp_path / 'b'), '--strict'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f'{FIX / "unknown_role.jsonl"} row 2: unknown role' in r.stderr
    assert not (tmp_path / 'b' / 'meta.json').exists() and (tmp_path / 'b' / 'report.json').exists()


# --- regeneration -----------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def random_target(tmp_path_factory, make_target, save_target):
    "A random-weight tiny qwen3_5 model with the tiny tokenizer, saved like a real target."
    return save_target(make_target('qwen3_5'), tmp_path_factory.mktemp('target'))


def test_regenerate_resumes(random_target, tmp_path):
    src = write_jsonl(tmp_path / 'src.jsonl', [('a', CONV), ('b', CONV[1:3]), ('c', CONV[:3] + [{'role': 'user', 'content': 'Thanks'}])])
    out = tmp_path / 'regen.jsonl'
    regenerate(random_target, src, out, batch_size=2, max_new_tokens=6, max_samples=2)  # "interrupted" after two
    assert sorted(json.loads(l)['id'] for l in open(out)) == ['a', 'b']
    with open(out, 'a') as f: f.write('{"id": "c", "messages": [{"role": "us')  # a half-written last line
    regenerate(random_target, src, out, batch_size=2, max_new_tokens=6)
    regenerate(random_target, src, out, batch_size=2, max_new_tokens=6)  # nothing left to do
    rows = [json.loads(l) for l in open(out)]
    assert sorted(r['id'] for r in rows) == ['a', 'b', 'c']  # each exactly once
    old = {c['id']: c['messages'] for c in load_conversations(src)[0]}
    for r in rows:
        assert [m['role'] for m in r['messages']] == [m['role'] for m in old[r['id']]]
        for m, o in zip(r['messages'], old[r['id']]):
            assert (m['content'] != o['content']) if m['role'] == 'assistant' else (m['content'] == o['content'])
    assert {p['reason'] for p in load_conversations(out)[1]} <= {'empty reply'}  # valid input for prepare (a random target may reply nothing)


def test_regenerate_left_padding_greedy_and_seeded_sampling(random_target, tmp_path):
    "Greedy replies do not depend on the batch (left padding is masked); sampling repeats with its seed."
    src = write_jsonl(tmp_path / 'src.jsonl', [('a', CONV[1:3]), ('b', CONV)])  # prompts of different lengths
    read = lambda f: {r['id']: r['messages'] for r in map(json.loads, open(f))}
    outs = {}
    for name, kw in [('g1', dict(batch_size=1)), ('g2', dict(batch_size=2)), ('s1', dict(temperature=1.0, seed=1)),
                     ('s2', dict(temperature=1.0, seed=1)), ('s3', dict(temperature=1.0, seed=2))]:
        regenerate(random_target, src, tmp_path / f'{name}.jsonl', max_new_tokens=8, **{'batch_size': 2, **kw})
        outs[name] = read(tmp_path / f'{name}.jsonl')
    assert outs['g1'] == outs['g2'] and outs['s1'] == outs['s2'] and outs['s1'] != outs['s3']
