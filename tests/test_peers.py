"The peers' formats (`dflash.peers`): SpecForge's and speculators' samples written from a real extraction read back equal, and equal to a fresh capture."
import json
import pytest, torch
from dflash.core import ROOT
REAL_REGEN = ROOT / 'data' / 'real' / 'sharegpt-train-regen.jsonl'


@pytest.mark.slow
def test_peer_formats_round_trip_a_smollm2_sample(tmp_path):
    """SmolLM2-135M-Instruct, 3 conversations extracted at taps 1, 14 and its last layer 29: each peer's files hold what our shards
    hold, bit for bit, and within one bf16 spacing of the target run on each conversation alone with forward hooks."""
    from transformers import AutoModelForCausalLM
    from dflash.gguf import smollm2
    from dflash.extract import extract
    from dflash.extracted import ExtractedDataset
    from dflash.peers import select_taps, to_specforge, read_specforge, to_speculators, read_speculators, capture, capture_gap
    t = str(smollm2())
    x = ExtractedDataset(extract(target=t, data=str(REAL_REGEN), out=str(tmp_path / 'x'), layer_ids=[1, 14, 29], max_samples=3,
                                 store_dtype='bf16', progress=False)['out'], require_complete=True)
    H, n = x.hidden_size, len(x)
    assert n == 3 and H == 576
    sf = to_specforge(ExtractedDataset(select_taps(x.out, tmp_path / 'x14', [1, 14])), tmp_path / 'sf')
    assert sf['written'] == n - len(sf['left_out'])
    assert to_speculators(x, tmp_path / 'sp', taps=[1, 14], last=29) == n
    assert json.loads((tmp_path / 'sp' / 'layers.json').read_text())['aux_hidden_state_layer_ids'] == [2, 15]
    model = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    files = {int(f.stem.split('_')[1]): f for f in (tmp_path / 'sf').rglob('*.ckpt')}
    for i in range(n):
        ours = x[i]
        (sp, last) = read_speculators(tmp_path / 'sp', i)
        assert sp['sample_id'] == ours['sample_id'] and torch.equal(sp['input_ids'], ours['input_ids']) and torch.equal(sp['loss_mask'], ours['loss_mask'])
        assert torch.equal(sp['hidden_states'], ours['hidden_states'][:, :2 * H]) and torch.equal(last, ours['hidden_states'][:, 2 * H:])
        fresh = capture(model, ours['input_ids'], [1, 14, 29])
        gaps = [capture_gap(sp['hidden_states'][:, :H], fresh[0]), capture_gap(sp['hidden_states'][:, H:], fresh[1]), capture_gap(last, fresh[2])]
        if ours['sample_id'] in files:
            s = read_specforge(files[ours['sample_id']])
            assert s['hidden_states'].dtype == torch.bfloat16 and s['input_ids'].dtype == torch.int64 and s['input_ids'].dim() == 1
            assert torch.equal(s['hidden_states'], ours['hidden_states'][:, :2 * H]) and torch.equal(s['loss_mask'], ours['loss_mask'])
            gaps += [capture_gap(s['hidden_states'][:, j * H:(j + 1) * H], fresh[j]) for j in range(2)]
        assert max(gaps) <= 1.0, gaps
        # a wrong layer is far off: the capture of layer 13 against the stored tap 14
        assert capture_gap(sp['hidden_states'][:, H:], capture(model, ours['input_ids'], [13])[0]) > 10
