"""A run checkpointed by an earlier version of this code (tests/fixtures/resume-v1, made by tools/resume_fixture.py on 2026-12-04,
before the run was resolved once) still resumes: its config, its trainer state and its drafter's files are read as they were written."""
import json, shutil, subprocess, sys
from pathlib import Path
from dflash.core import read_metrics

FIX = Path(__file__).parent / 'fixtures' / 'resume-v1'
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tools'))
from resume_fixture import ARGS


def test_a_checkpoint_of_an_earlier_layout_resumes(tmp_path):
    run = tmp_path / 'run'; shutil.copytree(FIX / 'run', run)
    subprocess.run([str(BIN / 'dflash_extract'), '--target', str(FIX / 'target'), '--data', str(FIX / 'rows.jsonl'), '--out', str(tmp_path / 'x'),
                    '--layer-ids', '0', '--no-progress'], check=True, capture_output=True)
    r = subprocess.run([str(BIN / 'dflash_train'), '--target', str(FIX / 'target'), '--extracted', str(tmp_path / 'x'), '--out', str(run),
                        *map(str, ARGS), '--max-steps', '4', '--resume', '--resume-changes', 'max_steps'], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and 'resumed from' in r.stdout and 'at step 2' in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert [m['step'] for m in read_metrics(run) if 'loss' in m] == [1, 2, 3, 4]
    assert (run / 'drafter' / 'model.safetensors').exists() and (run / 'checkpoints' / 'step-4' / 'COMPLETE').exists()
