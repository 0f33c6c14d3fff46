"""Validation metrics (mean@N, best@k, worst@k, maj@k): the vectorised math against brute-force references."""

import itertools
from collections import Counter

import numpy as np
import pytest

from scaletrain.trainer.step import val_metrics
from scaletrain.trainer.step.val_metrics import (
    bootstrap_indices,
    majority_values,
    prompt_metrics,
    subset_sizes,
    validation_metrics,
    vote_codes,
)


def majority_reference(values, votes):
    """verl's rule written plainly: count votes in order of first appearance; the winner's first value."""
    counts = Counter(votes)  # Counter keeps first-appearance order; max() returns the first of the tied
    winner = max(counts, key=counts.get)
    return values[list(votes).index(winner)]


def exact_distribution(values, votes, k):
    """Every ordered draw of k of the samples with replacement (n**k draws, each equally likely):
    the exact best / worst / maj values of the bootstrap."""
    n = len(values)
    best, worst, maj = [], [], []
    for draw in itertools.product(range(n), repeat=k):
        drawn = [values[i] for i in draw]
        best.append(max(drawn))
        worst.append(min(drawn))
        maj.append(majority_reference(drawn, [votes[i] for i in draw]))
    return {"best": np.array(best), "worst": np.array(worst), "maj": np.array(maj)}


def test_subset_sizes_are_powers_of_two_below_n_then_n():
    assert subset_sizes(1) == [] and subset_sizes(0) == []
    assert subset_sizes(2) == [2]
    assert subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(16) == [2, 4, 8, 16]
    assert subset_sizes(17) == [2, 4, 8, 16, 17]


def test_majority_matches_first_appearance_rule_on_random_votes():
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 4, 5, 7):
        votes = rng.integers(0, 3, size=(500, k))  # few answers: many ties
        values = rng.random((500, k))
        got = majority_values(values, votes, 3)
        want = [majority_reference(list(v), list(p)) for v, p in zip(values, votes)]
        np.testing.assert_array_equal(got, want)


def test_prompt_metrics_equal_a_loop_over_the_same_draws():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2, size=(6, 5)).astype(float) * rng.random((6, 5))
    votes = rng.integers(0, 3, size=(6, 5))
    got = prompt_metrics(values, votes, n_bootstrap=200, seed=7)
    assert sorted(got) == sorted(
        ["mean@5", "std@5"]
        + [f"{m}@{k}/{s}" for m in ("best", "worst", "maj") for k in (2, 4, 5) for s in ("mean", "std")]
    )
    np.testing.assert_allclose(got["mean@5"], values.mean(1))
    np.testing.assert_allclose(got["std@5"], values.std(1))
    for k in (2, 4, 5):
        idx = bootstrap_indices(5, k, 200, seed=7)
        for g in range(6):
            draws = {"best": [], "worst": [], "maj": []}
            for row in idx:
                draws["best"].append(max(values[g, row]))
                draws["worst"].append(min(values[g, row]))
                draws["maj"].append(majority_reference(list(values[g, row]), list(votes[g, row])))
            for name, ref in draws.items():
                assert got[f"{name}@{k}/mean"][g] == pytest.approx(np.mean(ref), abs=1e-12)
                assert got[f"{name}@{k}/std"][g] == pytest.approx(np.std(ref), abs=1e-12)


@pytest.mark.parametrize("k", [2, 4])
def test_bootstrap_converges_to_the_exact_enumeration(k):
    values = [1.0, 0.0, 0.0, 0.5]
    votes = [0, 1, 1, 2]  # answer 1 is the most common but scores 0
    exact = exact_distribution(values, votes, k)
    n_bootstrap = 40_000
    got = prompt_metrics(np.array([values]), np.array([votes]), n_bootstrap=n_bootstrap, seed=3)
    for name, dist in exact.items():
        tol = 5 * dist.std() / np.sqrt(n_bootstrap) + 1e-9
        assert got[f"{name}@{k}/mean"][0] == pytest.approx(dist.mean(), abs=tol), name
        assert got[f"{name}@{k}/std"][0] == pytest.approx(dist.std(), abs=0.02), name


def test_single_sample_prompts_only_report_the_mean():
    got = prompt_metrics(np.array([[1.0], [0.0], [1.0]]))
    assert list(got) == ["mean@1"]
    np.testing.assert_array_equal(got["mean@1"], [1.0, 0.0, 1.0])


def test_chunked_draws_equal_unchunked(monkeypatch):
    rng = np.random.default_rng(2)
    values, votes = rng.random((9, 4)), rng.integers(0, 2, size=(9, 4))
    whole = prompt_metrics(values, votes, n_bootstrap=50)
    monkeypatch.setattr(val_metrics, "_MAX_CHUNK_ELEMENTS", 1)  # one prompt per chunk
    chunked = prompt_metrics(values, votes, n_bootstrap=50)
    for name in whole:
        np.testing.assert_allclose(whole[name], chunked[name], rtol=1e-12)  # same draws; summation order aside


def test_vote_codes_equal_answers_equal_codes():
    codes = vote_codes(["12", "7", "12", None, [1, 2], [1, 2], None, 7])
    assert codes[0] == codes[2] and codes[3] == codes[6] and codes[4] == codes[5]
    assert len(set(codes.tolist())) == 5  # "12", "7", None, [1, 2], 7 (an int is not the string "7")


def three_prompts(n=4):
    """Two prompts of source a (uids a0, a1) and one of source b, n samples each, interleaved by prompt."""
    rng = np.random.default_rng(5)
    uids = [u for u in ("a0", "a1", "b0") for _ in range(n)]
    sources = [u[0] for u in uids]
    reward = rng.integers(0, 2, size=len(uids)).astype(float)
    preds = [str(int(r)) if rng.random() < 0.7 else "x" for r in reward]
    return sources, uids, reward, preds


def test_validation_metrics_names_sections_and_prompt_average():
    sources, uids, reward, preds = three_prompts()
    got = validation_metrics(
        sources, uids, {"reward": reward.tolist(), "pred": preds, "note": ["s"] * 12}, n_bootstrap=300
    )
    core_a = {k for k in got if k.startswith("val-core/a/")}
    assert core_a == {
        "val-core/a/reward/mean@4",
        "val-core/a/reward/best@4/mean",
        "val-core/a/reward/best@4/std",
        "val-core/a/reward/maj@4/mean",
        "val-core/a/reward/maj@4/std",
    }
    for name in ("std@4", "best@2/mean", "worst@2/std", "worst@4/mean", "maj@2/mean"):
        assert f"val-aux/a/reward/{name}" in got
    assert not any("/note/" in k or "/pred/" in k for k in got)  # strings are not variables
    # each figure is the mean over the source's prompts of the per-prompt figure
    per_prompt = [
        prompt_metrics(reward[i : i + 4][None], vote_codes(preds[i : i + 4])[None], n_bootstrap=300) for i in (0, 4)
    ]
    for name in ("mean@4", "best@2/mean", "worst@4/std", "maj@4/mean"):
        section = "val-core" if name in ("mean@4", "maj@4/mean") else "val-aux"
        want = np.mean([m[name][0] for m in per_prompt])
        assert got[f"{section}/a/reward/{name}"] == pytest.approx(want, abs=1e-12)
    assert got["val-core/b/reward/mean@4"] == pytest.approx(reward[8:].mean())


def test_maj_only_with_preds_and_acc_is_the_core_variable_when_present():
    sources, uids, reward, _ = three_prompts()
    no_pred = validation_metrics(sources, uids, {"reward": reward.tolist()}, n_bootstrap=50)
    assert not any("maj@" in k for k in no_pred) and "val-core/a/reward/best@4/mean" in no_pred
    acc = [bool(r) for r in reward]
    with_acc = validation_metrics(sources, uids, {"reward": reward.tolist(), "acc": acc}, n_bootstrap=50)
    assert "val-core/a/acc/mean@4" in with_acc and "val-aux/a/reward/mean@4" in with_acc
    assert with_acc["val-core/a/acc/mean@4"] == pytest.approx(with_acc["val-aux/a/reward/mean@4"])


def test_reproducible_and_independent_of_prompt_order():
    sources, uids, reward, preds = three_prompts(n=5)
    columns = {"reward": reward.tolist(), "pred": preds}
    first = validation_metrics(sources, uids, columns, n_bootstrap=100)
    assert validation_metrics(sources, uids, columns, n_bootstrap=100) == first
    assert validation_metrics(sources, uids, columns, n_bootstrap=100, seed=1) != first
    # prompts in another order and their samples interleaved (each prompt's own samples keep their order)
    order = [p * 5 + j for j in range(5) for p in (2, 1, 0)]
    shuffled = validation_metrics(
        [sources[i] for i in order],
        [uids[i] for i in order],
        {k: [v[i] for i in order] for k, v in columns.items()},
        n_bootstrap=100,
    )
    assert shuffled.keys() == first.keys()
    for key, value in first.items():
        assert shuffled[key] == pytest.approx(value, abs=1e-12), key


def test_prompts_with_different_sample_counts_are_averaged_per_metric():
    uids = ["p"] * 4 + ["q"] * 2
    got = validation_metrics(["s"] * 6, uids, {"reward": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]}, n_bootstrap=50)
    assert got["val-core/s/reward/mean@4"] == pytest.approx(0.25)
    assert got["val-aux/s/reward/mean@2"] == pytest.approx(1.0)
    assert got["val-aux/s/reward/best@2/mean"] == pytest.approx(
        (1.0 + np.mean([max(a, b) for a, b in np.array([1.0, 0.0, 0.0, 0.0])[bootstrap_indices(4, 2, 50)]])) / 2
    )
