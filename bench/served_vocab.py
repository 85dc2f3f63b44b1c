"""One drafter in llama.cpp through the target's head and through a head of its own (a run's `drafter/` and `drafter-vocab/`), side
by side in one process: the same prompts decoded by the target alone and by each form, round after round, so the load on the
machine falls on all three alike.

    .venv/bin/python bench/served_vocab.py --train runs/real-demo/train [--prompts 4] [--tokens 64] [--rounds 5] [--n-max 1]

Prints, per form, the seconds, the tokens, the speculative steps and the tokens accepted, the ms a token and a step, and the
speed-up (the target alone's seconds over the form's, for the same tokens). Greedy, f16 target, 2 threads.
"""
import argparse, json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument('--train', required=True, help="a run's folder with drafter/ and drafter-vocab/")
    a.add_argument('--prompts', type=int, default=4); a.add_argument('--tokens', type=int, default=64)
    a.add_argument('--rounds', type=int, default=5); a.add_argument('--n-max', type=int, default=1); a.add_argument('--threads', type=int, default=2)
    a = a.parse_args(argv)
    from dflash.engine import to_gguf, Engine
    from dflash.gguf import smollm2
    from dflash.evaluate import load_prompts
    from dflash.taps import load_tokenizer
    t = smollm2(); ps = load_prompts(load_tokenizer(t), ROOT / 'data' / 'real' / 'sharegpt-prompts-heldout.jsonl', a.prompts)
    tg = to_gguf(t)
    engines = {k: Engine(tg, to_gguf(Path(a.train) / k, t), n_max=a.n_max, kind='dflash', threads=a.threads) for k in ('drafter', 'drafter-vocab')}
    engines['target alone'] = Engine(tg, None, threads=a.threads)
    res = {k: [0.0, 0, 0, 0] for k in engines}
    for _ in range(a.rounds):
        for k, e in engines.items():
            for p in ps:
                o = e.complete(p, a.tokens)
                for i, v in enumerate((o['seconds'], o['decodes'] + o.get('accepted', 0), o.get('drafts', 0), o.get('accepted', 0))): res[k][i] += v
    alone = res['target alone'][0]
    out = {k: dict(seconds=round(s, 2), tokens=n, steps=d, accepted=acc, ms_per_token=round(1e3 * s / n, 2),
                   ms_per_step=round(1e3 * s / d, 2) if d else None, speedup=round(alone / s, 3)) for k, (s, n, d, acc) in res.items()}
    print(json.dumps(out, indent=1))
    return out


if __name__ == '__main__':
    main()
