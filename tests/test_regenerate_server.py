"""The server path of `dflash_regenerate` against real `transformers serve` processes on local ports: replies equal to the
in-process path's at temperature 0, a server killed in the middle of a run (the job stops naming it, the file is kept, the
same command resumes on a restarted server), and the work of a dead server moved to a live one."""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest
from dflash.core import HELDOUT_DATA, TINY_TARGET
from dflash.data import load_conversations
from dflash.regenerate import regenerate
from dflash.server import LocalServer, RequestRefused

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not

BIN = Path(sys.executable).parent
ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'OMP_WAIT_POLICY': 'PASSIVE'}
N, MAX_NEW = 16, 24   # 16 held-out conversations (1 to 3 replies each), 24 tokens a reply: ~4 s on one server here


def write_convs(path, convs):
    path.write_text(''.join(json.dumps(dict(id=c['id'], messages=c['messages'])) + '\n' for c in convs))
    return path


def rows(path): return [json.loads(l) for l in open(path)]


def by_id(path): return {r['id']: r['messages'] for r in rows(path)}


def start(*args):
    return subprocess.Popen([str(BIN / 'dflash_regenerate'), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def lines_in(path): return sum(1 for l in open(path) if l.endswith('\n')) if path.exists() else 0


def wait_lines(path, n, proc, timeout=120):
    "Wait until `path` holds `n` whole lines (the job is under way), while `proc` runs."
    t0 = time.monotonic()
    while lines_in(path) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


@pytest.fixture(scope='module')
def convs(tmp_path_factory):
    "The first held-out conversations, and their replies regenerated in process (batches of 4) at temperature 0."
    d = tmp_path_factory.mktemp('convs')
    src = write_convs(d / 'src.jsonl', load_conversations(HELDOUT_DATA, max_samples=N)[0])
    return src, by_id(regenerate(TINY_TARGET, src, d / 'ref.jsonl', batch_size=4, max_new_tokens=MAX_NEW))


def test_kill_mid_run_then_resume_on_a_restarted_server(convs, tmp_path):
    "Killed mid-run: exit 1 naming the server, whole lines kept; the same command resumes; replies equal the in-process ones."
    src, ref = convs
    out = tmp_path / 'served.jsonl'
    srv = LocalServer(TINY_TARGET, '--dtype', 'float32', env=ENV)
    cmd = ['--server', srv.url, '--data', src, '--out', out, '--max-new-tokens', MAX_NEW, '--in-flight', 3, '--retries', 1]
    try:
        p = start(*cmd)
        wait_lines(out, 3, p)
        srv.kill()
        so, se = p.communicate(timeout=120)
        assert p.returncode == 1 and f'no server left: {srv.url}' in se and 'the same command does the other' in se, (so[-2000:], se[-2000:])
        kept = rows(out)   # every line whole (json.loads would fail on a half-written one)
        assert 3 <= len(kept) < N and len({r['id'] for r in kept}) == len(kept)
        srv = LocalServer(TINY_TARGET, '--dtype', 'float32', port=srv.port, env=ENV)   # back on the same address
        p = start(*cmd); so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        assert f'{len(kept)} already in {out}, {N - len(kept)} to do' in so and 'replies ended by the target' in so
        got = rows(out)
        assert [r['id'] for r in got[:len(kept)]] == [r['id'] for r in kept] and len({r['id'] for r in got}) == len(got) == N
        assert by_id(out) == ref   # greedy: the server's replies are the in-process path's, turn by turn
        # A reply whose end-of-turn token comes exactly as its max_tokens-th is 'stop' here but 'length' to transformers serve
        # (it compares the generated tokens, the end token included, with max_tokens), so the server may count more cut replies.
        here = {r['id']: r['truncated_turns'] for r in rows(src.with_name('ref.jsonl'))}
        assert all(r['truncated_turns'] >= here[r['id']] for r in got) and sum(here.values()) > 0
        # a request the server refuses (transformers serve takes no top_k): the job stops at once, naming it, instead of retrying
        with pytest.raises(RequestRefused, match=f'HTTP 422.*top_k') as e:
            regenerate(TINY_TARGET, src, tmp_path / 'topk.jsonl', server=srv.url, temperature=1.0, top_k=5, max_new_tokens=4)
        assert srv.url in str(e.value) and not lines_in(tmp_path / 'topk.jsonl')
        # on_refused='skip': each refused conversation is listed, none written, and a job refused every time fails; the next run
        # (fixed) does them and the list goes
        skip = tmp_path / 'skip.jsonl'
        with pytest.raises(RuntimeError, match='the server refused 4 of 4 conversations .*HTTP 422.*top_k'):   # all refused: a failing exit
            regenerate(TINY_TARGET, src, skip, server=srv.url, temperature=1.0, top_k=5, max_new_tokens=4, max_samples=4, on_refused='skip')
        listed = rows(skip.with_suffix('.refused.jsonl'))
        assert not lines_in(skip) and len(listed) == 4 and all('HTTP 422' in r['error'] for r in listed)
        regenerate(TINY_TARGET, src, skip, server=srv.url, max_new_tokens=4, max_samples=4, on_refused='skip')
        assert lines_in(skip) == 4 and {r['id'] for r in rows(skip)} == {r['id'] for r in listed}
        assert not skip.with_suffix('.refused.jsonl').exists()
    finally:
        srv.stop()


def test_a_dead_servers_work_goes_to_the_other(convs, tmp_path):
    "Two servers, one killed mid-run: it is reported by address, the other finishes; every conversation once, as in process."
    src, ref = convs
    out = tmp_path / 'served.jsonl'
    a, b = LocalServer(TINY_TARGET, '--dtype', 'float32', env=ENV), LocalServer(TINY_TARGET, '--dtype', 'float32', env=ENV)
    try:
        p = start('--server', f'{a.url},{b.url}', '--data', src, '--out', out, '--max-new-tokens', MAX_NEW, '--in-flight', 2, '--retries', 1)
        wait_lines(out, 2, p)
        a.kill()
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        assert f'server {a.url} given up' in so and f'its work goes to {b.url}' in so, so[-3000:]
        got = rows(out)
        assert len(got) == N and len({r['id'] for r in got}) == N and by_id(out) == ref
    finally:
        a.stop(); b.stop()


@pytest.mark.slow
def test_real_target_on_a_server(smol, tmp_path):
    "SmolLM2-135M-Instruct on transformers serve: killed after the first conversation, resumed; the replies are the in-process ones."
    rows_ = [json.loads(l) for l in open(HELDOUT_DATA.parent / 'real' / 'sharegpt-prompts-heldout.jsonl')][:6]
    src = tmp_path / 'prompts.jsonl'
    src.write_text(''.join(json.dumps(r) + '\n' for r in rows_))
    ref = by_id(regenerate(smol, src, tmp_path / 'ref.jsonl', batch_size=6, max_new_tokens=16))
    out = tmp_path / 'served.jsonl'
    srv = LocalServer(smol, env=ENV)
    cmd = ['--server', srv.url, '--data', src, '--out', out, '--max-new-tokens', 16, '--in-flight', 2, '--retries', 0]
    try:
        p = start(*cmd)
        wait_lines(out, 1, p)
        srv.kill()
        so, se = p.communicate(timeout=120)
        assert p.returncode == 1 and srv.url in se and 1 <= lines_in(out) < 6, se[-2000:]
        srv = LocalServer(smol, port=srv.port, env=ENV)
        p = start(*cmd); so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        assert by_id(out) == ref and all(m['content'] for msgs in ref.values() for m in msgs if m['role'] == 'assistant')
    finally:
        srv.stop()
