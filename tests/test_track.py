"""Experiment trackers for real and offline: each run read back from the tracker's own store (TensorBoard's event files,
trackio's SQLite store, wandb's offline transaction log, MLflow's file store), values and steps against what was logged
and against metrics.jsonl; a resumed run continues the same tracker run; a missing or broken tracker stops a job in one line."""
import configparser, json, os, shlex, struct, subprocess, sys, tempfile, uuid
from pathlib import Path
import pytest

# trackio reads TRACKIO_DIR once, at import: a store of the tests' own, never the user's (set before anything imports it)
os.environ.setdefault('TRACKIO_DIR', tempfile.mkdtemp(prefix='trackio-tests-'))
from dflash.core import TINY_TARGET, TRAIN_DATA, HELDOUT_DATA, HELDOUT_REGEN, read_metrics
from dflash.track import TRACKERS, Trackers, TrackerError, check_trackers, flat_metrics

ROOT = Path(__file__).resolve().parent.parent
ALL = list(TRACKERS)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv('WANDB_MODE', 'offline'); monkeypatch.setenv('WANDB_SILENT', 'true')
    for k in ('MLFLOW_TRACKING_URI', 'MLFLOW_EXPERIMENT_NAME', 'WANDB_PROJECT'): monkeypatch.delenv(k, raising=False)


# --- each tracker's store, read back: {metric: [(step, value), ...]} in the order stored, and the config it got ---

def wandb_records(path):
    """The records of a wandb transaction log (`run-ID.wandb`): after a 7-byte header (':W&B', magic, version), LevelDB's log
    format (32 KiB blocks; each record a 7-byte header, crc32c, length, type: full, or first/middle/last pieces), each record one
    protobuf `Record` of wandb's own schema (`wandb.proto.wandb_internal_pb2`). wandb 0.31 has no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, buf, B = Path(path).read_bytes(), 7, b'', 32768
    assert data[:4] == b':W&B', f'{path}: not a wandb transaction log'
    while pos + 7 <= len(data):
        if B - pos % B < 7: pos += B - pos % B; continue          # a block's tail too short for a header is padding
        _, n, kind = struct.unpack('<IHB', data[pos:pos + 7]); pos += 7
        if kind == 0: break
        buf += data[pos:pos + n]; pos += n
        if kind in (1, 4): r = pb.Record(); r.ParseFromString(buf); buf = b''; yield r


def read_wandb(out, st):
    hist, config, ids = {}, {}, set()
    def start(f):       # offline-run-<time>-<id>, and -<id>-1, -2 ... when a start falls in the same second as the last
        stamp, _, n = f.parent.name.removeprefix('offline-run-').partition(f"-{st['id']}")
        return stamp, int(n.lstrip('-') or 0)
    for f in sorted((out / 'wandb').glob(f"offline-run-*-{st['id']}*/run-{st['id']}.wandb"), key=start):   # one folder per start, in order
        for r in wandb_records(f):
            kind = r.WhichOneof('record_type')
            if kind == 'run':
                ids.add(r.run.run_id); config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == 'history':
                items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                for k, v in items.items():
                    if not k.startswith('_'): hist.setdefault(k, []).append((items['_step'], v))
    assert ids == {st['id']}, ids
    return hist, {k: v.get('value', v) if isinstance(v, dict) else v for k, v in config.items() if not k.startswith('_')}


def read_tensorboard(out, st):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(out / st['log_dir']), size_guidance={'scalars': 0, 'tensors': 0}); ea.Reload()
    hist = {k: [(e.step, e.value) for e in ea.Scalars(k)] for k in ea.Tags()['scalars']}
    text = ea.Tensors('config/text_summary')[-1].tensor_proto.string_val[0].decode()
    return hist, json.loads(text)


def read_mlflow(out, st):
    from mlflow.tracking import MlflowClient
    c = MlflowClient((out / st['store']).resolve().as_uri())
    run = c.get_run(st['run_id'])
    hist = {k: [(m.step, m.value) for m in sorted(c.get_metric_history(st['run_id'], k), key=lambda m: (m.timestamp, m.step))] for k in run.data.metrics}
    def value(v):                          # a param is the string itself, or JSON of anything else
        try: return json.loads(v)
        except ValueError: return v
    return hist, {k: value(v) for k, v in run.data.params.items()}


def read_trackio(out, st):
    from trackio.sqlite_storage import SQLiteStorage
    hist = {}
    for row in SQLiteStorage.get_logs(st['project'], st['name']):
        for k, v in row.items():
            if k not in ('step', 'timestamp'): hist.setdefault(k, []).append((row['step'], v))
    return hist, {k: v for k, v in SQLiteStorage.get_run_config(st['project'], st['name']).items() if not k.startswith('_')}


READ = dict(tensorboard=read_tensorboard, trackio=read_trackio, wandb=read_wandb, mlflow=read_mlflow)


def read(name, out):
    return READ[name](out, json.loads((out / 'trackers.json').read_text())[name])


def expected(recs, step=lambda r: r['step']):
    e = {}
    for r in recs:
        for k, v in flat_metrics(r).items(): e.setdefault(k, []).append((step(r), v))
    return e


def close_to(got, want):
    "Same keys, same steps in the same order, values equal to float32 precision (TensorBoard stores float32)."
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]], (k, got[k], want[k])
        assert all(abs(a - b) <= 1e-6 * max(1, abs(b)) for (_, a), (_, b) in zip(got[k], want[k])), (k, got[k], want[k])


RECS = [dict(step=s, loss=4.0 / s, acc=[0.5 / s, 0.25 / s, 0.0], lr=1e-3 * s, tokens_per_s=1000.0 + s, q_hs=s % 3, mem=dict(d0=s << 20, t0=s << 21),
             target_idle=None, lossless=s % 2 == 0, checkpoint='a string', time=1.8e9 + s) for s in (5, 10, 15)]
CONFIG = dict(lr=0.001, layer_ids=[1, 9, 17], target='acme/qwen3', drafters=2)


@pytest.mark.parametrize('name', ALL)
def test_a_run_reads_back_and_a_resume_continues_it(name, tmp_path):
    "Every number of every record at its step, the config once; then a resume from step 10 continues the same run id."
    out, project = tmp_path / 'run', f'dflash-test-{uuid.uuid4().hex[:8]}'
    with Trackers(name, out, run_name='r1', config=CONFIG, project=project) as tr:
        for r in RECS: tr.log(r, r['step'])
    first = json.loads((out / 'trackers.json').read_text())
    hist, config = read(name, out)
    close_to(hist, expected(RECS))
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert set(hist) == {'loss', 'acc/slot_1', 'acc/slot_2', 'acc/slot_3', 'lr', 'tokens_per_s', 'q_hs', 'mem/d0', 'mem/t0', 'lossless'}

    # the run died after step 15 and resumes from its checkpoint at step 10: steps 15 and 20 are logged anew
    again = [dict(RECS[2], loss=0.3), dict(RECS[2], step=20, loss=0.2)]
    with Trackers(name, out, run_name='ignored: the stored one wins', config=CONFIG, resume=True, resume_step=10, project='other') as tr:
        for r in again: tr.log(r, r['step'])
    assert json.loads((out / 'trackers.json').read_text()) == first     # the same run: same ids, same names, same places
    loss = [(s, round(v, 6)) for s, v in read(name, out)[0]['loss']]
    assert loss[:2] == [(5, 0.8), (10, 0.4)] and loss[-2:] == [(15, 0.3), (20, 0.2)], loss
    # TensorBoard purges what the dead run logged after the resume step; the others keep both lines of step 15
    assert len(loss) == (4 if name == 'tensorboard' else 5)


def test_several_at_once_and_a_new_run_beside_an_old_one(tmp_path):
    "Two trackers at once; resume=False in the same out starts new tracker runs, never mixing into the old ones."
    out = tmp_path / 'run'
    with Trackers('tensorboard,mlflow', out, run_name='a') as tr: tr.log(RECS[0], 5)
    a = json.loads((out / 'trackers.json').read_text())
    with Trackers('tensorboard,mlflow', out, run_name='a') as tr: tr.log(RECS[1], 10)
    b = json.loads((out / 'trackers.json').read_text())
    assert a['tensorboard']['log_dir'] == 'tensorboard/a' and b['tensorboard']['log_dir'] == 'tensorboard/a-2'
    assert a['mlflow']['run_id'] != b['mlflow']['run_id']
    for name in ('tensorboard', 'mlflow'): close_to(read(name, out)[0], expected(RECS[1:2]))
    assert read_tensorboard(out, a['tensorboard'])[0]['loss'] == [(5, 0.800000011920929)]


def test_none_writes_nothing(tmp_path):
    with Trackers('none', tmp_path / 'run') as tr: tr.log(RECS[0], 5)
    assert not (tmp_path / 'run').exists() and not tr.names


def test_refusals_are_one_line(monkeypatch):
    "An unknown name, and a tracker whose package does not import (hidden here), each named with the pip install that fixes it."
    with pytest.raises(TrackerError, match="unknown tracker 'nosuch'; choose from tensorboard, trackio, wandb, mlflow, or none"):
        check_trackers('tensorboard,nosuch')
    for name, mod in [('wandb', 'wandb'), ('trackio', 'trackio'), ('mlflow', 'mlflow'), ('tensorboard', 'torch.utils.tensorboard')]:
        monkeypatch.setitem(sys.modules, mod, None)
        with pytest.raises(TrackerError) as e: check_trackers(name)
        msg = str(e.value)
        assert '\n' not in msg and msg.startswith(f'report_to={name}: the {name} tracker is not installed') and msg.endswith(f"pip install '{TRACKERS[name][1]}'")


def test_a_tracker_that_fails_to_start(tmp_path, monkeypatch):
    "A tracker that imports but cannot start (an MLflow store it cannot use) stops with one line; the ones started are closed."
    monkeypatch.setenv('MLFLOW_TRACKING_URI', 'nosuchscheme://nowhere')
    with pytest.raises(TrackerError, match=r'^report_to=mlflow: mlflow did not start \(') as e: Trackers('tensorboard,mlflow', tmp_path / 'run')
    assert '\n' not in str(e.value) and not (tmp_path / 'run' / 'trackers.json').exists()


def test_the_extra_is_the_same_list():
    "settings.ini's track extra installs exactly what the refusals name."
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT / 'settings.ini')
    assert shlex.split(cfg['DEFAULT']['track_requirements']) == [req for _, req in TRACKERS.values()]


# --- the jobs ---

@pytest.fixture(scope='module')
def few(tmp_path_factory):
    p = tmp_path_factory.mktemp('data') / 'few.jsonl'
    p.write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    return p


def test_extraction_logs_what_metrics_jsonl_has(few, tmp_path):
    "Every metrics.jsonl line of an extraction, in all four trackers at its step (samples done); a resumed extraction continues."
    from dflash.extract import extract
    out = tmp_path / 'x'
    kw = dict(target=str(TINY_TARGET), data=str(few), out=str(out), layer_ids=[1, 3], token_budget=512, log_every=0, progress=False,
              report_to=','.join(ALL))
    extract(max_samples=20, **kw)
    first = json.loads((out / 'trackers.json').read_text())
    lines = [r for r in read_metrics(out) if 'tokens_per_s' in r]
    assert len(lines) > 2 and lines[-1]['samples'] == 20
    for name in ALL:
        hist, config = read(name, out)
        close_to(hist, expected(lines, step=lambda r: r['samples']))
        assert config['layer_ids'] == [1, 3] and config['report_to'] == ','.join(ALL)
    extract(**kw)                                                   # the other 20: the same tracker runs, steps 20 on
    assert json.loads((out / 'trackers.json').read_text()) == first
    runs = []
    for r in read_metrics(out):
        if r.get('event') == 'start': runs.append([])
        elif 'tokens_per_s' in r: runs[-1].append(r)
    want = expected(runs[0], step=lambda r: r['samples'])
    for k, v in expected(runs[1], step=lambda r: 20 + r['samples']).items(): want[k] = want[k] + v
    assert runs[1] and runs[1][-1]['samples'] == 20
    for name in ALL: close_to(read(name, out)[0], want)


def test_training_logs_what_metrics_jsonl_has(few, tmp_path):
    """A training run in all four trackers: every metrics.jsonl line (steps, held-out acceptance, the final lossless tau) at its
    step, the resolved config once; a resume continues the same tracker runs."""
    from dflash.extract import extract
    from dflash.train import train
    import shutil
    x = extract(target=str(TINY_TARGET), data=str(few), out=str(tmp_path / 'x'), layer_ids=[4], token_budget=512, progress=False)['out']
    (tmp_path / 'held.jsonl').write_text(''.join(open(HELDOUT_REGEN).readlines()[:6]))
    v = extract(target=str(TINY_TARGET), data=str(tmp_path / 'held.jsonl'), out=str(tmp_path / 'v'), layer_ids=[4], token_budget=512, progress=False)['out']
    out = tmp_path / 'run'
    kw = dict(extracted=x, out=str(out), drafters=1, num_layers=1, num_anchors=8, token_budget=512, max_steps=6, log_every=2, ckpt_every=2,
              keep=5, val_extracted=v, eval_every=3, eval_prompts=2, eval_max_new_tokens=16, progress=False, report_to=','.join(ALL))
    train(**kw)
    recs = [r for r in read_metrics(out) if 'event' not in r]
    assert {'val_tau', 'tau', 'tau_ngram'} <= {k for r in recs for k in r}
    last = max(r['step'] for r in recs if 'loss' in r)
    at = lambda r: last if r.get('final') else r['step']          # the final tau (of the best drafter) at the run's last step
    for name in ALL:
        hist, config = read(name, out)
        close_to(hist, expected(recs, at))
        assert config['num_layers'] == 1 and config['eval_every'] == 3 and config['report_to'] == ','.join(ALL)
    first = json.loads((out / 'trackers.json').read_text())
    shutil.rmtree(out / 'checkpoints' / 'step-6'); shutil.rmtree(out / 'drafter'); (out / 'result.json').unlink()
    train(resume=True, **kw)
    assert json.loads((out / 'trackers.json').read_text()) == first       # the same tracker runs, continued
    tb = dict(read('tensorboard', out)[0]['loss'])
    assert sorted(tb) == [2, 4, 6] and tb[6] == pytest.approx([r['loss'] for r in read_metrics(out) if 'loss' in r][-1], rel=1e-6)


def test_jobs_refuse_before_they_start(few, tmp_path):
    "From a shell: an unknown tracker, a tracker not installed, and one that does not start each stop the job in one line, with no shard written."
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    args = ['--target', str(TINY_TARGET), '--data', str(few), '--layer-ids', '1,3', '--no-progress']
    def run(*extra, code='from dflash.extract import extract_cli; extract_cli()', env=env):
        return subprocess.run([sys.executable, '-c', code, *args, *extra], capture_output=True, text=True, timeout=300, env=env)
    r = run('--out', tmp_path / 'a', '--report-to', 'tensorboard,nosuch')
    assert r.returncode == 1 and "unknown tracker 'nosuch'" in r.stderr and not (tmp_path / 'a').exists(), r.stderr[-2000:]
    r = run('--out', tmp_path / 'b', '--report-to', 'wandb', code="import sys; sys.modules['wandb'] = None\nfrom dflash.extract import extract_cli; extract_cli()")
    err = [l for l in r.stderr.splitlines() if l.startswith('dflash_extract: error')]
    assert r.returncode == 1 and len(err) == 1 and err[0].endswith(f"pip install '{TRACKERS['wandb'][1]}'") and not (tmp_path / 'b').exists(), r.stderr[-2000:]
    r = run('--out', tmp_path / 'c', '--report-to', 'mlflow', env={**env, 'MLFLOW_TRACKING_URI': 'nosuchscheme://nowhere'})
    assert r.returncode == 1 and 'report_to=mlflow: mlflow did not start' in r.stderr and not list((tmp_path / 'c').glob('shard-*')), r.stderr[-2000:]
    r = subprocess.run([sys.executable, '-c', 'from dflash.regenerate import regenerate_cli; regenerate_cli()', '--data', str(few),
                        '--out', str(tmp_path / 'r.jsonl'), '--report-to', 'nosuch'], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "unknown tracker 'nosuch'" in r.stderr and not (tmp_path / 'r.jsonl').exists(), r.stderr[-2000:]


def test_regeneration_logs_its_progress_and_totals(tmp_path):
    "Conversations done (the step), tokens/s, and at the end the replies ended, cut and empty; a resumed run continues the same run."
    from dflash.regenerate import regenerate, track_dir
    src = tmp_path / 'four.jsonl'
    src.write_text(''.join(open(HELDOUT_DATA).readlines()[:4]))
    out = tmp_path / 'regen.jsonl'
    regenerate(TINY_TARGET, src, out, batch_size=2, max_new_tokens=8, max_samples=2, report_to='tensorboard,mlflow')
    regenerate(TINY_TARGET, src, out, batch_size=2, max_new_tokens=8, report_to='tensorboard,mlflow')
    rows = [json.loads(l) for l in open(out)]                                             # the first run's two, then the others
    replies = [sum(m['role'] == 'assistant' for m in r['messages']) for r in rows]
    cut = [sum(r['truncated_turns'] for r in rows[:2]), sum(r['truncated_turns'] for r in rows[2:])]
    for name in ('tensorboard', 'mlflow'):
        hist, config = read(name, track_dir(out))
        assert config['max_new_tokens'] == 8
        conv = hist['conversations']
        assert conv[-1] == (4, 4) and (2, 2) in conv and all(s == v for s, v in conv)   # the step is the conversations done
        cuts, ended = dict(hist['replies_cut']), dict(hist['replies_ended'])              # each run's own counts, at its last step
        assert [cuts[2], cuts[4]] == cut and [cuts[2] + ended[2], cuts[4] + ended[4]] == [sum(replies[:2]), sum(replies[2:])]
        assert all(v > 0 for _, v in hist['tokens_per_s']) and dict(hist['replies_empty'])[4] >= 0
