"One chaos trial of each job: a random fault at a random moment, then a resume that ends identical to an uninterrupted run."
import subprocess, sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_trial_of_each_job(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'chaos.py'), '--n', '1', '--seed', '7', '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for job in ('extract', 'offline', 'online'): assert f'{job}: 1 of 1 identical after resume' in r.stdout, r.stdout[-3000:]
