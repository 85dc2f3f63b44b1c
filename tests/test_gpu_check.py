"The GPU check's reduced form on the CPU: every path it checks on a GPU runs here too, so the script cannot rot."
import json, subprocess, sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--cpu', '--out', str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / 'gpu-check.json').read_text())
    assert set(rep['checks']) == {'flex', 'step', 'extract', 'budget', 'online', 'tree'} and all(c['status'] == 'passed' for c in rep['checks'].values())
    assert rep['checks']['budget']['ooms'] > 0 and rep['checks']['extract']['complete'] and (tmp_path / 'gpu-check.md').exists()
