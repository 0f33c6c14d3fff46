"""Validation metrics over several samples per prompt (layer 4, pure numpy): mean@N, best@k, worst@k, maj@k.

Names and meaning follow verl's validation metrics. For each data source, each numeric variable (``reward``: the
sample's total reward, plus every numeric key of the reward manager's extra info, e.g. ``acc``) and each prompt
with N samples:

- ``mean@N`` / ``std@N``: mean and (population) std of the N values;
- for k in the powers of 2 from 2 below N, and N itself: draw ``n_bootstrap`` subsets of k of the N samples (with
  replacement); ``best@k`` / ``worst@k`` is the max / min of a subset, ``maj@k`` the value of the answer most of
  the subset's samples predicted (extra-info key ``pred``; a tie goes to the answer seen first in the subset, whose
  first sample's value counts). ``<name>@k/mean`` and ``<name>@k/std`` are the mean and std over the draws.

Each prompt-level figure is then averaged over the source's prompts. The section is ``val-core`` for the core
variable (``acc`` if the rewards report one, else ``reward``) and the mean / best / maj figures at the largest N,
``val-aux`` for everything else: ``val-core/<source>/reward/mean@4``, ``val-aux/<source>/reward/worst@2/std``.

Draws are seeded by (seed, N, k) only, so a result does not depend on how many prompts there are or their order,
and two runs with the same samples give the same figures. Everything is vectorised: the draws of all prompts with
the same N are one fancy-indexing step (in chunks bounding memory).
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42
VOTE_KEY = "pred"
_MAX_CHUNK_ELEMENTS = 1 << 24  # elements of the largest intermediate array (draws x N vote counts)


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for N = n samples: 2, 4, 8, ... below n, then n; none for n <= 1."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def bootstrap_indices(n: int, k: int, n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED) -> np.ndarray:
    """(n_bootstrap, k) sample positions in [0, n), drawn with replacement; depends on (n, k, seed) only."""
    return np.random.default_rng([seed, n, k]).integers(0, n, size=(n_bootstrap, k))


def majority_values(values: np.ndarray, votes: np.ndarray, n_codes: int) -> np.ndarray:
    """For arrays (..., k) of values and votes (integers in [0, n_codes)): the value of the most frequent vote along
    the last axis (ties: the vote seen first; its first occurrence's value). Returns (...)."""
    shape, k = votes.shape[:-1], votes.shape[-1]
    flat = votes.reshape(-1, k)
    cells = (np.arange(len(flat))[:, None] * n_codes + flat).ravel()  # one (row, vote) counter per position
    counts = np.bincount(cells, minlength=len(flat) * n_codes)
    at_position = counts[cells].reshape(-1, k)  # how often each position's vote occurs
    # the first position holding a most frequent vote is that vote's first occurrence, and no other most frequent
    # vote occurs earlier: the same winner as counting votes in a dict in order of first appearance
    winner = np.argmax(at_position == at_position.max(1, keepdims=True), axis=1).reshape(shape)
    return np.take_along_axis(values, winner[..., None], axis=-1)[..., 0]


def dense_votes(votes: np.ndarray) -> np.ndarray:
    """(G, N) vote codes -> the same votes as codes in [0, N): each sample's code is the position of the first
    sample of its prompt with the same vote."""
    same = votes[:, :, None] == votes[:, None, :]
    return np.argmax(same, axis=-1)


def prompt_metrics(
    values: np.ndarray, votes: np.ndarray | None = None, n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED
) -> dict[str, np.ndarray]:
    """Per-prompt figures of a (G, N) value matrix (G prompts with N samples each); ``votes`` (G, N) integer codes
    of the predicted answers, or None (no maj@k). Returns {metric name: (G,) array}."""
    values = np.asarray(values, dtype=np.float64)
    n_prompts, n = values.shape
    votes = dense_votes(np.asarray(votes)) if votes is not None else None
    out = {f"mean@{n}": values.mean(-1)}
    if n > 1:
        out[f"std@{n}"] = values.std(-1)
    for k in subset_sizes(n):
        idx = bootstrap_indices(n, k, n_bootstrap, seed)
        stats: dict[str, list[np.ndarray]] = defaultdict(list)
        chunk = max(1, _MAX_CHUNK_ELEMENTS // (n_bootstrap * n))
        for lo in range(0, n_prompts, chunk):
            drawn = values[lo : lo + chunk][:, idx]  # (g, n_bootstrap, k)
            stats["best"].append(drawn.max(-1))
            stats["worst"].append(drawn.min(-1))
            if votes is not None:
                stats["maj"].append(majority_values(drawn, votes[lo : lo + chunk][:, idx], n))
        for name, parts in stats.items():
            draws = np.concatenate(parts)  # (G, n_bootstrap)
            out[f"{name}@{k}/mean"] = draws.mean(-1)
            out[f"{name}@{k}/std"] = draws.std(-1)
    return out


def vote_codes(preds: Sequence[Any]) -> np.ndarray:
    """Integer codes of predicted answers: equal answers get equal codes (unhashable ones compare by repr)."""
    codes: dict[Any, int] = {}
    out = np.empty(len(preds), dtype=np.int64)
    for i, pred in enumerate(preds):
        try:
            key = ("value", pred)
            hash(key)
        except TypeError:
            key = ("repr", repr(pred))
        out[i] = codes.setdefault(key, len(codes))
    return out


def numeric_columns(columns: Mapping[str, Sequence[Any]]) -> dict[str, np.ndarray]:
    """The columns whose every value is a number (bools count) as float arrays; the vote key is never one."""
    out = {}
    for name, column in columns.items():
        if name == VOTE_KEY or not len(column):
            continue
        if all(isinstance(v, (numbers.Real, np.bool_)) for v in column):
            out[name] = np.asarray(column, dtype=np.float64)
    return out


def group_prompts(data_sources: Sequence[str], uids: Sequence[Any]) -> dict[str, dict[int, np.ndarray]]:
    """{source: {N: (G, N) row indices}}: each source's prompts (rows sharing a uid), bucketed by sample count."""
    rows: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        rows[str(source)][uid].append(i)
    grouped: dict[str, dict[int, np.ndarray]] = {}
    for source, by_uid in rows.items():
        by_n: dict[int, list[list[int]]] = defaultdict(list)
        for indices in by_uid.values():
            by_n[len(indices)].append(indices)
        grouped[source] = {n: np.asarray(prompts, dtype=np.int64) for n, prompts in by_n.items()}
    return grouped


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    n_bootstrap: int = N_BOOTSTRAP,
    seed: int = SEED,
) -> dict[str, float]:
    """``{"val-core/<source>/<var>/<metric>": value, "val-aux/...": ...}`` over all samples of a validation run.

    ``columns``: one value per sample for each variable (``reward`` and the reward extra info); the ``pred`` column,
    if present, is the vote for maj@k. Samples of one prompt share a uid."""
    numeric = numeric_columns(columns)
    codes = vote_codes(columns[VOTE_KEY]) if VOTE_KEY in columns else None
    sums: dict[tuple[str, str, str], list[np.ndarray]] = defaultdict(list)
    for source, by_n in group_prompts(data_sources, uids).items():
        for rows in by_n.values():
            votes = codes[rows] if codes is not None else None
            for var, values in numeric.items():
                for metric, per_prompt in prompt_metrics(values[rows], votes, n_bootstrap, seed).items():
                    sums[(source, var, metric)].append(per_prompt)
    averaged = {key: float(np.concatenate(parts).mean()) for key, parts in sums.items()}
    core = _core_keys(list(averaged))
    return {f"{'val-core' if key in core else 'val-aux'}/{'/'.join(key)}": value for key, value in averaged.items()}


def _at(metric: str) -> int:
    """``best@4/mean`` -> 4."""
    return int(metric.split("@")[1].split("/")[0])


def _core_keys(keys: list[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """The (source, var, metric) keys of the ``val-core`` section: per source, the core variable's (``acc`` if
    present, else ``reward``) mean / best / maj figures at its largest N."""
    variables: dict[str, set[str]] = defaultdict(set)
    n_max: dict[tuple[str, str], int] = defaultdict(int)
    for source, var, metric in keys:
        variables[source].add(var)
        n_max[(source, var)] = max(n_max[(source, var)], _at(metric))
    return {
        (source, var, metric)
        for source, var, metric in keys
        if var == ("acc" if "acc" in variables[source] else "reward")
        and metric.split("@")[0] in ("mean", "best", "maj")
        and _at(metric) == n_max[(source, var)]
    }
