"""Record speculators 0.9.0's XPress refiner (`speculators/models/xpress/model_definitions.py`, `XPressRefinerHead`) on a tiny
fixed config, for tests/test_xpress.py.

    .venv/bin/python -m pip download --no-deps speculators==0.9.0 -d /tmp/sp
    .venv/bin/python -m zipfile -e /tmp/sp/speculators-0.9.0-py3-none-any.whl /tmp/sp/wheel
    .venv/bin/python tools/xpress_fixture.py /tmp/sp/wheel

Their module imports torch alone: it is loaded here by path, not installed, and run as it is. Its weights are drawn with a fixed
seed (their init, then the mixer `mix_l`, zero at init, drawn too, so that it mixes), and it is called on fixed block states and
previous tokens: `hidden_cache` (the block's pass-invariant features) and `block_bias` (the bias over each slot's logits); then one
greedy pass over fixed base logits, argmax(base + bias), with slot 0 kept as the anchor, as their training rounds and vLLM's
passes make it. Writes tests/fixtures/xpress_reference.safetensors (their weights under their names, the inputs and the outputs)
and tests/fixtures/xpress_reference.json (the version, the module's sha256, the config)."""
import argparse, hashlib, importlib.util, json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(verifier_vocab_size=96, draft_vocab_size=96, hidden_size=48, block_size=8, rank=16, mlp_ratio=2)


def main(a):
    path = Path(a.wheel) / 'speculators' / 'models' / 'xpress' / 'model_definitions.py'
    spec = importlib.util.spec_from_file_location('xpress_reference', path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    torch.manual_seed(0)
    head = mod.XPressRefinerHead(**CONFIG).eval()
    with torch.no_grad(): head.mix_l.normal_(std=0.3)
    g = torch.Generator().manual_seed(1)
    N, B, V = 5, CONFIG['block_size'], CONFIG['draft_vocab_size']
    h = torch.randn(N, B, CONFIG['hidden_size'], generator=g)
    prev = torch.randint(0, CONFIG['verifier_vocab_size'], (N, B), generator=g)
    base = torch.randn(N, B, V, generator=g) * 0.002                        # small: the bias decides some slots
    anchor = torch.randint(0, V, (N,), generator=g)
    with torch.no_grad():
        hc = head.hidden_cache(h)
        bias = head.block_bias(prev, hcache=hc)
        one_pass = torch.cat([anchor[:, None], (base + bias)[:, 1:].argmax(-1)], 1)
    out = ROOT / 'tests' / 'fixtures'
    save_file({**{k: v.contiguous() for k, v in head.state_dict().items()}, 'in.hidden_states': h, 'in.prev': prev, 'in.base': base,
               'in.anchor': anchor, 'out.hidden_cache': hc, 'out.block_bias': bias, 'out.one_pass': one_pass},
              str(out / 'xpress_reference.safetensors'))
    meta = dict(reference='speculators 0.9.0 (PyPI), speculators/models/xpress/model_definitions.py', license='Apache-2.0',
                module_sha256=hashlib.sha256(path.read_bytes()).hexdigest(), config=CONFIG, torch=torch.__version__,
                keys=sorted(head.state_dict()))
    (out / 'xpress_reference.json').write_text(json.dumps(meta, indent=1) + '\n')
    print(f"wrote {out / 'xpress_reference.safetensors'} ({len(meta['keys'])} weights) and its json", file=sys.stderr)


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('wheel', help="the unzipped speculators 0.9.0 wheel: the folder holding speculators/")
    main(p.parse_args())
