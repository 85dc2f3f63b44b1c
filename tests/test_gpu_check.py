"The GPU check's reduced form on the CPU: every path it checks on a GPU runs here too, asserting the same results, so the script cannot rot."
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--cpu', '--out', str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / 'gpu-check.json').read_text())
    c = rep['checks']
    assert list(c) == ['flex', 'step', 'extract', 'budget', 'train', 'online', 'stop', 'lossless', 'seeds'] and all(v['status'] == 'passed' for v in c.values())
    assert c['train']['resume_first_step'] == 'bit-exact' and c['seeds']['steps'] >= 1 and c['seeds']['planned_gb'] > 0   # the plan of a stated GPU
    assert all('compile_s' in v for v in c.values()) and rep['estimate_s'] > 0 and 'against an estimate of' in (tmp_path / 'gpu-check.md').read_text()
    assert c['budget']['ooms'] > 0 and c['extract']['stored_vs_capture'] == 0 and c['train']['resume_max_relative_weight_difference'] == 0
    assert c['stop']['seconds_to_end'] < 30 and c['flex']['compiled_graphs'] > 0 and '| online | passed |' in (tmp_path / 'gpu-check.md').read_text()


def test_gpu_check_refuses_an_unknown_check(tmp_path):
    "A check name that does not exist is refused before anything runs, naming the checks there are."
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--cpu', '--only', 'nothing', '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no check ['nothing']" in r.stderr


def test_a_timed_out_check_leaves_no_process(tmp_path):
    "A check over its timeout ends in a Timeout, and the processes it started are killed with it; compiling is not counted."
    import importlib.util, os, time
    spec = importlib.util.spec_from_file_location('gpu_check', ROOT / 'tools' / 'gpu_check.py')
    gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
    clock = gc.CompileClock()
    t0, child = time.time(), None
    try:
        with gc.deadline(1, clock) as info:
            child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
            time.sleep(30)
        raise AssertionError('no timeout')
    except gc.Timeout as e: assert 'compiling in this process not counted' in str(e) and time.time() - t0 < 10
    assert child.wait(timeout=10) is not None and 'compile_s' in info
    clock._start(); time.sleep(1.5)                               # a compile under way: its time is not the check's
    with gc.deadline(1, clock): time.sleep(2)
    clock._end(); assert clock.seconds() >= 3


def test_the_parts_cover_every_check_within_a_device_call():
    "Every check is in a part, and each part's estimate fits one device call (10 minutes) with room for the machine's start."
    import importlib.util
    spec = importlib.util.spec_from_file_location('gpu_check', ROOT / 'tools' / 'gpu_check.py')
    gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
    needs = {'budget', 'train', 'online', 'stop', 'seeds'}                 # they read extract's target and data
    assert set().union(*gc.PARTS.values()) == set(gc.ESTIMATE)
    assert all(p.index('extract') < min(p.index(n) for n in needs & set(p)) for p in gc.PARTS.values())
    assert all(sum(gc.ESTIMATE[n] for n in p) <= gc.LIMIT <= 600 - 60 for p in gc.PARTS.values())
