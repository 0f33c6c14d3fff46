"""``verl.utils.seqlen_balancing``: verl's sequence-length balancing helpers, over scaletrain's partitioners.

``get_seqlen_balanced_partitions`` splits by the largest differencing method (``karmarkar_karp`` in
backends/batching.py), as verl's does; ``greedy_partition`` by scaletrain's longest-first rules
(``balanced_partition`` there, ``equal_count_parts`` of the trainer's ``balance_batch``). Both keep verl's contract
(k non-empty parts, sorted indices, every row once, sums balanced); ties may be broken otherwise than verl's. The
micro-batch helpers balance verl's workload estimate (``calculate_workload``: linear plus attention's quadratic
term) and follow verl's arithmetic: how many micro-batches ``rearrange_micro_batches`` makes (``ceil(total tokens
/ max_token_len)``, at least ``min_num_micro_batch``, the most any DP rank needs with ``same_micro_num_in_dp``,
rounded up to ``num_batches_divided_by``), their order (``use_dynamic_bsz_balance``) and the way back
(``get_reverse_idx``, ``restore_dynamic_batch``).
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from backends.batching import balanced_partition, karmarkar_karp, restore_order
from backends.dist import max_over_ranks
from scaletrain.compat.verl.utils.device import get_device_name
from scaletrain.protocol import DataProto
from scaletrain.protocol.tensordict_ops import index_select_tensor_dict
from scaletrain.trainer.step.balance import equal_count_parts
from scaletrain.utils.errors import InvalidInput

__all__ = [
    "calculate_workload",
    "ceildiv",
    "get_group_balanced_partitions",
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "greedy_partition",
    "karmarkar_karp",
    "log_seqlen_unbalance",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
    "restore_dynamic_batch",
    "roundup_divisible",
]


def ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    return ceildiv(a, b) * b


def calculate_workload(seqlen_list: torch.Tensor) -> torch.Tensor:
    """verl's relative cost of a sequence of each length: a dense block's linear term (hidden 4096: 24576 per
    token) plus attention's quadratic one."""
    return 24576 * seqlen_list + seqlen_list**2


def _checked(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[int]:
    lengths = [int(x) for x in seqlen_list]
    if len(lengths) < k_partitions:
        raise InvalidInput(f"number of items:[{len(lengths)}] < k_partitions:[{k_partitions}]")
    if equal_size and len(lengths) % k_partitions:
        raise InvalidInput(f"{len(lengths)} items do not split into {k_partitions} partitions of equal size")
    return lengths


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """``k_partitions`` non-empty lists of sorted indices with balanced length sums (``equal_size``: equal row
    counts, which needs ``len(seqlen_list) % k_partitions == 0``), by the largest differencing method."""
    return karmarkar_karp(_checked(seqlen_list, k_partitions, equal_size), k_partitions, equal_size)


def greedy_partition(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """As ``get_seqlen_balanced_partitions``, by the longest-first greedy rule."""
    lengths = _checked(seqlen_list, k_partitions, equal_size)
    return equal_count_parts(lengths, k_partitions) if equal_size else balanced_partition(lengths, k_partitions)


def log_seqlen_unbalance(seqlen_list: list[int], partitions: list[list[int]], prefix: str) -> dict[str, float]:
    """Metrics of the length sums: of consecutive equal chunks (the split before balancing: ``min``, ``max``,
    ``minmax_diff``), of ``partitions`` (``balanced_min``, ``balanced_max``), and the ``mean`` per partition."""
    size = len(seqlen_list) // len(partitions)
    chunks = [sum(seqlen_list[start : start + size]) for start in range(0, len(seqlen_list), size)]
    balanced = [sum(seqlen_list[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": min(chunks),
        f"{prefix}/max": max(chunks),
        f"{prefix}/minmax_diff": max(chunks) - min(chunks),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(chunks) / len(partitions),
    }


def _micro_batch_count(n_rows: int, total_tokens: int, max_token_len: int, **options: Any) -> int:
    count = min(n_rows, ceildiv(total_tokens, max_token_len))
    if options["min_num_micro_batch"] is not None:
        count = max(options["min_num_micro_batch"], count)
    group = options["dp_group"]
    if dist.is_initialized() and options["same_micro_num_in_dp"] and group is not None:
        (count,) = max_over_ranks([count], torch.device(get_device_name()), group)
    if options["num_batches_divided_by"] is not None:
        count = roundup_divisible(count, options["num_batches_divided_by"])
    if count > n_rows:
        raise InvalidInput(f"{count} micro-batches asked for {n_rows} rows")
    return count


def _rise_and_fall(parts: list[list[int]], loads: list[int]) -> list[list[int]]:
    """verl's micro-batch order: ranked by load, every other one ascending, then the rest descending, so the loads
    rise to the heaviest micro-batch and fall after it (the lightest ones at both ends)."""
    order = sorted(range(len(parts)), key=lambda p: (loads[p], parts[p][0] if parts[p] else 0), reverse=True)
    ranked = [parts[p] for p in order]
    return ranked[::2][::-1] + ranked[1::2]


def rearrange_micro_batches(
    batch: Any,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
) -> tuple[list[Any], list[list[int]]]:
    """A TensorDict with ``attention_mask`` (or jagged ``input_ids``) split into micro-batches by valid tokens:
    (micro-batches, each one's row indices). ``force_group_size`` keeps runs of that many rows together."""
    ids = batch["input_ids"] if "input_ids" in batch.keys() else None
    if ids is not None and ids.is_nested:
        lengths, longest = ids.offsets().diff(), int(ids.offsets().diff().max())
    else:
        lengths, longest = batch["attention_mask"].sum(dim=1), batch["attention_mask"].shape[-1]
    if max_token_len < longest:
        raise InvalidInput(
            f"max_token_len must be greater than the sequence length. Got {max_token_len=} and {longest=}"
        )
    if len(lengths) % force_group_size:
        raise InvalidInput(f"Batch size {len(lengths)} must be divisible by force_group_size {force_group_size}")
    group_loads = calculate_workload(lengths.long()).view(-1, force_group_size).sum(dim=1).tolist()
    count = _micro_batch_count(
        len(group_loads),
        int(lengths.sum()),
        max_token_len,
        dp_group=dp_group,
        num_batches_divided_by=num_batches_divided_by,
        same_micro_num_in_dp=same_micro_num_in_dp,
        min_num_micro_batch=min_num_micro_batch,
    )
    group_parts = get_seqlen_balanced_partitions(group_loads, count, equal_size=False)
    if use_dynamic_bsz_balance:
        group_parts = _rise_and_fall(group_parts, [sum(group_loads[g] for g in part) for part in group_parts])
    parts = [[g * force_group_size + k for g in part for k in range(force_group_size)] for part in group_parts]
    return [index_select_tensor_dict(batch, part) for part in parts], parts


def get_reverse_idx(idx_map: list[int]) -> list[int]:
    """The inverse permutation: ``out[idx_map[i]] = i``."""
    return restore_order([list(idx_map)]).tolist()


def prepare_dynamic_batch(
    data: DataProto,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
) -> tuple[list[DataProto], list[list[int]]]:
    """``rearrange_micro_batches`` on a DataProto: (micro-batch DataProtos with their non-tensor rows and a copy
    of meta_info each, each one's row indices)."""
    batches, parts = rearrange_micro_batches(
        data.batch,
        max_token_len,
        dp_group,
        num_batches_divided_by,
        same_micro_num_in_dp,
        min_num_micro_batch,
        use_dynamic_bsz_balance,
    )
    return [
        DataProto.from_dict(
            dict(tensors.items()),
            {key: value[part] for key, value in data.non_tensor_batch.items()},
            meta_info=copy.deepcopy(data.meta_info),
        )
        for tensors, part in zip(batches, parts)
    ], parts


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: list[list[int]]) -> torch.Tensor:
    """Rows concatenated in micro-batch order back in the original order (a jagged nested tensor too)."""
    indices = sum(len(part) for part in batch_idx_list)
    if indices != data.shape[0]:
        raise InvalidInput(f"{indices} indices for {data.shape[0]} rows")
    reverse = restore_order(batch_idx_list)
    if data.is_nested:
        rows = data.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in reverse], layout=torch.jagged)
    return data[reverse]


def get_group_balanced_partitions(seqlen_list: list[int], uid_list: list, k_partitions: int) -> list[list[int]]:
    """``k_partitions`` parts of balanced length sums that keep each run of equal consecutive uids together (a
    prompt's responses), with an equal number of runs per part."""
    if len(seqlen_list) != len(uid_list):
        raise InvalidInput("seqlen_list and uid_list must have same length")
    runs: list[list[int]] = []
    for i, uid in enumerate(uid_list):
        if runs and uid_list[runs[-1][0]] == uid:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) < k_partitions:
        raise InvalidInput(f"Number of uid groups ({len(runs)}) must be >= k_partitions ({k_partitions})")
    loads = [sum(int(calculate_workload(torch.tensor(int(seqlen_list[i])))) for i in run) for run in runs]
    parts = get_seqlen_balanced_partitions(loads, k_partitions, equal_size=True)
    return [sorted(chain.from_iterable(runs[r] for r in part)) for part in parts]
