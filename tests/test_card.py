"""The model card of a published drafter says what the run trained it with and how far its confidence can be trusted: the loss terms
and the slots' weighting as the run resolved them (DSpark's paper mix when `loss_terms` is unset, a DFlash run's `--loss-terms`), and
for DSpark the per-slot temperatures beside it, flagging any the fit left at its grid's edge."""
import math
from types import SimpleNamespace
import pytest, torch
from dflash.core import TINY_TARGET
from dflash.tiny_target import random_qwen3
from dflash.model import DFlashDraftModel, drafter_config
from dflash.dspark import DSparkDraftModel, dspark_config, STS_FILE, write_sts
from dflash.publish import save_drafter, model_card
from dflash.recipe import TrainConfig
from dflash.designs import DESIGNS
from dflash.loss import parse_terms, needs_target, tree_loss_budget
from dflash.release import _trained_how


@pytest.fixture(scope='module')
def target(tok): return random_qwen3(len(tok))


def run(**kw): return TrainConfig(target=str(TINY_TARGET), num_anchors=16, lr=1e-3, token_budget=1024, **kw)


def trained(model, cfg):
    "A trainer of `model` that ran `cfg`, with what `resolve` makes of its loss: the terms (the design's own where it names none), a tree's budget."
    terms = parse_terms(cfg.loss_terms) if cfg.loss_terms else dict(DESIGNS[cfg.arch].default_terms)
    return SimpleNamespace(model=model, step=6, tokens=1234, resolved=SimpleNamespace(loss_terms=terms, final_states=needs_target(terms),
                                                                                   loss_tree_budget=tree_loss_budget(cfg.loss)))


def test_card_names_dspark_paper_loss_when_terms_unset(tok, target):
    "A DSpark run that left `loss_terms` unset trained with the paper's 0.1 CE + 0.9 L1, the confidence BCE and the decay exp(-k/4): said."
    m = DSparkDraftModel(dspark_config(target.config, 1, 7, tok.mask_token_id, markov_rank=8))
    how = _trained_how(c := run(arch='dspark', loss='decay'), trained(m, c), '')
    assert '0.1 CE + 0.9 L1 (`--loss-terms ce:0.1,l1:0.9`)' in how and "1 x the confidence head's BCE" in how
    assert 'exp(-k/4), k = 0..6' in how


def test_card_names_given_loss_terms_and_weighting(tok, target):
    "A DFlash run with `--loss-terms ce:0.1,l1:0.9`: the terms and the slots' weighting (decay with its gamma, or D-PACE) are said."
    m = DFlashDraftModel(drafter_config(target.config, 1, 16, tok.mask_token_id))
    how = _trained_how(c := run(loss_terms='ce:0.1,l1:0.9', loss='decay'), trained(m, c), '')
    assert '0.1 CE + 0.9 L1 (`--loss-terms ce:0.1,l1:0.9`)' in how and 'exp(-(k-1)/7), k = 1..15' in how and 'confidence' not in how
    dpace = _trained_how(c := run(loss='dpace'), trained(m, c), '')
    assert 'D-PACE (alpha 0.5' in dpace and 'CE (`--loss-terms ce`)' in dpace


def test_card_flags_sts_temperatures_at_the_grid_edge(tok, target, tmp_path):
    "Temperatures beside a DSpark drafter are on its card; one at e^3 or e^-3 is flagged as the fit's bound; none: uncalibrated."
    m = DSparkDraftModel(dspark_config(target.config, 1, 4, tok.mask_token_id, markov_rank=8))
    save_drafter(m, tmp_path)
    assert 'uncalibrated' in model_card(tmp_path).read_text()
    write_sts(tmp_path / STS_FILE, [1.2, math.exp(3), 0.9, math.exp(-3)])
    card = model_card(tmp_path).read_text()
    assert 'slots 1, 3 is at the edge' in card and 'the fit hit its bound' in card and '20.1' in card
    write_sts(tmp_path / STS_FILE, [1.2, 2.0, 0.9, 1.0])
    assert 'the fit hit its bound' not in model_card(tmp_path).read_text()
