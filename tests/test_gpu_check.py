"The GPU check's reduced form on the CPU: every path it checks on a GPU runs here too, asserting the same results, so the script cannot rot."
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--cpu', '--out', str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / 'gpu-check.json').read_text())
    c = rep['checks']
    assert list(c) == ['flex', 'step', 'extract', 'budget', 'train', 'online', 'stop', 'lossless'] and all(v['status'] == 'passed' for v in c.values())
    assert c['budget']['ooms'] > 0 and c['extract']['stored_vs_capture'] == 0 and c['train']['resume_max_relative_weight_difference'] == 0
    assert c['stop']['seconds_to_end'] < 30 and c['flex']['compiled_graphs'] > 0 and '| online | passed |' in (tmp_path / 'gpu-check.md').read_text()


def test_gpu_check_refuses_an_unknown_check(tmp_path):
    "A check name that does not exist is refused before anything runs, naming the checks there are."
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--cpu', '--only', 'nothing', '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no check ['nothing']" in r.stderr
