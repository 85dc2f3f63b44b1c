"dflash_treecal as a user runs it: the reasons it refuses bad input, in one line each, with the exit status."
import subprocess, sys
from pathlib import Path
import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize('args,why', [
    ([], 'drafter: required'),
    (['--drafter', '{tmp}', '--extracted', '{val}'], 'is not a drafter checkpoint (no config.json)'),
    (['--drafter', '{ckpt}', '--extracted', '{tmp}'], 'is not an extraction (no manifest.json)'),
    (['--drafter', '{ckpt}', '--extracted', '{val}', '--budget', '2000'], 'a DDTree budget is a number of nodes in 0..1024'),
    (['--drafter', '{ckpt}', '--extracted', '{val}', '--budgets', '4,x'], "budgets='4,x': tree budgets, comma-separated"),
    (['--drafter', '{ckpt}', '--extracted', '{val}', '--min-z', '-1'], 'min_z=-1.0: must be >= 0'),
])
def test_treecal_refuses_bad_input(tmp_path, args, why):
    ckpt, val = tmp_path / 'ckpt', tmp_path / 'val'
    ckpt.mkdir(); (ckpt / 'config.json').write_text('{}'); val.mkdir(); (val / 'manifest.json').write_text('{}')
    argv = [a.format(tmp=tmp_path, ckpt=ckpt, val=val) for a in args]
    r = subprocess.run([str(BIN / 'dflash_treecal'), *argv], capture_output=True, text=True, timeout=120, env={**__import__('os').environ, 'DFLASH_ERRORS': str(tmp_path / 'errs')})
    assert r.returncode == 1 and why in r.stderr and r.stderr.startswith('dflash_treecal: error:'), r.stderr
