"""The pipeline splits both wings compute alike: the runner sizes and prints them (`runner up
--dry-run`, `parallel.partition auto` beside the uniform split), the trainer runs them."""

from __future__ import annotations


def uniform_bounds(num_layers: int, num_stages: int) -> list[int]:
    """`uniform_transformer`: layer boundaries [0, ..., num_layers] with equal counts per stage,
    earlier stages taking the remainder (as picotron does)."""
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def balanced_bounds(weights: list[int], num_parts: int) -> list[int]:
    """Contiguous split of `weights` into `num_parts` non-empty parts minimising the heaviest part
    (ValueError when there are fewer items than parts).

    Dynamic programming over (items, parts); ties go to the split whose earlier parts are
    larger, which keeps `uniform` consistent with `uniform_transformer` on round numbers.
    """
    n = len(weights)
    if num_parts > n:
        raise ValueError(f"parallel.partition: {n} items cannot fill {num_parts} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-part weight splitting the first i items into k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(i - 1, k - 2, -1):  # last part = items j..i-1
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    i = n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def items_to_layer_bounds(item_bounds: list[int], num_layers: int) -> list[int]:
    """Item boundaries (item 0 the embeddings, item L+1 the head, item i >= 1 layer i-1) as layer
    boundaries [0, ..., num_layers]."""
    inner = [min(max(b - 1, 0), num_layers) for b in item_bounds[1:-1]]
    return [0, *inner, num_layers]


def uniform_items_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Merak's `uniform`: the embeddings, every layer and the head one item each, balanced."""
    return items_to_layer_bounds(balanced_bounds([1] * (num_layers + 2), num_stages), num_layers)


def parameter_bounds(layer_params: list[int], embed_params: int, head_params: int, num_stages: int) -> list[int]:
    """`parameters`: the items weighted by their parameter counts, balanced."""
    weights = [embed_params, *layer_params, head_params]
    return items_to_layer_bounds(balanced_bounds(weights, num_stages), len(layer_params))
