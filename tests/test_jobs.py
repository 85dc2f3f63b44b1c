"The four jobs: one statement of their parameters (dataclass, CLI, papermill cell), checked before any work, runnable by papermill."
import ast, json, subprocess, sys
from dataclasses import fields
from pathlib import Path
import pytest
from dflash.core import ROOT
from dflash.data import PrepareConfig
from dflash.extract import ExtractConfig
from dflash.evaluate import EvalConfig
from dflash.recipe import TrainConfig

JOBS = {'data': PrepareConfig, 'extract': ExtractConfig, 'evaluate': EvalConfig, 'train': TrainConfig}
PAPERMILL = Path(sys.executable).parent / 'papermill'


def cells(name):
    return json.loads((ROOT / 'nbs' / f'{name}.ipynb').read_text())['cells']


def parameters_cell(name):
    "Index and source of the notebook's cell tagged `parameters`."
    i, c = next((i, c) for i, c in enumerate(cells(name)) if 'parameters' in c.get('metadata', {}).get('tags', []))
    return i, ''.join(c['source'])


@pytest.mark.parametrize('name', list(JOBS))
def test_parameters_cell_states_the_dataclass(name):
    "Every name in the notebook's parameters cell is a field of the job's dataclass, with the same default or None (not given)."
    _, src = parameters_cell(name)
    given = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(src).body if isinstance(n, ast.Assign)}
    defaults = {f.name: f.default for f in fields(JOBS[name])}
    assert given and set(given) <= set(defaults), set(given) - set(defaults)
    assert {k: v for k, v in given.items() if v != defaults[k] and v is not None} == {}


@pytest.mark.parametrize('name', list(JOBS))
def test_every_parameter_has_help_and_a_cli_option(name):
    from dflash.core import job_parser
    text = job_parser(JOBS[name], 'x').format_help()
    for f in fields(JOBS[name]):
        assert f.metadata.get('help'), f'{name}: {f.name} has no help text'
        assert '--' + f.name.replace('_', '-') in text


@pytest.mark.parametrize('name,bad,msg', [('extract', ['-p', 'gpus', 'four'], "gpus='four': must be an integer"),
                                          ('train', ['-p', 'lr', '-1'], 'lr=-1.0: must be > 0'),
                                          ('data', ['-p', 'max_length', '-5'], 'max_length=-5: must be >= 2'),
                                          ('evaluate', ['-p', 'drafter', '/nonexistent'], 'is not a drafter checkpoint')])
def test_papermill_bad_parameter_stops_at_the_check(name, bad, msg, tmp_path):
    "A bad parameter stops the job in the cell right after the parameters: none of the notebook's lessons run first."
    out = tmp_path / 'out.ipynb'
    r = subprocess.run([str(PAPERMILL), str(ROOT / 'nbs' / f'{name}.ipynb'), str(out), *bad, '--cwd', str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and msg in r.stderr + r.stdout, (r.stderr + r.stdout)[-3000:]
    code = [c for c in json.loads(out.read_text())['cells'] if c['cell_type'] == 'code']
    failed = next(i for i, c in enumerate(code) if any(o.get('output_type') == 'error' for o in c.get('outputs', [])))
    assert 'from_params(globals())' in ''.join(code[failed]['source']), 'the job fails in its check cell'
    assert not any(c.get('execution_count') for c in code[failed + 1:]), 'no cell after the check ran'


def test_papermill_runs_the_data_job(tmp_path):
    "The data notebook as a papermill job, on the first rows of the embedded corpus: its dataset and report land in `out`."
    out = tmp_path / 'data'
    r = subprocess.run([str(PAPERMILL), str(ROOT / 'nbs' / 'data.ipynb'), str(tmp_path / 'out.ipynb'), '-p', 'out', str(out),
                        '-p', 'max_samples', '30', '--cwd', str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / 'meta.json').read_text())['n'] == 30 and json.loads((out / 'report.json').read_text())['rows'] == 30
    assert json.loads((out / 'config.json').read_text())['config']['max_samples'] == 30
